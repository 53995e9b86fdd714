//! Moving a sandbox between instances: hand-over on request, rings and
//! re-rings, an attach that lost the race, a start reading the last record.

use std::sync::atomic::{AtomicBool, Ordering};

use super::hooked_store::{BeforeRequest, HookedStore, Request};
use super::*;
use crate::store::StoreError;

#[tokio::test]
async fn another_instance_asking_gets_the_sandbox_handed_over_with_the_image_it_prefetched() {
    let (world, a, id) = World::with_a_sandbox().await;
    let b = world.instance("b");
    a.run(&id, "state").await;

    // A's client left: A watches the lock closely.
    a.controller.client_attached(&id, false);
    b.request_here(&id, None).await.unwrap();
    // B waits: A holds a live lease.
    assert!(matches!(b.pass(&id).await, Requeue::After(_)));
    assert!(!b.runs(&id));
    // Waiting, B knows the image's name already: A holds at epoch 1.
    let expected = checkpoint_image_key(&handoff_checkpoint_id(&id, 1, &named("b")));
    assert_eq!(b.runtime.prefetched(), vec![expected.clone()]);
    // The intent went by ring (decision 27): A hears it at its doorbell.
    let intent = world.lease(&id).await.wanted_by;
    assert_eq!(intent, None, "the lock is not written");
    let mut events = a.controller.subscribe(&id);
    a.answer_doorbell().await;
    a.pass(&id).await;
    assert_eq!(drain(&mut events)[0], SandboxEvent::HandoffRequested);
    b.pass(&id).await;
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);
    assert!(!a.runs(&id));
    assert_eq!(world.metadata(&id).await.status.epoch, 2);
    // The image A handed over with is the one B watched for.
    let carried = world.lease(&id).await.checkpoint.map(|c| c.path);
    assert_eq!(carried.as_deref(), Some(expected.as_str()));
    assert!(a.runtime.prefetched().is_empty());
}

/// A hand-over landing on an instance shutting down is not started: its client is told to attach
/// again, and the hold goes back with the checkpoint, which the next instance asking restores.
#[tokio::test]
async fn a_hand_over_landing_on_a_draining_instance_is_given_back_with_its_checkpoint() {
    let (world, a, id) = World::with_a_sandbox().await;
    let b = world.instance("b");
    a.run(&id, "state").await;
    a.controller.client_attached(&id, false);
    b.request_here(&id, None).await.unwrap();
    assert!(matches!(b.pass(&id).await, Requeue::After(_)), "B waits");
    let mut waiting_on_b = b.controller.subscribe(&id);
    a.answer_doorbell().await;
    a.pass(&id).await;
    assert_eq!(world.lease(&id).await.holder, Some(named("b")));
    // SIGTERM on B, which holds nothing yet.
    let left = b.controller.drain(std::time::Duration::from_secs(1)).await;
    assert_eq!(left, 0);
    b.pass(&id).await;
    assert!(!b.runs(&id), "a draining instance starts nothing");
    let told = drain(&mut waiting_on_b).contains(&restore_failed(StartFailure::ShuttingDown));
    assert!(told, "B's client is told");
    let lock = world.lease(&id).await;
    assert_eq!((lock.holder, lock.wanted_by), (None, None));
    let carried = lock.checkpoint.is_some();
    assert!(carried, "the hand-over image stays carried");
    let c = world.instance("c");
    c.bring_here(&id).await;
    assert_eq!(c.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);
}

/// A handoff's checkpoint loses the sandbox (runsc failing in the sentry):
/// the holder records it and lets go; the taker says why, blaming no instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taker_whose_holder_lost_the_sandbox_to_its_checkpoint_says_so() {
    let (world, a, id) = World::with_a_sandbox().await;
    let b = world.instance("b");
    a.run(&id, "state").await;
    a.controller.client_attached(&id, false);
    a.runtime.lose_on_checkpoint(&id);
    b.request_here(&id, None).await.unwrap();
    a.answer_doorbell().await;
    a.pass(&id).await;
    assert_eq!(world.lease(&id).await.holder, None, "let go");
    let mut events = b.controller.subscribe(&id);
    b.pass(&id).await;
    let seen = drain(&mut events);
    let failed = seen.into_iter().find_map(|event| match event {
        SandboxEvent::StartFailed {
            kind: StartKind::Restore,
            cause: StartFailure::FailedWithoutCheckpoint(cause),
        } => Some(cause),
        _ => None,
    });
    let cause = failed.expect("the taker names the holder's failure");
    let why = "checkpoint failed and stopped the sandbox";
    assert!(cause.contains(why), "{cause}");
    assert!(!b.runs(&id));
}

