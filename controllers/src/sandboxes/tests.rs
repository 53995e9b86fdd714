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
use crate::layout::{lock_key, metadata_key};
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
    // Noticed at the next renewal: its conditional write fails.
    world.clock.advance(Duration::seconds(16));

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
async fn the_lease_is_renewed_once_per_renew_interval_with_one_write() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let first = world.lease(&id).await.renewed_at;
    a.reconcile(&id).await.unwrap();
    assert_eq!(world.lease(&id).await.renewed_at, first, "not due yet");
    world.clock.advance(Duration::seconds(16));
    let operations = world.store.operations();
    a.reconcile(&id).await.unwrap();
    let used = world.store.operations() - operations;
    assert!(world.lease(&id).await.renewed_at > first);
    assert_eq!(used, 1, "one conditional write, no read");
}

#[tokio::test]
async fn an_attach_intent_is_noticed_by_the_renewal_even_with_the_client_attached() {
    let world = World::new();
    let a = world.instance("a");
    let b = world.instance("b");
    let id = a.create(&world).await;
    b.controller
        .request_here(&id, None, world.clock.now())
        .await
        .unwrap();
    a.reconcile(&id).await.unwrap();
    assert!(a.runtime.memory(&id).is_some(), "not before the renewal");
    world.clock.advance(Duration::seconds(16));
    a.reconcile(&id).await.unwrap();
    assert!(
        a.runtime.memory(&id).is_none(),
        "handed over at the renewal"
    );
    b.reconcile(&id).await.unwrap();
    assert!(b.runtime.memory(&id).is_some());
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
    world.clock.advance(Duration::seconds(61));
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
