//! The reconciler on the in-memory store, the fake runtime and a manual clock:
//! each test drives reconcile passes by hand and checks the bucket's JSON, the
//! runtime and the progress events.

use std::sync::Arc;

use bytes::Bytes;
use chrono::Duration;
use tokio::sync::broadcast;

use super::*;
use crate::api::{
    DesiredState, InstanceId, Lease, Phase, SandboxId, SandboxMetadata, decode, encode,
};
use crate::layout::{checkpoint_image_key, lock_key, metadata_key};
use crate::leasing::{LeaseConfig, Leases};
use crate::runtime::{Command, ExecRequest};
use crate::store::{PutMode, Store};
use crate::testing::{FakeRuntime, ManualClock, MemoryStore};

const TOKEN_HASH: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

struct Instance {
    controller: Arc<SandboxController>,
    runtime: FakeRuntime,
}

struct World {
    store: Arc<MemoryStore>,
    clock: ManualClock,
}

impl World {
    fn new() -> Self {
        Self {
            store: Arc::new(MemoryStore::new()),
            clock: ManualClock::new(),
        }
    }

    fn instance(&self, name: &str) -> Instance {
        self.instance_with(name, ReconcilerConfig::default())
    }

    fn instance_with(&self, name: &str, config: ReconcilerConfig) -> Instance {
        self.instance_hooked(name, config, |_| Arc::new(crate::hooks::NoHooks))
    }

    /// An instance whose hooks `hooks` builds (given its runtime).
    fn instance_hooked(
        &self,
        name: &str,
        config: ReconcilerConfig,
        hooks: impl FnOnce(&FakeRuntime) -> Arc<dyn crate::hooks::LifecycleHooks>,
    ) -> Instance {
        let runtime = FakeRuntime::new(self.store.clone());
        let hooks = hooks(&runtime);
        let bus = ProgressBus::default();
        let leases = Leases::new(
            self.store.clone(),
            Arc::new(self.clock.clone()),
            InstanceId::parse(name).unwrap(),
            LeaseConfig {
                duration: Duration::seconds(30),
                skew_tolerance: Duration::seconds(5),
                intent_ttl: Duration::seconds(60),
            },
        );
        let reconciler = Reconciler::new(ReconcilerParts {
            metadata: self.store.clone(),
            checkpoints: self.store.clone(),
            checkpoint_bucket: "test-bucket".to_owned(),
            snapshot_bucket: "test-bucket".to_owned(),
            runtime: Arc::new(runtime.clone()),
            leases,
            clock: Arc::new(self.clock.clone()),
            bus: bus.clone(),
            config,
        })
        .with_hooks(hooks);
        Instance {
            controller: SandboxController::new(reconciler, bus),
            runtime,
        }
    }

    async fn metadata(&self, id: &SandboxId) -> SandboxMetadata {
        decode(&self.store.get(&metadata_key(id)).await.unwrap().data).unwrap()
    }

    async fn lease(&self, id: &SandboxId) -> Lease {
        decode(&self.store.get(&lock_key(id)).await.unwrap().data).unwrap()
    }
}

impl Instance {
    async fn reconcile(&self, id: &SandboxId) -> Result<Requeue, ReconcileError> {
        self.controller.reconciler().reconcile(id).await
    }

    async fn create(&self, world: &World) -> SandboxId {
        let id = SandboxId::random();
        let mut metadata = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
        metadata.spec.enable_checkpoint = true;
        self.controller.create(&metadata).await.unwrap();
        self.reconcile(&id).await.unwrap();
        id
    }

    /// What the instance lease loop does every `renew_interval`.
    async fn heartbeat(&self) {
        self.controller
            .reconciler()
            .leases()
            .instance_lease()
            .renew()
            .await
            .unwrap();
    }

    /// Lets `seconds` pass with the instance alive (heartbeats every 10 s).
    async fn live_through(&self, world: &World, seconds: i64) {
        let mut left = seconds;
        while left > 0 {
            let step = left.min(10);
            world.clock.advance(Duration::seconds(step));
            self.heartbeat().await;
            left -= step;
        }
    }

    /// A sandbox held here that has a checkpoint to restore (checkpointed,
    /// then asked back here).
    async fn create_checkpointed(&self, world: &World) -> SandboxId {
        let id = self.create(world).await;
        self.controller
            .request_state(&id, DesiredState::Checkpointed, None)
            .await
            .unwrap();
        self.reconcile(&id).await.unwrap();
        self.controller
            .request_here(&id, None, world.clock.now())
            .await
            .unwrap();
        self.reconcile(&id).await.unwrap();
        assert!(self.controller.is_held_here(&id));
        id
    }