/// A ring carries the generations its taker read: a holder knowing both hands
/// over reading neither; one knowing less (an edit) reads them once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_rung_with_what_its_taker_read_hands_over_without_reading_it_again() {
    use crate::store::{CountingStore, Operation, OperationCounts};
    for edited in [false, true] {
        let counts = Arc::new(OperationCounts::default());
        let world = World::wrapped(|store| Arc::new(CountingStore::new(store, counts.clone())));
        let (a, id) = world.a_running("state").await;
        let b = world.instance("b");
        a.controller.client_attached(&id, false);
        if edited {
            let blue = |m: &mut SandboxMetadata| m.spec.labels.insert("team".into(), "blue".into());
            world.edit(&id, blue).await;
        }
        b.request_here(&id, None).await.unwrap();
        a.answer_doorbell().await;
        let reads = counts.count(Operation::Get);
        a.pass(&id).await;
        assert!(!a.runs(&id), "handed over");
        let read = counts.count(Operation::Get) - reads;
        assert_eq!(read, if edited { 2 } else { 0 }, "edited: {edited}");
        b.pass(&id).await;
        assert_eq!(b.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);
        if edited {
            assert_eq!(world.metadata(&id).await.spec.labels["team"], "blue");
        }
    }
}

/// Until the hand-over image is stored the taker looks at the lock less often
/// (the transfer follows the image); its landing wakes it (decision 29).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taker_looks_less_often_until_the_image_lands_and_the_landing_wakes_it() {
    let world = World::new();
    let (a, id) = world.a_running("state").await;
    let b = world.instance("b");
    let image_poll = Requeue::After(ReconcilerConfig::default().await_image_poll);
    a.controller.client_attached(&id, false);
    b.runtime.watch_images();
    b.request_here(&id, None).await.unwrap();
    b.controller.drain_queue();
    let requeue = b.pass(&id).await;
    let less_often = "the image is not in the store: look less often";
    assert_eq!(requeue, image_poll, "{less_often}");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(b.controller.drain_queue().is_empty(), "nothing woke it yet");
    b.runtime.land_images();
    // The wake comes from a task watching the landing: polled, not timed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let woken = loop {
        let woken = b.controller.drain_queue();
        if !woken.is_empty() || std::time::Instant::now() > deadline {
            break woken;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    assert_eq!(woken, std::slice::from_ref(&id), "the landing woke it");
    let requeue = b.pass(&id).await;
    let soon = "the image landed: the transfer is next, look soon";
    assert_eq!(requeue, b.acquire_poll(), "{soon}");
    a.answer_doorbell().await;
    a.pass(&id).await;
    b.pass(&id).await;
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);
}

/// Every doorbell write fails.
#[derive(Debug)]
struct NoDoorbell;

#[async_trait::async_trait]
impl BeforeRequest for NoDoorbell {
    async fn before(&self, request: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        match request.key {
            Some(key) if request.writes("doorbell.json") => {
                Err(StoreError::transient(key, "the bucket is unreachable"))
            }
            _ => Ok(()),
        }
    }
}

/// An unwritable ring leaves the intent in the lock (decision 27's fallback).
#[tokio::test]
async fn without_a_ring_an_intent_is_noticed_at_the_resync() {
    let world = World::wrapped(|store| Arc::new(HookedStore::new(store, NoDoorbell)));
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = a.create(&world).await;
    a.live_through(&world, 10).await;
    b.request_here(&id, None).await.unwrap();
    let lock = world.lease(&id).await;
    let intent = lock.wanted_by.map(|intent| intent.instance);
    assert_eq!(intent, Some(named("b")), "written into the lock");
    assert_eq!(a.answer_doorbell().await, vec![]);
    a.pass(&id).await;
    assert!(a.runs(&id));
    a.live_through(&world, 51).await;
    a.pass(&id).await;
    assert!(!a.runs(&id), "handed over at the resync");
}

