//! Holds and leases: a loser stops without writing, holds live on one
//! instance lease, a lapsed instance re-verifies or stops, orphans go.

use super::hooked_store::EditBeforeWrite;
use super::*;
use crate::fencing::FenceError;
use crate::testing::Fault;

#[tokio::test]
async fn a_holder_that_lost_its_lease_stops_without_writing() {
    let (world, a, id) = World::with_a_sandbox().await;
    // An operator hands the lease to someone else.
    world.hand_lock_to(&id, "c").await;
    let before = world.generation(&metadata_key(&id)).await;
    let mut events = a.controller.subscribe(&id);
    // A raw edit without a ring: noticed at the next resync.
    a.live_through(&world, 30).await;
    assert!(matches!(a.pass(&id).await, Requeue::After(_)));
    assert!(a.runs(&id), "not before the resync");
    a.live_through(&world, 31).await;
    assert_eq!(a.pass(&id).await, Requeue::Never);
    let holder = Some(named("c"));
    let lost = SandboxEvent::Lost(LossCause::TakenOver { holder });
    assert_eq!(drain(&mut events), [lost]);
    assert!(!a.runs(&id));
    assert!(!a.controller.is_held_here(&id));
    let after = world.generation(&metadata_key(&id)).await;
    assert_eq!(before, after, "a loser writes nothing");
}

#[tokio::test]
async fn an_idle_held_sandbox_costs_no_write_its_instance_renews_once_for_all() {
    let world = World::new();
    let a = world.instance("a");
    let first = a.create(&world).await;
    let second = a.create(&world).await;
    let lock = world.generation(&lock_key(&first)).await;
    let operations = world.store.operations();
    for _ in 0..5 {
        a.live_through(&world, 10).await;
        a.pass(&first).await;
        a.pass(&second).await;
    }
    // 5 heartbeats (one write each, for both sandboxes); the passes are
    // light: nothing read, nothing written, until the resync at 60 s.
    assert_eq!(world.store.operations() - operations, 5);
    let after = world.generation(&lock_key(&first)).await;
    assert_eq!(after, lock, "lock.json untouched");
    world.clock.advance(Duration::seconds(11));
    a.heartbeat().await;
    let operations = world.store.operations();
    a.pass(&first).await;
    let reads = world.store.operations() - operations;
    assert_eq!(reads, 2, "the resync reads metadata and lock");
}

#[tokio::test]
async fn a_hold_lives_on_the_instance_lease_and_dies_with_it() {
    let world = World::new();
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = a.create_checkpointed(&world).await;
    b.request_here(&id, None).await.unwrap();
    // A ignores the ring; its instance lease keeps the hold past the lock's.
    for _ in 0..6 {
        a.live_through(&world, 10).await;
        b.pass(&id).await;
        assert!(!b.runs(&id), "A is alive");
    }
    // A dies (no more heartbeats): after its lease and the skew, B takes over.
    a.runtime.crash(&id);
    world.clock.advance(Duration::seconds(34));
    b.pass(&id).await;
    assert!(!b.runs(&id), "not before lease + skew");
    world.clock.advance(Duration::seconds(2));
    b.bring_here(&id).await;
    assert!(b.runs(&id), "taken over");
    assert_eq!(world.lease(&id).await.epoch, 3);
}

/// A quiet live holder's lock ran out long ago: the taker's passes wait
/// (liveness is judged before `decide`), writing no lock or instance lease.
#[tokio::test]
async fn a_taker_waiting_for_a_quiet_live_holder_writes_nothing() {
    let (world, counted) = super::hooked_store::counted_world(|request| {
        request.writes("lock.json") || request.writes("instances/b/lease.json")
    });
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = a.create_checkpointed(&world).await;
    b.request_here(&id, None).await.unwrap();
    let before = counted.hook.seen();
    // Past the lock's own lease (30 s and the skew), within the intent's.
    for _ in 0..5 {
        a.live_through(&world, 10).await;
        assert_eq!(b.pass(&id).await, b.acquire_poll(), "waits for handover");
    }
    assert_eq!(counted.hook.seen(), before, "no lock or lease write");
    // A holder whose instance lease cannot be read counts as alive.
    let a_lease = crate::layout::instance_lease_key(&named("a"));
    world.overwrite(&a_lease, &b"{not json"[..]).await;
    world.clock.advance(Duration::seconds(2));
    let still = b.reconcile(&id).await.expect("its pass does not fail");
    assert_eq!(still, b.acquire_poll(), "it still waits");
}

