//! Checkpoints: taken and restored, named, deferred or refused, superseded
//! ones' retention, periodic ones, and ones whose record has not landed.

use std::sync::atomic::{AtomicBool, Ordering};

use super::hooked_store::{BeforeRequest, EditBeforeWrite, HookedStore, Request};
use super::*;
use crate::store::StoreError;

#[tokio::test]
async fn checkpoint_is_recorded_and_restore_brings_the_memory_back() {
    use SandboxEvent::{CheckpointStarted, LeaseReleased, LeaseReleasing, Stopping};
    let (world, a, id) = World::with_a_sandbox().await;
    a.run(&id, "x=1").await;

    let mut events = a.controller.subscribe(&id);
    a.ask(&id, DesiredState::Checkpointed, Some("first")).await;
    assert_eq!(a.pass(&id).await, Requeue::Never);
    let seen = drain(&mut events);
    assert_eq!(seen[..2], [CheckpointStarted, Stopping]);
    assert_eq!(seen[2..4], [LeaseReleasing, LeaseReleased]);
    assert!(
        matches!(&seen[4..], [SandboxEvent::Checkpointed { image }] if image.ends_with("checkpoint.img")),
        "{seen:?}"
    );
    assert!(!a.runs(&id));
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Checkpointed);
    assert_eq!(status.holder, None);
    let latest = status.latest_checkpoint.unwrap();
    assert_eq!(latest.name.as_deref(), Some("first"));
    assert_eq!(status.named_checkpoints["first"], latest);
    assert_eq!(world.lease(&id).await.holder, None);

    // Another instance restores it: same memory, next epoch.
    let b = world.instance("b");
    b.bring_here(&id).await;
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["x=1".to_owned()]);
    let status = world.metadata(&id).await.status;
    assert_eq!((status.phase, status.epoch), (Phase::Running, 2));
    assert_eq!(b.runtime.counts(), (0, 1));
}

#[tokio::test]
async fn a_named_checkpoint_is_restored_once_then_the_latest_again() {
    let (world, a, id) = World::with_a_sandbox().await;
    a.run(&id, "one").await;
    a.checkpoint(&id, Some("early")).await;
    a.bring_here(&id).await;
    a.run(&id, "two").await;
    a.checkpoint(&id, None).await;

    a.request_here(&id, Some("early")).await.unwrap();
    a.pass(&id).await;
    assert_eq!(a.runtime.memory(&id).unwrap(), vec!["one".to_owned()]);

    // The request was one-shot: the next checkpoint/restore uses the latest.
    a.run(&id, "three").await;
    a.checkpoint(&id, None).await;
    world.clock.advance(Duration::seconds(1));
    a.bring_here(&id).await;
    assert_eq!(a.runtime.memory(&id).unwrap(), vec!["one", "three"]);
}

#[tokio::test]
async fn an_unknown_checkpoint_name_fails_the_restore_and_keeps_the_sandbox() {
    let (world, a, id) = World::with_a_sandbox().await;
    a.checkpoint(&id, None).await;
    let mut events = a.controller.subscribe(&id);
    a.request_here(&id, Some("nope")).await.unwrap();
    a.pass(&id).await;
    let failed = restore_failed(StartFailure::NoNamedCheckpoint("nope".into()));
    let (acquiring, acquired) = (SandboxEvent::LeaseAcquiring, SandboxEvent::LeaseAcquired);
    assert_eq!(drain(&mut events), [acquiring, acquired, failed]);
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Checkpointed, "not left Restoring");
    assert!(status.latest_checkpoint.is_some());
    assert_eq!(world.lease(&id).await.holder, None);
}

#[tokio::test]
async fn a_checkpoint_waits_for_a_running_execution() {
    let (world, a, id) = World::with_a_sandbox().await;
    let execution = a.exec(&id, "hold").await;
    let mut events = a.controller.subscribe(&id);
    let asked = a.send_state(&id, DesiredState::Checkpointed).await;
    assert!(matches!(a.pass(&id).await, Requeue::After(_)));
    asked.await.unwrap().unwrap();
    let waits = SandboxEvent::CheckpointWaitsForExecution;
    assert_eq!(drain(&mut events), [SandboxEvent::CheckpointStarted, waits]);
    assert!(a.runs(&id));
    execution.control.kill().await.unwrap();
    a.pass(&id).await;
    assert_eq!(world.metadata(&id).await.status.phase, Phase::Checkpointed);
}