    async fn run(&self, id: &SandboxId, code: &str) {
        let mut execution = self
            .controller
            .exec(id, ExecRequest::new(Command::Bash(code.into())))
            .await
            .unwrap();
        while execution.events.recv().await.is_some() {}
    }
}

fn drain(events: &mut broadcast::Receiver<Progress>) -> Vec<Progress> {
    let mut seen = Vec::new();
    while let Ok(event) = events.try_recv() {
        seen.push(event);
    }
    seen
}

use crate::clock::Clock;

#[tokio::test]
async fn create_runs_the_sandbox_under_a_new_lease() {
    let world = World::new();
    let a = world.instance("a");
    let id = SandboxId::random();
    let mut events = a.controller.subscribe(&id);
    let metadata = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
    a.controller.create(&metadata).await.unwrap();
    let requeue = a.reconcile(&id).await.unwrap();

    assert!(matches!(requeue, Requeue::After(_)));
    assert_eq!(drain(&mut events), vec![Progress::Running { epoch: 1 }]);
    assert!(a.runtime.memory(&id).is_some());
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.holder.unwrap().as_str(), "a");
    assert_eq!(status.epoch, 1);
    let ready = world
        .metadata(&id)
        .await
        .status
        .condition("Ready")
        .cloned()
        .unwrap();
    assert_eq!(ready.status, crate::api::ConditionStatus::True);
    let lease = world.lease(&id).await;
    assert_eq!(lease.holder.unwrap().as_str(), "a");
    assert!(lease.wanted_by.is_none(), "the fulfilled intent is cleared");
    assert_eq!(a.runtime.counts(), (1, 0));
}

#[tokio::test]
async fn a_second_create_with_the_same_id_is_refused() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let again = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
    assert!(matches!(
        a.controller.create(&again).await,
        Err(ControlError::AlreadyExists(_))
    ));
}

#[tokio::test]
async fn checkpoint_is_recorded_and_restore_brings_the_memory_back() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    a.run(&id, "x=1").await;

    let mut events = a.controller.subscribe(&id);
    a.controller
        .request_state(&id, DesiredState::Checkpointed, Some("first"))
        .await
        .unwrap();
    assert_eq!(a.reconcile(&id).await.unwrap(), Requeue::Never);
    let seen = drain(&mut events);
    assert_eq!(
        seen[..3],
        [
            Progress::Checkpointing,
            Progress::Deleting,
            Progress::Deleted
        ]
    );
    assert!(matches!(seen[3], Progress::Checkpointed { .. }));
    assert!(a.runtime.memory(&id).is_none());
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Checkpointed);
    assert_eq!(status.holder, None);
    let latest = status.latest_checkpoint.unwrap();
    assert_eq!(latest.name.as_deref(), Some("first"));
    assert_eq!(status.named_checkpoints["first"], latest);
    assert_eq!(world.lease(&id).await.holder, None);

    // Another instance restores it: same memory, next epoch.
    let b = world.instance("b");
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    b.reconcile(&id).await.unwrap();
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["x=1".to_owned()]);
    let status = world.metadata(&id).await.status;
    assert_eq!((status.phase, status.epoch), (Phase::Running, 2));
    assert_eq!(b.runtime.counts(), (0, 1));
}

#[tokio::test]
async fn a_named_checkpoint_is_restored_once_then_the_latest_again() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    a.run(&id, "one").await;
    a.controller
        .request_state(&id, DesiredState::Checkpointed, Some("early"))
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    a.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    a.run(&id, "two").await;
    a.controller
        .request_state(&id, DesiredState::Checkpointed, None)
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();

    // Ask for the early one by name.
    a.controller
        .request_here(&id, Some("early"), world.clock.now())
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    assert_eq!(a.runtime.memory(&id).unwrap(), vec!["one".to_owned()]);

    // The request was one-shot: the next checkpoint/restore uses the latest.
    a.run(&id, "three").await;
    a.controller
        .request_state(&id, DesiredState::Checkpointed, None)
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    world.clock.advance(Duration::seconds(1));
    a.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    assert_eq!(
        a.runtime.memory(&id).unwrap(),
        vec!["one".to_owned(), "three".to_owned()]
    );
}

#[tokio::test]
async fn an_unknown_checkpoint_name_fails_the_restore_and_keeps_the_sandbox() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    a.controller
        .request_state(&id, DesiredState::Checkpointed, None)
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    let mut events = a.controller.subscribe(&id);
    a.controller
        .request_here(&id, Some("nope"), world.clock.now())
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    let seen = drain(&mut events);
    assert!(
        matches!(&seen[..], [Progress::Failed { operation: Operation::Restore, message }] if message.contains("nope")),
        "{seen:?}"
    );
    let metadata = world.metadata(&id).await;
    assert_eq!(
        metadata.status.phase,
        Phase::Checkpointed,
        "not left Restoring"
    );
    assert!(metadata.status.latest_checkpoint.is_some());
    assert_eq!(world.lease(&id).await.holder, None);
}