/// The holder's client stays attached: the ring alone gets the hand-over.
#[tokio::test]
async fn a_waiting_instance_rings_the_holder_again_when_a_ring_was_lost() {
    let (world, a, id) = World::with_a_sandbox().await;
    let b = world.instance("b");
    b.request_here(&id, None).await.unwrap();
    let doorbell = crate::layout::doorbell_key(&named("a"));
    world.store.delete(&doorbell).await.unwrap();
    b.pass(&id).await;
    assert!(!world.exists(doorbell).await, "not at once");
    world.clock.advance(Duration::seconds(6));
    a.heartbeat().await;
    b.pass(&id).await;
    assert_eq!(a.answer_doorbell().await, vec![id.clone()], "rung again");
    // The doorbell names the sandbox once, however often it is read.
    assert_eq!(a.answer_doorbell().await, vec![]);
    a.pass(&id).await;
    b.pass(&id).await;
    assert!(b.runs(&id), "handed over");
}

/// Two instances ask for one sandbox: the holder hands it to the later one.
#[tokio::test]
async fn a_waiting_attach_that_lost_the_race_is_told_who_got_the_sandbox() {
    let world = World::new();
    let x = world.instance("x");
    let (a, b) = (world.instance("a"), world.instance("b"));
    let id = x.create(&world).await;
    let mut waiting_on_a = a.controller.subscribe(&id);
    a.request_here(&id, None).await.unwrap();
    // A client on B asks too, after A's, before X handed over.
    world.clock.advance(Duration::milliseconds(10));
    b.request_here(&id, None).await.unwrap();
    a.pass(&id).await;
    x.answer_doorbell().await;
    x.pass(&id).await;
    let holder = world.lease(&id).await.holder;
    let later = "X transferred the hold to the later intent's instance";
    assert_eq!(holder, Some(named("b")), "{later}");
    a.pass(&id).await;
    let lost_the_race = restore_failed(StartFailure::WantedElsewhere(named("b")));
    let told = drain(&mut waiting_on_a).contains(&lost_the_race);
    assert!(told, "A's waiting client learns it lost the race");
    b.pass(&id).await;
    assert!(b.runs(&id));
    assert!(!x.runs(&id));
    assert!(!a.runs(&id));
}

/// An attach takes a free lock in its own write; the next pass just starts it.
#[tokio::test]
async fn an_attach_to_a_free_lock_takes_it_in_its_own_write() {
    let (world, a, id) = World::with_a_sandbox().await;
    a.checkpoint(&id, None).await;
    let epoch = world.lease(&id).await.epoch;
    a.request_here(&id, None).await.unwrap();
    let lock = world.lease(&id).await;
    assert_eq!(lock.holder, Some(named("a")));
    assert_eq!(lock.epoch, epoch + 1);
    assert!(lock.wanted_by.is_none(), "no intent left behind");
    a.pass(&id).await;
    assert!(a.controller.is_held_here(&id));
    assert!(a.runs(&id));
    assert_eq!(world.metadata(&id).await.status.epoch, epoch + 1);
}

/// Pauses before its first read of `lock.json` until told to go on.
#[derive(Debug)]
struct PauseBeforeLockRead {
    paused: tokio::sync::Notify,
    resume: tokio::sync::Notify,
    armed: AtomicBool,
    /// While set, `metadata.json` writes wait for a `metadata_gate` permit.
    hold_metadata: AtomicBool,
    metadata_gate: tokio::sync::Semaphore,
}

impl PauseBeforeLockRead {
    /// `world`'s store paused, and instance `b` seeing the bucket through it.
    fn b(world: &World) -> (Arc<HookedStore<Self>>, Instance) {
        let hook = Self {
            paused: tokio::sync::Notify::new(),
            resume: tokio::sync::Notify::new(),
            armed: AtomicBool::new(false),
            hold_metadata: AtomicBool::new(false),
            metadata_gate: tokio::sync::Semaphore::new(0),
        };
        world.instance_through("b", hook, ReconcilerConfig::default())
    }
}