#[tokio::test]
async fn superseded_checkpoints_beyond_the_kept_ones_are_deleted_named_ones_stay() {
    let (world, a, id) = World::with_a_sandbox().await;
    let mut images = Vec::new();
    for (round, name) in [Some("keep-me"), None, None, None, None].iter().enumerate() {
        a.run(&id, &format!("round {round}")).await;
        a.checkpoint(&id, *name).await;
        let latest = world.metadata(&id).await.status.latest_checkpoint;
        images.push(latest.unwrap().path);
        world.clock.advance(Duration::seconds(1));
        a.bring_here(&id).await;
    }
    let previous = world.metadata(&id).await.status.previous_checkpoints;
    let previous: Vec<_> = previous.into_iter().map(|c| c.path).collect();
    let kept = [images[3].clone(), images[2].clone()];
    assert_eq!(previous, kept, "newest first, two kept");
    let exists = |path: &str| world.exists(ObjectKey::new(path).unwrap());
    assert!(exists(&images[0]).await, "the named checkpoint stays");
    assert!(!exists(&images[1]).await, "the oldest unnamed one is gone");
    for kept in &images[2..] {
        assert!(exists(kept).await);
    }
}

fn checkpointing_every_minute(world: &World) -> Instance {
    world.instance_with("a", checkpointing(true))
}

#[tokio::test]
async fn periodic_checkpoints_bound_what_a_crash_loses() {
    let world = World::new();
    let a = checkpointing_every_minute(&world);
    let id = a.create(&world).await;
    a.run(&id, "saved").await;
    let mut events = a.controller.subscribe(&id);
    a.live_through(&world, 61).await;
    a.pass(&id).await;
    assert!(drain(&mut events).is_empty(), "silent to the client");
    let memory = a.runtime.memory(&id).unwrap();
    assert_eq!(memory, vec!["saved"], "still running here");
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Running);
    assert!(status.latest_checkpoint.is_some());
    a.run(&id, "lost").await;

    // A dies; B takes over after the lease and gets the periodic checkpoint.
    a.runtime.crash(&id);
    let b = world.instance("b");
    world.clock.advance(Duration::seconds(40));
    b.bring_here(&id).await;
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["saved".to_owned()]);
}

/// A failed periodic checkpoint decides nothing: it is retried an interval
/// later (not at once); the next pass's table marks a sandbox it lost died.
#[tokio::test]
async fn a_failed_periodic_checkpoint_waits_an_interval_and_the_table_marks_a_lost_sandbox_died() {
    let world = World::new();
    let a = checkpointing_every_minute(&world);
    let id = a.create(&world).await;
    a.live_through(&world, 61).await;
    a.runtime.lose_on_checkpoint(&id);
    let mut events = a.controller.subscribe(&id);
    a.pass(&id).await;
    assert!(!a.runs(&id), "the checkpoint took it down");
    assert_eq!(world.metadata(&id).await.status.phase, Phase::Running);
    a.pass(&id).await;
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Failed, "the table marked it died");
    assert_eq!(world.lease(&id).await.holder, None, "and released it");
    assert_eq!(drain(&mut events), [SandboxEvent::Lost(LossCause::Died)]);

    // One an execution defers waits an interval too (each try reads both).
    let id = a.create(&world).await;
    let execution = a.exec(&id, "hold").await;
    a.live_through(&world, 61).await;
    let restores = a.runtime.counts().1;
    let at_once = Requeue::After(std::time::Duration::ZERO);
    assert_eq!(a.pass(&id).await, at_once);
    assert_ne!(a.pass(&id).await, at_once, "not tried again at once");
    execution.control.kill().await.unwrap();
    a.live_through(&world, 61).await;
    a.pass(&id).await;
    let restored = a.runtime.counts().1;
    assert_eq!(restored, restores + 1, "checkpointed an interval later");
}

#[tokio::test]
async fn a_checkpoint_of_a_sandbox_not_made_for_it_is_refused_and_it_keeps_running() {
    let world = World::new();
    let a = world.instance("a");
    let (id, metadata) = world.new_sandbox(false);
    a.create_from(&metadata).await.unwrap();
    a.pass(&id).await;
    let mut events = a.controller.subscribe(&id);
    let asked = a.send_state(&id, DesiredState::Checkpointed).await;
    assert!(matches!(a.pass(&id).await, Requeue::After(_)));
    asked.await.unwrap().unwrap();
    let refused = SandboxEvent::CheckpointFailed(CheckpointFailure::NotConfigured);
    assert_eq!(drain(&mut events), [refused]);
    assert!(a.runs(&id));
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Running);
    let error = status.last_error.unwrap_or_default();
    let recorded = error.contains("without enable_checkpoint");
    assert!(recorded, "recorded for operators");
}