#[tokio::test]
async fn a_lapsed_instance_re_verifies_its_holds_with_a_lock_write_or_stops_them() {
    let world = World::new();
    let (a, b) = (world.instance("a"), world.instance("b"));
    let kept = a.create_checkpointed(&world).await;
    let taken = a.create_checkpointed(&world).await;
    // A freezes past its lease; B takes `taken` meanwhile.
    world.clock.advance(Duration::seconds(40));
    b.request_here(&taken, None).await.unwrap();
    b.pass(&taken).await;
    assert!(b.runs(&taken));
    // A resumes: its renewal starts a new era, so neither hold is vouched for.
    a.heartbeat().await;
    let unvouched = std::collections::BTreeSet::from_iter(a.reconciler().unvouched());
    assert_eq!(unvouched, [kept.clone(), taken.clone()].into());
    let held = a.reconciler().held(&taken).unwrap();
    assert!(!a.reconciler().leases().is_safe(&held));
    let generation = world.generation(&lock_key(&kept)).await;
    a.pass(&kept).await;
    assert!(a.runs(&kept));
    let after = world.generation(&lock_key(&kept)).await;
    assert_ne!(after, generation, "re-verified with a conditional write");
    a.pass(&taken).await;
    assert!(!a.runs(&taken), "the lost one stops");
    assert_eq!(a.reconciler().unvouched(), vec![]);
}

/// A lapsed (frozen) holder asked for it renews, then hands over, in one pass.
#[tokio::test]
async fn an_unvouched_holder_renews_its_hold_then_hands_over_in_one_pass() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create_checkpointed(&world).await;
    let b = world.instance("b");
    world.clock.advance(Duration::seconds(40));
    a.heartbeat().await;
    assert_eq!(a.reconciler().unvouched(), vec![id.clone()]);
    let mut on_a = a.controller.subscribe(&id);
    b.request_here(&id, None).await.unwrap();
    a.answer_doorbell().await;
    a.pass(&id).await;
    let seen = drain(&mut on_a);
    assert!(heard!(seen, SandboxEvent::HandoffRequested), "{seen:?}");
    assert!(!a.runs(&id), "handed over");
    let holder = world.lease(&id).await.holder;
    assert_eq!(holder, Some(named("b")), "transferred to B");
    b.pass(&id).await;
    assert!(b.runs(&id));
}

/// A holder frozen past its lease resumes to its taker's ring, generations matching; but an
/// unvouched hold may be taken: it reads both objects and stops, not "hands over" a lost sandbox.
#[tokio::test]
async fn a_ring_heard_after_a_freeze_is_not_taken_for_a_read() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create_checkpointed(&world).await;
    let b = world.instance("b");
    a.controller.client_attached(&id, false);
    let mut on_a = a.controller.subscribe(&id);
    // B rings A with what it read; A freezes before it hears the ring.
    b.request_here(&id, None).await.unwrap();
    world.clock.advance(Duration::seconds(40));
    b.pass(&id).await;
    assert!(b.runs(&id), "B took the sandbox over");
    // A resumes: the ring, then its pass.
    a.answer_doorbell().await;
    let _ = a.reconcile(&id).await;
    let seen = drain(&mut on_a);
    assert!(!heard!(seen, SandboxEvent::HandoffRequested), "{seen:?}");
    let lost = heard!(seen, SandboxEvent::Lost(LossCause::TakenOver { .. }));
    assert!(lost, "{seen:?}");
    assert!(!a.runs(&id), "the lost copy stops");
    assert_eq!(world.lease(&id).await.holder, Some(named("b")));
}