#[async_trait::async_trait]
impl BeforeRequest for PauseBeforeLockRead {
    async fn before(&self, request: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        if request.reads("/lock.json") && self.armed.swap(false, Ordering::AcqRel) {
            self.paused.notify_one();
            self.resume.notified().await;
        }
        if request.writes("/metadata.json")
            && self.hold_metadata.load(Ordering::Acquire)
            && let Ok(permit) = self.metadata_gate.acquire().await
        {
            permit.forget();
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_restores_the_checkpoint_recorded_after_its_pass_read_metadata() {
    let (world, a, id) = World::with_a_sandbox().await;
    a.run(&id, "state").await;
    // B's pass reads metadata (no checkpoint yet), then stops before the lock.
    let (store, b) = PauseBeforeLockRead::b(&world);
    b.request_here(&id, None).await.unwrap();
    store.hook.armed.store(true, Ordering::Release);
    let pass = b.spawn(
        &id,
        |b, id| async move { b.reconciler().reconcile(&id).await },
    );
    store.hook.paused.notified().await;
    // Meanwhile A hands over: records the checkpoint, releases.
    assert_eq!(a.answer_doorbell().await, vec![id.clone()]);
    a.pass(&id).await;
    assert!(world.metadata(&id).await.status.latest_checkpoint.is_some());
    store.hook.resume.notify_one();
    pass.await.unwrap().unwrap();
    let why = "restored from the checkpoint recorded after the pass read metadata";
    assert_eq!(b.runtime.memory(&id), Some(vec!["state".into()]), "{why}");
}

/// An attach right after asking for a checkpoint is served before the pass decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_asked_right_after_a_checkpoint_is_not_failed_by_it() {
    let (world, a, id) = World::with_a_sandbox().await;
    a.run(&id, "state").await;
    let mut events = a.controller.subscribe(&id);
    let now = world.clock.now();
    let asks = a.spawn(&id, move |controller, id| async move {
        let checkpointed = controller
            .request_state(&id, DesiredState::Checkpointed, None)
            .await;
        let attached = controller.request_here(&id, None, now).await;
        checkpointed.and(attached)
    });
    while a.reconciler().commands_waiting(&id) < 1 {
        tokio::task::yield_now().await;
    }
    // The checkpoint's pass; a later one serves the attach. The spec write's
    // end is a command too and may come first: pass until answered.
    a.pass(&id).await;
    while !asks.is_finished() {
        while a.reconciler().commands_waiting(&id) < 1 && !asks.is_finished() {
            tokio::task::yield_now().await;
        }
        a.pass(&id).await;
    }
    asks.await.unwrap().unwrap();
    a.pass(&id).await;
    let seen = drain(&mut events);
    let failed = heard!(seen, SandboxEvent::StartFailed { .. });
    assert!(!failed, "the attaching client was failed: {seen:?}");
    assert!(a.controller.is_held_here(&id));
    assert_eq!(a.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);
}

/// An attach whose spec write is slowed while its lock write lands is decided
/// on as written, not as in the bucket (found by the `gcs-regional` bench).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_whose_spec_write_is_slow_is_decided_on_as_written() {
    let (world, a, id) = World::with_a_sandbox().await;
    a.run(&id, "state").await;
    // The bucket says `checkpointed` while A runs it: its `running` is late.
    let checkpointed = DesiredState::Checkpointed;
    world.set_desired(&id, checkpointed).await;
    let (store, b) = PauseBeforeLockRead::b(&world);
    let mut events = b.controller.subscribe(&id);
    // B's attach: its `running` is held back; its pass decides meanwhile.
    store.hook.hold_metadata.store(true, Ordering::Release);
    let pass = {
        let (b, id, now) = (Arc::clone(&b.controller), id.clone(), world.clock.now());
        tokio::spawn(async move { b.serving(&id, b.request_here(&id, None, now)).await })
    };
    let mut decided = Vec::new();
    while !decided.contains(&SandboxEvent::LeaseAcquiring) {
        decided.push(events.recv().await.unwrap());
    }
    let desired = world.metadata(&id).await.spec.desired_state;
    assert_eq!(desired, checkpointed, "the spec write is still held back");
    store.hook.metadata_gate.add_permits(100);
    pass.await.unwrap().unwrap();
    b.reconciler().background_settled().await;
    let desired = world.metadata(&id).await.spec.desired_state;
    assert_eq!(desired, DesiredState::Running);
    decided.extend(drain(&mut events));
    assert!(
        !heard!(decided, SandboxEvent::StartFailed { .. }),
        "the waiting client was failed on the stale spec: {decided:?}"
    );
}

/// Doorbell pace: the departure watch's for a minute after a client left (its
/// next attach rings), active while a client here is, else idle.
#[tokio::test]
async fn the_doorbell_is_read_fastest_just_after_a_client_left() {
    let (world, a, id) = World::with_a_sandbox().await;
    let reconciler = a.controller.reconciler();
    let config = ReconcilerConfig::default();
    assert_eq!(reconciler.doorbell_interval(), config.doorbell_poll);
    a.controller.client_attached(&id, true);
    a.controller.client_active(&id);
    assert_eq!(reconciler.doorbell_interval(), config.doorbell_poll_active);
    a.controller.client_attached(&id, false);
    assert_eq!(reconciler.doorbell_interval(), config.detached_poll);
    world.clock.advance(Duration::seconds(61));
    assert_eq!(reconciler.doorbell_interval(), config.doorbell_poll);
}

/// Holds the first doorbell write until the test lets it go.
#[derive(Debug)]
struct FirstRingWaits {
    started: tokio::sync::Notify,
    go: tokio::sync::Semaphore,
    seen: AtomicBool,
}

#[async_trait::async_trait]
impl BeforeRequest for FirstRingWaits {
    async fn before(&self, request: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        if request.writes("doorbell.json") && !self.seen.swap(true, Ordering::SeqCst) {
            self.started.notify_one();
            let _ = self.go.acquire().await;
        }
        Ok(())
    }
}

/// A ring joining while an earlier batch to the holder is written goes into
/// the next batch; its ringer is answered when that one lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_joining_while_a_batch_is_written_returns_once_its_own_batch_lands() {
    let (started, go) = (tokio::sync::Notify::new(), tokio::sync::Semaphore::new(0));
    let seen = AtomicBool::new(false);
    let (world, hooked) = World::hooked(FirstRingWaits { started, go, seen });
    let config = LeaseConfig {
        ring_spacing: std::time::Duration::from_millis(300),
        ..LeaseConfig::default()
    };
    let clock = Arc::new(world.clock.clone());
    let ringer = Leases::new(hooked.clone(), clock, named("b"), config);
    let holder = named("a");
    let (first, second) = (SandboxId::from_u128(1), SandboxId::from_u128(2));
    let ring = |sandbox: SandboxId| {
        let (ringer, holder) = (ringer.clone(), holder.clone());
        tokio::spawn(async move { ringer.instance_lease().ring(&holder, &sandbox, None).await })
    };
    let first_ring = ring(first.clone());
    hooked.hook.started.notified().await;
    let second_ring = ring(second.clone());
    // Queued behind the write in flight before that write is let go.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    hooked.hook.go.add_permits(1);
    first_ring.await.unwrap().unwrap();
    second_ring.await.unwrap().unwrap();
    // Neither was answered before a write with it landed.
    crate::leasing::tests::assert_rung(&world.store, &holder, &[first, second]).await;
}