#[tokio::test]
async fn another_instance_asking_gets_the_sandbox_handed_over() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    a.run(&id, "state").await;

    // A's client left: A watches the lock closely.
    a.controller.client_attached(&id, false);
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    // B waits: A holds a live lease.
    assert!(matches!(b.reconcile(&id).await.unwrap(), Requeue::After(_)));
    assert!(b.runtime.memory(&id).is_none());
    let mut events = a.controller.subscribe(&id);
    a.reconcile(&id).await.unwrap();
    assert_eq!(drain(&mut events)[0], Progress::LockReleaseRequested);
    b.reconcile(&id).await.unwrap();
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["state".to_owned()]);
    assert!(a.runtime.memory(&id).is_none());
    assert_eq!(world.metadata(&id).await.status.epoch, 2);
}

#[tokio::test]
async fn a_holder_that_lost_its_lease_stops_without_writing() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    // An operator hands the lease to someone else.
    let mut lease = world.lease(&id).await;
    lease.holder = Some(InstanceId::parse("c").unwrap());
    lease.epoch += 1;
    world
        .store
        .put(&lock_key(&id), encode(&lease), PutMode::Overwrite)
        .await
        .unwrap();
    let before = world.store.get(&metadata_key(&id)).await.unwrap();
    let mut events = a.controller.subscribe(&id);
    // A raw edit without a ring: noticed at the next resync.
    a.live_through(&world, 30).await;
    assert!(matches!(a.reconcile(&id).await.unwrap(), Requeue::After(_)));
    assert!(a.runtime.memory(&id).is_some(), "not before the resync");
    a.live_through(&world, 31).await;

    assert_eq!(a.reconcile(&id).await.unwrap(), Requeue::Never);
    assert!(matches!(drain(&mut events)[..], [Progress::Lost { .. }]));
    assert!(a.runtime.memory(&id).is_none());
    assert!(!a.controller.is_held_here(&id));
    let after = world.store.get(&metadata_key(&id)).await.unwrap();
    assert_eq!(
        before.generation, after.generation,
        "a loser writes nothing"
    );
}

#[tokio::test]
async fn delete_destroys_tombstones_releases_and_purges_later() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let mut events = a.controller.subscribe(&id);
    a.controller
        .request_state(&id, DesiredState::Deleted, None)
        .await
        .unwrap();
    let retention = std::time::Duration::from_secs(600);
    assert_eq!(a.reconcile(&id).await.unwrap(), Requeue::After(retention));
    assert_eq!(
        drain(&mut events),
        vec![Progress::Deleting, Progress::Deleted]
    );
    assert!(a.runtime.memory(&id).is_none());
    assert_eq!(world.metadata(&id).await.status.phase, Phase::Deleted);
    assert_eq!(world.lease(&id).await.holder, None);
    // The tombstone stays for the retention, then everything goes.
    assert!(matches!(a.reconcile(&id).await.unwrap(), Requeue::After(_)));
    assert!(world.store.get(&metadata_key(&id)).await.is_ok());
    world.clock.advance(Duration::seconds(601));
    assert_eq!(a.reconcile(&id).await.unwrap(), Requeue::Never);
    assert!(world.store.get(&metadata_key(&id)).await.is_err());
    assert!(world.store.get(&lock_key(&id)).await.is_err());
}

#[tokio::test]
async fn a_checkpoint_waits_for_a_running_execution() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let execution = a
        .controller
        .exec(&id, ExecRequest::new(Command::Bash("hold".into())))
        .await
        .unwrap();
    let mut events = a.controller.subscribe(&id);
    a.controller
        .request_state(&id, DesiredState::Checkpointed, None)
        .await
        .unwrap();
    assert!(matches!(a.reconcile(&id).await.unwrap(), Requeue::After(_)));
    assert_eq!(
        drain(&mut events),
        vec![Progress::Checkpointing, Progress::ExecutionInProgress]
    );
    assert!(a.runtime.memory(&id).is_some());
    execution.control.kill().await.unwrap();
    a.reconcile(&id).await.unwrap();
    assert_eq!(world.metadata(&id).await.status.phase, Phase::Checkpointed);
}