/// Bucket unreadable: a vouched hold keeps running, the pass retried; an
/// unvouched one cannot be re-verified, so it stops (it may be taken).
#[tokio::test]
async fn an_unreadable_bucket_stops_only_a_hold_no_longer_vouched_for() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create_checkpointed(&world).await;
    let mut events = a.controller.subscribe(&id);
    a.reconciler().want_full_pass(&id);
    world.store.inject([Fault::Transient, Fault::Transient]);
    let failed = a.reconcile(&id).await.unwrap_err();
    assert!(matches!(failed, ReconcileError::Unreachable(_)), "{failed}");
    assert!(a.runs(&id), "vouched: it keeps running");
    // A freezes past its lease: its renewal starts a new era.
    world.clock.advance(Duration::seconds(40));
    a.heartbeat().await;
    world.store.inject([Fault::Transient, Fault::Transient]);
    assert_eq!(a.pass(&id).await, Requeue::Never);
    assert!(!a.runs(&id), "unvouched: stopped");
    assert!(heard!(
        drain(&mut events),
        SandboxEvent::Lost(LossCause::RenewalFailed(_))
    ));
}

#[tokio::test]
async fn a_lock_naming_this_instance_that_it_does_not_hold_is_released_when_rung() {
    let (world, a, id) = World::with_a_sandbox().await;
    let b = world.instance("b");
    // A restarts (same id): it holds nothing; its lease keeps the old hold.
    let a2 = world.instance("a");
    a2.heartbeat().await;
    b.request_here(&id, None).await.unwrap();
    assert_eq!(a2.answer_doorbell().await, vec![id.clone()]);
    a2.pass(&id).await;
    assert_eq!(world.lease(&id).await.holder, None, "released");
    drop(a);
    // No checkpoint was ever taken: B says so instead of hanging.
    let mut events = b.controller.subscribe(&id);
    b.pass(&id).await;
    assert!(said_no_checkpoint(&mut events), "a clear error");
}

/// True when `events` held a start that failed for want of a checkpoint.
fn said_no_checkpoint(events: &mut broadcast::Receiver<SandboxEvent>) -> bool {
    drain(events).contains(&restore_failed(StartFailure::NoCheckpoint))
}

/// A sandbox `holder` created and then died holding, its lease run out.
async fn created_by_a_dead_holder(world: &World, holder: Instance) -> SandboxId {
    let id = holder.create(world).await;
    holder.runtime.crash(&id);
    drop(holder);
    world.clock.advance(Duration::seconds(40));
    id
}

/// RUNNING is told before its record lands; should the holder die between,
/// the taker must not create it afresh, hiding that its state is lost.
#[tokio::test]
async fn a_sandbox_whose_holder_died_before_recording_it_runs_is_not_created_afresh() {
    let world = World::new();
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = created_by_a_dead_holder(&world, a).await;
    // The record of RUNNING never landed.
    world
        .edit(&id, |metadata| {
            metadata.status.phase = Phase::Creating;
            metadata.status.holder = None;
        })
        .await;
    let mut events = b.controller.subscribe(&id);
    b.bring_here(&id).await;
    assert!(!b.runs(&id), "nothing created");
    assert!(said_no_checkpoint(&mut events), "a clear error");
}

/// One request, not two: each request to the lock is a sequential round trip.
#[tokio::test]
async fn a_failed_start_releases_and_withdraws_in_one_lock_request() {
    let (world, counted) = super::hooked_store::counted_world(|request| {
        request.reads("/lock.json") || request.writes("/lock.json")
    });
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = created_by_a_dead_holder(&world, a).await;
    let before = counted.hook.seen();
    b.bring_here(&id).await;
    assert!(!b.runs(&id), "no checkpoint: nothing runs");
    let lease = world.lease(&id).await;
    let left = (lease.holder, lease.wanted_by);
    assert_eq!(left, (None, None), "released and withdrawn");
    // The attach's read and intent, the pass's read and acquisition, and one
    // write that releases and withdraws (separately, six).
    assert_eq!(counted.hook.seen() - before, 5);
}

/// An attach read of a sandbox held and vouched for here is answered locally.
#[tokio::test]
async fn an_attach_read_of_a_sandbox_held_here_makes_no_bucket_request() {
    let (world, counted) = super::hooked_store::counted_world(|_| true);
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = a.create(&world).await;
    let before = counted.hook.seen();
    let read = a.controller.read_for_attach(&id).await.unwrap().unwrap();
    assert_eq!(counted.hook.seen(), before, "no request");
    assert_eq!(read.metadata.0, world.metadata(&id).await);
    let lock = read.lock.map(|(lease, _)| lease);
    assert_eq!(lock, Some(world.lease(&id).await));
    // Elsewhere it is read from the bucket.
    b.controller.read_for_attach(&id).await.unwrap().unwrap();
    let read = counted.hook.seen();
    assert_eq!(read, before + 2, "metadata and lock, at once");
}