/// Once armed: stalls an instance's checkpoint upload or next `metadata.json` write until thawed (a
/// holder frozen in its checkpoint, or between its checks and its record), or its `metadata.json`
/// writes for good (a holder killed before its record landed).
#[derive(Debug, Default)]
struct FreezeAndHold {
    freeze_upload: AtomicBool,
    freeze_record: AtomicBool,
    frozen: tokio::sync::Notify,
    thaw: tokio::sync::Notify,
    hold_metadata: AtomicBool,
}

#[async_trait::async_trait]
impl BeforeRequest for FreezeAndHold {
    async fn before(&self, request: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        let freeze = if request.writes("/checkpoint.img") {
            &self.freeze_upload
        } else if request.writes("/metadata.json") {
            &self.freeze_record
        } else {
            return Ok(());
        };
        if freeze.swap(false, Ordering::AcqRel) {
            self.frozen.notify_one();
            self.thaw.notified().await;
        }
        if request.writes("/metadata.json") && self.hold_metadata.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// A holder frozen in its hand-over or periodic checkpoint (in the upload, or in the record after
/// every check passed) thaws after a taker started from the lock's older checkpoint (losing what
/// ran since), before the taker's record landed. An upload's hand-back and record fail; a record
/// that lands late does not count, since the taker's acquisition named the checkpoint it took over
/// (`checkpoint_taken_over_at`). Either way the next takeover restores what the taker started from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holders_checkpoint_does_not_count_once_it_was_taken_over() {
    for (periodic, in_record) in [(false, false), (true, false), (true, true)] {
        let case = format!("periodic {periodic}, frozen in the record {in_record}");
        let world = World::new();
        let hook = FreezeAndHold::default;
        let (a_store, a) = world.instance_through("a", hook(), checkpointing(periodic));
        let (b_store, b) = world.instance_through("b", hook(), checkpointing(false));
        let id = a.create(&world).await;
        a.run(&id, "s1").await;
        a.checkpoint(&id, None).await; // epoch 1's, carried by the lock
        let first = world.metadata(&id).await.status.latest_checkpoint.unwrap();
        a.bring_here(&id).await;
        a.run(&id, "s2").await;
        if periodic {
            a.live_through(&world, 61).await;
        }
        let hook = &a_store.hook;
        let freeze = [&hook.freeze_upload, &hook.freeze_record][usize::from(in_record)];
        freeze.store(true, Ordering::Release);
        let zombie = a.spawn(&id, move |controller, id| async move {
            if periodic {
                let _ = controller.reconciler().reconcile(&id).await;
            } else {
                let ask = controller.request_state(&id, DesiredState::Checkpointed, None);
                let _ = controller.serving(&id, ask).await;
            }
        });
        hook.frozen.notified().await;
        b_takes_over_from_s1(&world, &b, &b_store, &id).await;
        let lock = world.lease(&id).await;
        assert_eq!(lock.checkpoint.as_ref().map(|c| &c.path), Some(&first.path));
        assert_eq!(lock.checkpoint_taken_over_at, Some(lock.epoch), "{case}");
        hook.thaw.notify_one();
        zombie.await.unwrap();
        a.controller.reconciler().background_settled().await;
        let recorded = world.metadata(&id).await.status.latest_checkpoint.unwrap();
        let landed = recorded.path != first.path;
        assert_eq!(
            landed, in_record,
            "only a record frozen after its checks lands: {case}"
        );
        assert!(!landed || lock.outdates(&recorded), "{case}");
        let lost = format!("\"s2\" was lost when B started: it never comes back ({case})");
        assert_eq!(
            c_after_b_died(&world, b, &id).await,
            Some(vec!["s1".to_owned()]),
            "{lost}"
        );
    }
}

/// A's leases run out (it is frozen); B takes over, its `metadata.json` writes held for good (it
/// dies before its record), and starts from the checkpoint of "s1" alone.
async fn b_takes_over_from_s1(
    world: &World,
    b: &Instance,
    b_store: &hooked_store::HookedStore<FreezeAndHold>,
    id: &SandboxId,
) {
    world.clock.advance(Duration::seconds(40));
    b_store.hook.hold_metadata.store(true, Ordering::Release);
    b.request_here(id, None).await.unwrap();
    for _ in (0..20).take_while(|_| !b.runs(id)) {
        let _ = b.reconcile(id).await;
    }
    assert_eq!(b.runtime.memory(id), Some(vec!["s1".to_owned()]));
}

/// B dies before its record landed; C takes over: what C runs.
async fn c_after_b_died(world: &World, b: Instance, id: &SandboxId) -> Option<Vec<String>> {
    b.runtime.crash(id);
    drop(b);
    world.clock.advance(Duration::seconds(40));
    let c = world.instance("c");
    c.bring_here(id).await;
    c.runtime.memory(id)
}