#[tokio::test]
async fn invalid_json_from_an_operator_is_reported_and_changes_nothing() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    world
        .store
        .put(
            &metadata_key(&id),
            Bytes::from_static(b"{\"apiVersion\": \"sandboxd.dev/v1\", oops"),
            PutMode::Overwrite,
        )
        .await
        .unwrap();
    // Between full passes only the lease is looked after.
    assert!(a.reconcile(&id).await.is_ok());
    world.clock.advance(Duration::seconds(121));
    let err = a.reconcile(&id).await.unwrap_err();
    assert!(err.to_string().contains("metadata.json"), "{err}");
    assert!(a.runtime.memory(&id).is_some(), "the sandbox keeps running");
    assert!(a.controller.is_held_here(&id));
}

#[tokio::test]
async fn a_sandbox_that_died_is_marked_failed_and_released() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    a.runtime.crash(&id);
    let mut events = a.controller.subscribe(&id);
    a.reconcile(&id).await.unwrap();
    assert!(matches!(drain(&mut events)[..], [Progress::Lost { .. }]));
    let metadata = world.metadata(&id).await;
    assert_eq!(metadata.status.phase, Phase::Failed);
    assert_eq!(world.lease(&id).await.holder, None);
}

#[tokio::test]
async fn an_idle_held_sandbox_costs_no_write_its_instance_renews_once_for_all() {
    let world = World::new();
    let a = world.instance("a");
    let first = a.create(&world).await;
    let second = a.create(&world).await;
    let lock = world.store.get(&lock_key(&first)).await.unwrap().generation;
    let operations = world.store.operations();
    for _ in 0..5 {
        world.clock.advance(Duration::seconds(10));
        a.heartbeat().await;
        a.reconcile(&first).await.unwrap();
        a.reconcile(&second).await.unwrap();
    }
    // 5 heartbeats (one write each, for both sandboxes); the passes are
    // light: nothing read, nothing written, until the resync at 60 s.
    assert_eq!(world.store.operations() - operations, 5);
    assert_eq!(
        world.store.get(&lock_key(&first)).await.unwrap().generation,
        lock,
        "lock.json untouched"
    );
    world.clock.advance(Duration::seconds(11));
    a.heartbeat().await;
    let operations = world.store.operations();
    a.reconcile(&first).await.unwrap();
    assert_eq!(
        world.store.operations() - operations,
        2,
        "the resync reads metadata and lock"
    );
}

#[tokio::test]
async fn an_attach_intent_rings_the_holder_even_with_its_client_attached() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    a.reconcile(&id).await.unwrap();
    assert_eq!(a.controller.answer_doorbell().await.unwrap(), vec![]);
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    // The doorbell names the sandbox once, however often it is read.
    assert_eq!(
        a.controller.answer_doorbell().await.unwrap(),
        vec![id.clone()]
    );
    assert_eq!(a.controller.answer_doorbell().await.unwrap(), vec![]);
    // The ring queued a full pass: the hand-over happens in it.
    a.reconcile(&id).await.unwrap();
    assert!(a.runtime.memory(&id).is_none(), "handed over at once");
    b.reconcile(&id).await.unwrap();
    assert!(b.runtime.memory(&id).is_some());
}

#[tokio::test]
async fn without_a_ring_an_intent_is_noticed_at_the_resync() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    a.live_through(&world, 10).await;
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    // The ring is lost (say the ringer gave up): the resync still sees it.
    world
        .store
        .delete(&crate::layout::doorbell_key(
            &InstanceId::parse("a").unwrap(),
        ))
        .await
        .unwrap();
    assert_eq!(a.controller.answer_doorbell().await.unwrap(), vec![]);
    a.reconcile(&id).await.unwrap();
    assert!(a.runtime.memory(&id).is_some());
    a.live_through(&world, 51).await;
    a.reconcile(&id).await.unwrap();
    assert!(a.runtime.memory(&id).is_none(), "handed over at the resync");
}

#[tokio::test]
async fn a_waiting_instance_rings_the_holder_again_when_a_ring_was_lost() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    let doorbell = crate::layout::doorbell_key(&InstanceId::parse("a").unwrap());
    world.store.delete(&doorbell).await.unwrap();
    b.reconcile(&id).await.unwrap();
    assert!(world.store.get(&doorbell).await.is_err(), "not at once");
    world.clock.advance(Duration::seconds(6));
    a.heartbeat().await;
    b.reconcile(&id).await.unwrap();
    assert_eq!(
        a.controller.answer_doorbell().await.unwrap(),
        vec![id.clone()],
        "rung again"
    );
    a.reconcile(&id).await.unwrap();
    b.reconcile(&id).await.unwrap();
    assert!(b.runtime.memory(&id).is_some(), "handed over");
}