#[tokio::test]
async fn a_write_refused_by_the_fence_reaches_the_caller_as_fenced() {
    // Armed, a newer holder's record (epoch 99) lands before the next
    // `metadata.json` write, as for a zombie whose pass read `status` first.
    let newer_record = EditBeforeWrite {
        before: "metadata.json",
        object: metadata_key,
        edit: |metadata: &mut SandboxMetadata| metadata.status.epoch = 99,
        armed: Default::default(),
    };
    let (world, hooked) = World::hooked(newer_record);
    let (a, id) = world.a_running("x=1").await;
    // A deletion by hand; a newer record lands before the tombstone's write.
    world.set_desired(&id, DesiredState::Deleted).await;
    hooked.hook.arm(&id);
    a.controller.enqueue(&id);
    let err = a.reconcile(&id).await.unwrap_err();
    let fenced = match &err {
        ReconcileError::Fence(FenceError::Fenced {
            recorded, writer, ..
        }) => (*recorded, *writer),
        _ => panic!("{err}"),
    };
    assert_eq!(fenced, (99, 1), "{err}");
    assert!(err.is_fenced());
    let phase = world.metadata(&id).await.status.phase;
    assert_eq!(phase, Phase::Running, "the newer record is kept");
    // And the next pass sees that holder's record: the hold is lost.
    a.pass(&id).await;
    assert!(!a.controller.is_held_here(&id));
}

/// An execution cut off by a lost hold ends with `HoldLost`, reporting no
/// end (the new holder may have acknowledged its own); a deleted one, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_cut_off_by_a_lost_hold_ends_with_hold_lost_and_one_deleted_does_not() {
    use crate::runtime::ExecEvent;
    let world = World::new();
    let a = world.instance("a");
    let last_event = |mut execution: crate::runtime::Execution| async move {
        let mut last = None;
        while let Some(event) = execution.events.recv().await {
            last = Some(event);
        }
        last
    };

    let lost = a.create(&world).await;
    let execution = a.exec(&lost, "hold").await;
    // Another instance holds it now (as after A froze past its lease).
    world.hand_lock_to(&lost, "b").await;
    a.controller.enqueue(&lost);
    a.pass(&lost).await;
    assert!(!a.controller.is_held_here(&lost));
    let last = last_event(execution).await;
    assert!(matches!(last, Some(ExecEvent::HoldLost)), "{last:?}");

    let deleted = a.create(&world).await;
    let execution = a.exec(&deleted, "hold").await;
    a.delete(&deleted).await;
    a.pass(&deleted).await;
    assert!(!a.controller.is_held_here(&deleted));
    let last = last_event(execution).await;
    assert!(last.is_none(), "{last:?}");
}

/// A start's record fenced by a newer holder (in its own task) is reported to
/// the pass, which decides on both objects: `StopLost` stops the copy there.
#[tokio::test]
async fn a_record_fenced_by_a_newer_holder_stops_the_copy_in_its_own_pass() {
    let (world, a, id) = World::with_a_sandbox().await;
    // Past the departure watch and the resync: its next pass is light.
    a.live_through(&world, 61).await;
    a.pass(&id).await;
    // A newer holder's record (an operator's edit stands in for it).
    let epoch = world.metadata(&id).await.status.epoch;
    world.edit(&id, |m| m.status.epoch += 1).await;
    let reconciler = a.reconciler();
    reconciler.report(
        &id,
        crate::sandboxes::reconciler::Ended::RecordFailed {
            epoch,
            error: ReconcileError::Fence(FenceError::Fenced {
                key: "metadata.json".into(),
                recorded: epoch + 1,
                writer: epoch,
            }),
        },
    );
    let (held, runs) = (a.controller.is_held_here(&id), a.runs(&id));
    assert!(held && runs, "the report stops nothing itself");
    let waiting = reconciler.commands_waiting(&id);
    assert_eq!(waiting, 1, "it waits for the sandbox's pass");
    a.pass(&id).await;
    assert!(!a.controller.is_held_here(&id), "the pass stopped the hold");
    assert!(!a.runs(&id), "and the copy");
}