/// While `closed`, a `metadata.json` write waits for the gate, then fails.
#[derive(Debug)]
pub(super) struct GatedMetadataWrites {
    closed: AtomicBool,
    pub(super) gate: tokio::sync::Semaphore,
}

type Gated = Arc<HookedStore<GatedMetadataWrites>>;

#[async_trait::async_trait]
impl BeforeRequest for GatedMetadataWrites {
    async fn before(&self, request: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        if request.writes("metadata.json")
            && self.closed.load(Ordering::SeqCst)
            && let Some(key) = request.key
        {
            let _passed = self.gate.acquire().await;
            return Err(StoreError::transient(key, "the bucket is unreachable"));
        }
        Ok(())
    }
}

/// A world whose `metadata.json` writes can be held and failed.
fn gated_world() -> (World, Gated) {
    let (closed, gate) = (AtomicBool::new(false), tokio::sync::Semaphore::new(0));
    World::hooked(GatedMetadataWrites { closed, gate })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_here_does_not_wait_for_its_intent_write() {
    let (world, gated, a, id) = checkpointed_before_its_record(None).await;
    let mut events = a.controller.subscribe(&id);
    assert!(!a.runs(&id));
    let carried = world.lease(&id).await.checkpoint.map(|c| c.path);
    let carried = carried.is_some_and(|path| path.ends_with("checkpoint.img"));
    assert!(carried, "the hand-back carries the checkpoint");

    // The write then fails: the checkpoint stands, nobody is told it failed.
    gated.hook.gate.add_permits(1000);
    a.reconciler().background_settled().await;
    let seen = drain(&mut events);
    assert!(!heard!(seen, SandboxEvent::CheckpointFailed(_)), "{seen:?}");
}

/// A [`gated_world`] whose `a` checkpointed `x=1` (as `name`) and said so while its intent's
/// write hung (decision 22), its record held at the gate (until it opens); other writes pass again.
pub(super) async fn checkpointed_before_its_record(
    name: Option<&str>,
) -> (World, Gated, Instance, SandboxId) {
    let (world, gated) = gated_world();
    let (a, id) = world.a_running("x=1").await;
    gated.hook.closed.store(true, Ordering::SeqCst);
    let mut events = a.controller.subscribe(&id);
    let request = a.request_state(&id, DesiredState::Checkpointed, name);
    let waited = "the request waited for its intent's write";
    within_10s(waited, request).await.unwrap();
    a.reconciler().reconcile(&id).await.unwrap();
    let seen = drain(&mut events);
    assert!(
        heard!(seen, SandboxEvent::Checkpointed { .. }),
        "checkpointed while the intent was being written: {seen:?}"
    );
    let status = world.metadata(&id).await.status;
    let unrecorded = status.latest_checkpoint.is_none() && status.named_checkpoints.is_empty();
    assert!(unrecorded, "the record has not landed: {status:?}");
    gated.hook.closed.store(false, Ordering::SeqCst);
    (world, gated, a, id)
}

/// An attach by the name a client heard CHECKPOINTED for, before its record
/// lands, restores it from the lock (the hand-back carries it, decision 18).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_by_name_finds_a_checkpoint_whose_record_has_not_landed() {
    let (world, gated, a, id) = checkpointed_before_its_record(Some("base")).await;
    let attach = a.request_here(&id, Some("base"));
    let waited = "the attach waited for the record";
    within_10s(waited, attach).await.unwrap();
    let pass = a.reconciler().reconcile(&id);
    let restored = within_10s("the pass waited for the record", pass).await;
    assert!(restored.is_ok(), "{restored:?}");
    assert_eq!(a.runtime.memory(&id).unwrap(), vec!["x=1".to_owned()]);
    gated.hook.gate.add_permits(1000);
    a.reconciler().background_settled().await;
    let status = world.metadata(&id).await.status;
    assert!(status.named_checkpoints.contains_key("base"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_does_not_wait_for_a_status_record_held_up_by_the_write_rate() {
    let (world, gated) = gated_world();
    let (a, id) = world.a_running("state").await;
    let b = world.instance("b");

    // `status` is behind (an edit); `metadata.json` writes hang (write rate).
    world.edit(&id, |m| m.status.phase = Phase::Pending).await;
    gated.hook.closed.store(true, Ordering::SeqCst);
    // A ring without an intent (its write refused, retried): A's pass finds
    // `status` behind, records it in a task of its own, and ends.
    let (store, now, holder) = (world.store.as_ref(), world.clock.now(), named("a"));
    let ring = crate::leasing::ring_doorbell(store, now, &holder, &id, "b");
    ring.await.unwrap();
    assert_eq!(a.answer_doorbell().await, vec![id.clone()]);
    let pass = a.reconciler().reconcile(&id);
    let waited = "the pass waited for its status record";
    within_10s(waited, pass).await.unwrap();

    // B asks for it meanwhile; A's next pass hands it over at once.
    world.clock.advance(Duration::milliseconds(100));
    b.request_here(&id, None).await.unwrap();
    assert_eq!(a.answer_doorbell().await, vec![id.clone()]);
    let pass = a.reconciler().reconcile(&id);
    let waited = "the hand-over waited for the status record";
    within_10s(waited, pass).await.unwrap();
    assert!(!a.runs(&id), "handed over");
    b.reconciler().reconcile(&id).await.unwrap();
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);

    gated.hook.gate.add_permits(1000);
    gated.hook.closed.store(false, Ordering::SeqCst);
    a.reconciler().background_settled().await;
    b.reconciler().background_settled().await;
}

/// A holder cut off mid-checkpoint lost the hold, its hand-back failed, its record landed (the
/// taker records after RUNNING): its client heard CHECKPOINTED of a state the taker never had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_is_not_acknowledged_when_the_hold_was_taken_over_meanwhile() {
    // Armed, `b` takes the lock at the next epoch before the image is written
    // (having restored an older checkpoint; its record not landed).
    let taken_over = EditBeforeWrite {
        before: "checkpoint.img",
        object: lock_key,
        edit: |lease: &mut Lease| {
            lease.holder = Some(named("b"));
            lease.epoch += 1;
            lease.checkpoint = None;
        },
        armed: Default::default(),
    };
    let (world, wrapper) = World::hooked(taken_over);
    let (a, id) = world.a_running("x=1").await;
    let epoch = world.lease(&id).await.epoch;

    let mut events = a.controller.subscribe(&id);
    let asked = a.send_state(&id, DesiredState::Checkpointed).await;
    wrapper.hook.arm(&id);
    let _ = a.reconcile(&id).await;
    asked.await.unwrap().unwrap();
    let seen = drain(&mut events);
    assert!(
        !heard!(seen, SandboxEvent::Checkpointed { .. }),
        "acknowledged although the hold was taken over: {seen:?}"
    );
    assert!(heard!(seen, SandboxEvent::CheckpointFailed(_)), "{seen:?}");
    let taken = world.lease(&id).await.epoch;
    assert_eq!(taken, epoch + 1, "the takeover stands");
}

/// A `metadata.json` read waits while `closed` (counted in `waiting`).
#[derive(Debug, Default)]
struct HeldMetadataReads {
    closed: AtomicBool,
    waiting: std::sync::atomic::AtomicUsize,
    gate: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl BeforeRequest for HeldMetadataReads {
    async fn before(&self, request: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        if request.reads("metadata.json") && self.closed.load(Ordering::SeqCst) {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            self.gate.notified().await;
        }
        Ok(())
    }
}

/// A command arriving while a pass reads both objects is served at once, not after the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_is_served_at_once_while_its_sandboxs_pass_reads() {
    let (world, held) = World::hooked(HeldMetadataReads::default());
    let (a, id) = world.a_running("x=1").await;

    held.hook.closed.store(true, Ordering::SeqCst);
    a.reconciler().want_full_pass(&id);
    let mut events = a.controller.subscribe(&id);
    let pass = a.spawn(
        &id,
        |a, id| async move { a.reconciler().reconcile(&id).await },
    );
    while held.hook.waiting.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    // Sent by hand: the pass may serve it before a look at the inbox would.
    let asked = a.spawn(&id, |a, id| async move {
        a.request_state(&id, DesiredState::Checkpointed, None).await
    });
    let served = within_10s("the command waited for the pass's read", asked);
    served.await.unwrap().unwrap();
    let waited = "the pass waited for its read";
    within_10s(waited, pass).await.unwrap().unwrap();
    let seen = drain(&mut events);
    let checkpointed = heard!(seen, SandboxEvent::Checkpointed { .. });
    assert!(checkpointed, "the same pass checkpointed");
    let reads = held.hook.waiting.load(Ordering::SeqCst);
    assert_eq!(reads, 1, "one read, dropped");
    held.hook.closed.store(false, Ordering::SeqCst);
    held.hook.gate.notify_waiters();
}