#[tokio::test]
async fn a_hold_lives_on_the_instance_lease_and_dies_with_it() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create_checkpointed(&world).await;
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    // A ignores the ring (say it is busy); far past the lock's own lease,
    // A's instance lease keeps the hold.
    for _ in 0..6 {
        world.clock.advance(Duration::seconds(10));
        a.heartbeat().await;
        b.reconcile(&id).await.unwrap();
        assert!(b.runtime.memory(&id).is_none(), "A is alive");
    }
    // A dies (no more heartbeats): after its lease and the skew, B takes over.
    a.runtime.crash(&id);
    world.clock.advance(Duration::seconds(34));
    b.reconcile(&id).await.unwrap();
    assert!(b.runtime.memory(&id).is_none(), "not before lease + skew");
    world.clock.advance(Duration::seconds(2));
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    b.reconcile(&id).await.unwrap();
    assert!(b.runtime.memory(&id).is_some(), "taken over");
    assert_eq!(world.lease(&id).await.epoch, 3);
}

#[tokio::test]
async fn a_lapsed_instance_re_verifies_its_holds_with_a_lock_write_or_stops_them() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let kept = a.create_checkpointed(&world).await;
    let taken = a.create_checkpointed(&world).await;
    // A freezes past its lease; B takes `taken` meanwhile.
    world.clock.advance(Duration::seconds(40));
    b.controller
        .request_here(&taken, None, world.clock.now())
        .await
        .unwrap();
    b.reconcile(&taken).await.unwrap();
    assert!(b.runtime.memory(&taken).is_some());
    // A resumes: its renewal starts a new era, so neither hold is vouched for.
    a.heartbeat().await;
    let mut unvouched = a.controller.reconciler().unvouched();
    unvouched.sort();
    let mut expected = vec![kept.clone(), taken.clone()];
    expected.sort();
    assert_eq!(unvouched, expected);
    let held = a.controller.reconciler().held(&taken).unwrap();
    assert!(!a.controller.reconciler().leases().is_safe(&held));
    let generation = world.store.get(&lock_key(&kept)).await.unwrap().generation;
    a.reconcile(&kept).await.unwrap();
    assert!(a.runtime.memory(&kept).is_some());
    assert_ne!(
        world.store.get(&lock_key(&kept)).await.unwrap().generation,
        generation,
        "re-verified with a conditional write"
    );
    a.reconcile(&taken).await.unwrap();
    assert!(a.runtime.memory(&taken).is_none(), "the lost one stops");
    assert_eq!(a.controller.reconciler().unvouched(), vec![]);
}

#[tokio::test]
async fn a_lock_naming_this_instance_that_it_does_not_hold_is_released_when_rung() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    // A restarts with the same id: the new incarnation holds nothing, but its
    // instance lease keeps the old hold alive.
    let a2 = world.instance("a");
    a2.heartbeat().await;
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    assert_eq!(
        a2.controller.answer_doorbell().await.unwrap(),
        vec![id.clone()]
    );
    a2.reconcile(&id).await.unwrap();
    assert_eq!(world.lease(&id).await.holder, None, "released");
    drop(a);
    // No checkpoint was ever taken: B says so instead of hanging.
    let mut events = b.controller.subscribe(&id);
    b.reconcile(&id).await.unwrap();
    assert!(
        drain(&mut events)
            .iter()
            .any(|event| matches!(event, Progress::Failed { .. })),
        "a clear error"
    );
}

#[tokio::test]
async fn superseded_checkpoints_beyond_the_kept_ones_are_deleted_named_ones_stay() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let mut images = Vec::new();
    for (round, name) in [Some("keep-me"), None, None, None, None]
        .into_iter()
        .enumerate()
    {
        a.run(&id, &format!("round {round}")).await;
        a.controller
            .request_state(&id, DesiredState::Checkpointed, name)
            .await
            .unwrap();
        a.reconcile(&id).await.unwrap();
        images.push(
            world
                .metadata(&id)
                .await
                .status
                .latest_checkpoint
                .unwrap()
                .path,
        );
        world.clock.advance(Duration::seconds(1));
        a.controller
            .request_here(&id, None, world.clock.now())
            .await
            .unwrap();
        a.reconcile(&id).await.unwrap();
    }
    let status = world.metadata(&id).await.status;
    let previous: Vec<&str> = status
        .previous_checkpoints
        .iter()
        .map(|c| c.path.as_str())
        .collect();
    assert_eq!(
        previous,
        vec![images[3].as_str(), images[2].as_str()],
        "newest first, two kept"
    );
    let exists = |path: &str| {
        let key = crate::store::ObjectKey::new(path).unwrap();
        let store = world.store.clone();
        async move { store.get(&key).await.is_ok() }
    };
    assert!(exists(&images[0]).await, "the named checkpoint stays");
    assert!(!exists(&images[1]).await, "the oldest unnamed one is gone");
    for kept in &images[2..] {
        assert!(exists(kept).await);
    }
}

#[tokio::test]
async fn periodic_checkpoints_bound_what_a_crash_loses() {
    let world = World::new();
    let a = world.instance_with(
        "a",
        ReconcilerConfig {
            checkpoint_interval: Some(std::time::Duration::from_secs(60)),
            ..ReconcilerConfig::default()
        },
    );
    let id = a.create(&world).await;
    a.run(&id, "saved").await;
    let mut events = a.controller.subscribe(&id);
    a.live_through(&world, 61).await;
    a.reconcile(&id).await.unwrap();
    assert!(drain(&mut events).is_empty(), "silent to the client");
    assert_eq!(
        a.runtime.memory(&id).unwrap(),
        vec!["saved".to_owned()],
        "still running here"
    );
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Running);
    assert!(status.latest_checkpoint.is_some());
    a.run(&id, "lost").await;

    // A dies; B takes over after the lease and gets the periodic checkpoint.
    a.runtime.crash(&id);
    let b = world.instance("b");
    world.clock.advance(Duration::seconds(40));
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    b.reconcile(&id).await.unwrap();
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["saved".to_owned()]);
}

#[tokio::test]
async fn a_waiting_attach_whose_intent_was_replaced_is_told_at_once() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    a.controller
        .request_state(&id, DesiredState::Checkpointed, None)
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    let mut waiting_on_a = a.controller.subscribe(&id);
    a.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    // A client on B asks too, replacing A's intent before A acted on it.
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    assert!(
        matches!(&drain(&mut waiting_on_a)[..], [Progress::Failed { operation: Operation::Restore, message }] if message.contains("instance b")),
        "A's waiting client learns it lost the race"
    );
    b.reconcile(&id).await.unwrap();
    assert!(b.runtime.memory(&id).is_some());
}

// ---- lifecycle hooks --------------------------------------------------------

/// Records which hook ran when, and whether the sandbox was running then.
#[derive(Debug)]
struct RecordingHooks {
    runtime: FakeRuntime,
    calls: std::sync::Mutex<Vec<String>>,
    fail_cold_start: bool,
}

impl RecordingHooks {
    fn new(runtime: &FakeRuntime, fail_cold_start: bool) -> Arc<Self> {
        Arc::new(Self {
            runtime: runtime.clone(),
            calls: std::sync::Mutex::default(),
            fail_cold_start,
        })
    }

    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl crate::hooks::LifecycleHooks for RecordingHooks {
    async fn on_cold_start(
        &self,
        sandbox: &SandboxId,
        spec: &crate::api::SandboxSpec,
        start: crate::hooks::ColdStart,
    ) -> Result<(), crate::hooks::HookError> {
        let running = self.runtime.memory(sandbox).is_some();
        let workspace = spec.workspace.as_ref().map(|w| w.id.clone());
        self.record(format!(
            "cold_start {start:?} running={running} workspace={workspace:?}"
        ));
        if self.fail_cold_start {
            return Err(crate::hooks::HookError("the bucket is on fire".into()));
        }
        Ok(())
    }

    fn wants_after_exec(&self, _sandbox: &SandboxId) -> bool {
        true
    }

    async fn after_exec(&self, _sandbox: &SandboxId) {
        self.record("after_exec".into());
    }

    async fn on_terminate(&self, sandbox: &SandboxId) {
        let running = self.runtime.memory(sandbox).is_some();
        self.record(format!("terminate running={running}"));
    }

    fn forget(&self, _sandbox: &SandboxId) {
        self.record("forget".into());
    }
}

#[tokio::test]
async fn hooks_run_at_cold_start_after_each_execution_and_on_terminate() {
    let world = World::new();
    let mut recorder = None;
    let a = world.instance_hooked("a", ReconcilerConfig::default(), |runtime| {
        let hooks = RecordingHooks::new(runtime, false);
        recorder = Some(Arc::clone(&hooks));
        hooks
    });
    let hooks = recorder.unwrap();
    let id = SandboxId::random();
    let mut metadata = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
    metadata.spec.workspace = Some(crate::api::WorkspaceSpec {
        id: "proj".into(),
        template: "default".into(),
        extra: crate::api::ExtraFields::new(),
    });
    a.controller.create(&metadata).await.unwrap();
    a.reconcile(&id).await.unwrap();
    assert_eq!(
        hooks.calls(),
        ["cold_start Created running=true workspace=Some(\"proj\")"]
    );

    // The hook has run by the time the exit is reported.
    let mut execution = a
        .controller
        .exec(&id, ExecRequest::new(Command::Bash("true".into())))
        .await
        .unwrap();
    while let Some(event) = execution.events.recv().await {
        if let crate::runtime::ExecEvent::Exited(_) = event {
            assert_eq!(hooks.calls().last().unwrap(), "after_exec");
        }
    }
    assert_eq!(hooks.calls().len(), 2);

    a.controller
        .request_state(&id, DesiredState::Deleted, None)
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    assert_eq!(&hooks.calls()[2..], ["terminate running=true", "forget"]);
    assert!(a.runtime.memory(&id).is_none());
}

#[tokio::test]
async fn a_failed_cold_start_hook_fails_the_create_and_leaves_nothing_running() {
    let world = World::new();
    let a = world.instance_hooked("a", ReconcilerConfig::default(), |runtime| {
        RecordingHooks::new(runtime, true)
    });
    let id = SandboxId::random();
    let mut events = a.controller.subscribe(&id);
    let metadata = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
    a.controller.create(&metadata).await.unwrap();
    let _ = a.reconcile(&id).await;
    let seen = drain(&mut events);
    assert!(
        seen.iter().any(|p| matches!(p, Progress::Failed { operation: Operation::Create, message } if message.contains("the bucket is on fire"))),
        "{seen:?}"
    );
    assert!(a.runtime.memory(&id).is_none(), "the sandbox still runs");
    assert_ne!(world.metadata(&id).await.status.phase, Phase::Running);
}

/// A store that stops before its first read of `lock.json` until told to go
/// on: a reconcile pass frozen between reading metadata and reading the lock.
#[derive(Debug)]
struct PauseBeforeLockRead {
    inner: Arc<MemoryStore>,
    paused: tokio::sync::Notify,
    resume: tokio::sync::Notify,
    armed: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl Store for PauseBeforeLockRead {
    async fn get(
        &self,
        key: &crate::store::ObjectKey,
    ) -> Result<crate::store::Versioned, crate::store::StoreError> {
        if key.as_str().ends_with("/lock.json")
            && self.armed.swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            self.paused.notify_one();
            self.resume.notified().await;
        }
        self.inner.get(key).await
    }
    async fn put(
        &self,
        key: &crate::store::ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<crate::store::Generation, crate::store::StoreError> {
        self.inner.put(key, data, mode).await
    }
    async fn list_page(
        &self,
        prefix: &str,
        page_token: Option<String>,
    ) -> Result<crate::store::ListPage, crate::store::StoreError> {
        self.inner.list_page(prefix, page_token).await
    }
    async fn delete(&self, key: &crate::store::ObjectKey) -> Result<(), crate::store::StoreError> {
        self.inner.delete(key).await
    }
    async fn upload_blob(
        &self,
        key: &crate::store::ObjectKey,
        source: crate::store::BlobSource,
    ) -> Result<crate::store::ObjectInfo, crate::store::StoreError> {
        self.inner.upload_blob(key, source).await
    }
    async fn download_blob(
        &self,
        key: &crate::store::ObjectKey,
    ) -> Result<crate::store::BlobReader, crate::store::StoreError> {
        self.inner.download_blob(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_restores_the_checkpoint_recorded_after_its_pass_read_metadata() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    a.run(&id, "state").await;
    // B's pass reads metadata (no checkpoint yet), then stops before the lock.
    let store = Arc::new(PauseBeforeLockRead {
        inner: world.store.clone(),
        paused: tokio::sync::Notify::new(),
        resume: tokio::sync::Notify::new(),
        armed: std::sync::atomic::AtomicBool::new(false),
    });
    let runtime = FakeRuntime::new(store.clone());
    let bus = ProgressBus::default();
    let leases = Leases::new(
        store.clone(),
        Arc::new(world.clock.clone()),
        InstanceId::parse("b").unwrap(),
        LeaseConfig::default(),
    );
    let b = SandboxController::new(
        Reconciler::new(ReconcilerParts {
            metadata: store.clone(),
            checkpoints: store.clone(),
            checkpoint_bucket: "test-bucket".to_owned(),
            snapshot_bucket: "test-bucket".to_owned(),
            runtime: Arc::new(runtime.clone()),
            leases,
            clock: Arc::new(world.clock.clone()),
            bus: bus.clone(),
            config: ReconcilerConfig::default(),
        }),
        bus,
    );
    b.request_here(&id, None, world.clock.now()).await.unwrap();
    store
        .armed
        .store(true, std::sync::atomic::Ordering::Release);
    let pass = {
        let b = Arc::clone(&b);
        let id = id.clone();
        tokio::spawn(async move { b.reconciler().reconcile(&id).await })
    };
    store.paused.notified().await;
    // Meanwhile A hands over: records the checkpoint, releases.
    assert_eq!(
        a.controller.answer_doorbell().await.unwrap(),
        vec![id.clone()]
    );
    a.reconcile(&id).await.unwrap();
    assert!(world.metadata(&id).await.status.latest_checkpoint.is_some());
    store.resume.notify_one();
    pass.await.unwrap().unwrap();
    assert_eq!(
        runtime.memory(&id),
        Some(vec!["state".to_owned()]),
        "restored from the checkpoint recorded after the pass read metadata"
    );
}

/// A fork restores its own copy of the source's checkpoint: same memory,
/// own id, lease and checkpoint objects; the source and its history are
/// untouched, and the fork keeps running when the source's checkpoint goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_restores_its_own_copy_of_the_sources_checkpoint() {
    use super::reconciler::ForkPoint;
    let world = World::new();
    let a = world.instance("a");
    let source = a.create(&world).await;
    a.run(&source, "x=1").await;
    a.controller
        .request_state(&source, DesiredState::Checkpointed, Some("first"))
        .await
        .unwrap();
    a.reconcile(&source).await.unwrap();
    let source_doc = world.metadata(&source).await;
    let source_ref = source_doc.status.latest_checkpoint.clone().unwrap();

    let b = world.instance("b");
    let mut forks = Vec::new();
    for _ in 0..3 {
        let fork = SandboxId::random();
        let mut metadata = SandboxMetadata::new(fork.clone(), world.clock.now(), TOKEN_HASH.into());
        metadata.spec.enable_checkpoint = true;
        b.controller
            .fork(&source_doc, &ForkPoint::Latest, metadata)
            .await
            .unwrap();
        b.reconcile(&fork).await.unwrap();
        assert_eq!(b.runtime.memory(&fork).unwrap(), vec!["x=1".to_owned()]);
        let status = world.metadata(&fork).await.status;
        assert_eq!(status.phase, Phase::Running);
        let own = status.latest_checkpoint.unwrap();
        assert_ne!(own.path, source_ref.path, "a fork never shares an image");
        assert_eq!(own.sha256, source_ref.sha256);
        let origin = status.forked_from.unwrap();
        assert_eq!(origin.sandbox_id, source);
        forks.push(fork);
    }
    // Each diverges on its own.
    b.run(&forks[0], "y=2").await;
    assert_eq!(b.runtime.memory(&forks[0]).unwrap().len(), 2);
    assert_eq!(b.runtime.memory(&forks[1]).unwrap(), vec!["x=1".to_owned()]);
    // The source is as it was: checkpointed, nobody holds it.
    let after = world.metadata(&source).await;
    assert_eq!(after.status, source_doc.status);
    assert_eq!(world.lease(&source).await.holder, None);

    // The source's retention may delete its checkpoint: every fork keeps
    // its own copy, and a later fork of the gone checkpoint fails clearly.
    let source_id = crate::layout::checkpoint_id_of_image(&source_ref.path).unwrap();
    world
        .store
        .delete(&checkpoint_image_key(&source_id))
        .await
        .unwrap();
    for fork in &forks {
        let own = world.metadata(fork).await.status.latest_checkpoint.unwrap();
        let image = crate::store::ObjectKey::new(own.path.as_str()).unwrap();
        assert_eq!(world.store.get(&image).await.unwrap().data.as_ref(), b"x=1");
    }
    let late = SandboxId::random();
    let metadata = SandboxMetadata::new(late.clone(), world.clock.now(), TOKEN_HASH.into());
    let err = b
        .controller
        .fork(&source_doc, &ForkPoint::Latest, metadata)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("cannot copy the checkpoint"),
        "{err}"
    );
    assert!(world.store.get(&metadata_key(&late)).await.is_err());

    // By name, and the errors: no such name, no checkpoint at all.
    let named = SandboxId::random();
    let metadata = SandboxMetadata::new(named.clone(), world.clock.now(), TOKEN_HASH.into());
    let err = b
        .controller
        .fork(&source_doc, &ForkPoint::Named("nope".into()), metadata)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no checkpoint named \"nope\""),
        "{err}"
    );
    assert!(world.store.get(&metadata_key(&named)).await.is_err());
    let fresh = a.create(&world).await;
    let fresh_doc = world.metadata(&fresh).await;
    let metadata = SandboxMetadata::new(named.clone(), world.clock.now(), TOKEN_HASH.into());
    let err = b
        .controller
        .fork(&fresh_doc, &ForkPoint::Latest, metadata)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("has no checkpoint yet"), "{err}");
}
