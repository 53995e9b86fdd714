//! The reconciler on the in-memory store, fake runtime and manual clock:
//! passes driven by hand, checking the bucket's JSON, runtime and events.

/// Whether the events `seen` hold one that matches `pattern`.
macro_rules! heard {
    ($seen:expr, $pattern:pat $(if $guard:expr)?) => {
        $seen.iter().any(|event| matches!(event, $pattern $(if $guard)?))
    };
}

mod checkpoints;
mod fork;
mod handoff;
pub(super) mod hooked_store;
mod hooks;
mod leases;
mod lifecycle;
mod paths;

use std::sync::Arc;

use bytes::Bytes;
use chrono::Duration;
use tokio::sync::broadcast;

use super::*;
use crate::api::{
    DesiredState, InstanceId, Lease, Phase, SandboxId, SandboxMetadata, decode, encode,
};
use crate::clock::Clock;
use crate::layout::{checkpoint_image_key, handoff_checkpoint_id, lock_key, metadata_key};
use crate::leasing::{HeldLease, LeaseConfig, Leases};
use crate::runtime::{Command, ExecRequest};
use crate::store::{Generation, ObjectKey, PutMode, Store};
use crate::testing::{FakeRuntime, ManualClock, MemoryStore};

/// The token hash of the sandboxes made here, in the table's tests and the sim.
pub(in crate::sandboxes) const TOKEN_HASH: &str =
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// A hold of sandbox 1 on `lease` renewed at `renewed_at` (table, slot tests).
pub(in crate::sandboxes) fn held_lease(
    lease: Lease,
    renewed_at: chrono::DateTime<chrono::Utc>,
) -> HeldLease {
    HeldLease {
        sandbox: SandboxId::from_u128(1),
        epoch: lease.epoch,
        renewed_at,
        generation: crate::store::Generation(1),
        lease,
        era: 1,
    }
}

/// An instance: its controller and the fake runtime it runs sandboxes on.
pub(super) struct Instance {
    pub(super) controller: Arc<SandboxController>,
    pub(super) runtime: FakeRuntime,
}

struct World {
    store: Arc<MemoryStore>,
    /// The bucket as the instances see it: the store itself, or a wrapper.
    bucket: Arc<dyn Store>,
    clock: ManualClock,
}

impl World {
    fn new() -> Self {
        Self::wrapped(|store| store)
    }

    fn wrapped(wrap: impl FnOnce(Arc<MemoryStore>) -> Arc<dyn Store>) -> Self {
        let store = Arc::new(MemoryStore::new());
        Self {
            bucket: wrap(store.clone()),
            store,
            clock: ManualClock::new(),
        }
    }

    /// A world whose instances see the store through `hook`, and that store.
    fn hooked<H: hooked_store::BeforeRequest + 'static>(
        hook: H,
    ) -> (Self, Arc<hooked_store::HookedStore<H>>) {
        let mut hooked = None;
        let world = Self::wrapped(|store| {
            let store = Arc::new(hooked_store::HookedStore::new(store, hook));
            hooked.insert(store).clone()
        });
        (world, hooked.unwrap())
    }

    /// A world whose instance `a` holds a sandbox it created ([`Instance::create`]).
    async fn with_a_sandbox() -> (Self, Instance, SandboxId) {
        let world = Self::new();
        let a = world.instance("a");
        let id = a.create(&world).await;
        (world, a, id)
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
        let (clock, lease) = (Arc::new(self.clock.clone()), LeaseConfig::for_tests());
        Instance::build(self.bucket.clone(), clock, name, lease, config, hooks)
    }

    /// Instance `name`, seeing the bucket through `hook`.
    fn instance_through<H: hooked_store::BeforeRequest + 'static>(
        &self,
        name: &str,
        hook: H,
        config: ReconcilerConfig,
    ) -> (Arc<hooked_store::HookedStore<H>>, Instance) {
        let store = Arc::new(hooked_store::HookedStore::new(self.store.clone(), hook));
        let (clock, lease) = (Arc::new(self.clock.clone()), LeaseConfig::for_tests());
        let no_hooks = |_: &FakeRuntime| Arc::new(crate::hooks::NoHooks) as _;
        let instance = Instance::build(store.clone(), clock, name, lease, config, no_hooks);
        (store, instance)
    }

    /// A new sandbox's id and record; `checkpointable`: `enable_checkpoint`.
    fn new_sandbox(&self, checkpointable: bool) -> (SandboxId, SandboxMetadata) {
        let id = SandboxId::random();
        let mut metadata = SandboxMetadata::new(id.clone(), self.clock.now(), TOKEN_HASH.into());
        metadata.spec.enable_checkpoint = checkpointable;
        (id, metadata)
    }

    /// Instance `a`, holding a sandbox it created and ran `code` in.
    async fn a_running(&self, code: &str) -> (Instance, SandboxId) {
        let a = self.instance("a");
        let id = a.create(self).await;
        a.run(&id, code).await;
        (a, id)
    }

    async fn metadata(&self, id: &SandboxId) -> SandboxMetadata {
        decode(&self.store.get(&metadata_key(id)).await.unwrap().data).unwrap()
    }

    async fn lease(&self, id: &SandboxId) -> Lease {
        decode(&self.store.get(&lock_key(id)).await.unwrap().data).unwrap()
    }

    /// The generation of the object at `key` (which must exist).
    async fn generation(&self, key: &ObjectKey) -> Generation {
        self.store.get(key).await.unwrap().generation
    }

    async fn exists(&self, key: ObjectKey) -> bool {
        self.store.get(&key).await.is_ok()
    }

    /// Writes `data` at `key` as an operator's edit would (unconditionally).
    async fn overwrite(&self, key: &ObjectKey, data: impl Into<Bytes>) {
        let data = data.into();
        self.store.put(key, data, PutMode::Overwrite).await.unwrap();
    }

    /// Hands `id`'s lock to `holder` at the next epoch, as an operator's edit.
    async fn hand_lock_to(&self, id: &SandboxId, holder: &str) {
        let mut lease = self.lease(id).await;
        lease.holder = Some(named(holder));
        lease.epoch += 1;
        self.overwrite(&lock_key(id), encode(&lease)).await;
    }

    /// Changes `id`'s metadata with `edit`, as an operator's edit would.
    async fn edit<R>(&self, id: &SandboxId, edit: impl FnOnce(&mut SandboxMetadata) -> R) {
        let mut metadata = self.metadata(id).await;
        edit(&mut metadata);
        self.overwrite(&metadata_key(id), encode(&metadata)).await;
    }

    /// Sets `id`'s desired state as an operator's edit would.
    async fn set_desired(&self, id: &SandboxId, desired: DesiredState) {
        self.edit(id, |m| m.spec.desired_state = desired).await;
    }
}

/// The reconciler's settings, with a checkpoint every minute if `periodic`.
fn checkpointing(periodic: bool) -> ReconcilerConfig {
    let checkpoint_interval = periodic.then_some(std::time::Duration::from_secs(60));
    ReconcilerConfig {
        checkpoint_interval,
        ..ReconcilerConfig::default()
    }
}

fn named(name: &str) -> InstanceId {
    InstanceId::parse(name).unwrap()
}

/// Waits at most 10 s for `future`; `what` says what waited too long.
async fn within_10s<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    let within = std::time::Duration::from_secs(10);
    tokio::time::timeout(within, future).await.expect(what)
}

impl Instance {
    /// Instance `name` with a fake runtime on `bucket` and `hooks`' hooks.
    pub(super) fn build(
        bucket: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        name: &str,
        lease: LeaseConfig,
        config: ReconcilerConfig,
        hooks: impl FnOnce(&FakeRuntime) -> Arc<dyn crate::hooks::LifecycleHooks>,
    ) -> Self {
        let runtime = FakeRuntime::new(bucket.clone());
        let name = InstanceId::parse(name).unwrap();
        let reconciler = Reconciler::new(ReconcilerParts {
            metadata: bucket.clone(),
            checkpoints: bucket.clone(),
            checkpoint_bucket: "test-bucket".to_owned(),
            snapshot_bucket: "test-bucket".to_owned(),
            runtime: Arc::new(runtime.clone()),
            leases: Leases::new(bucket, clock.clone(), name, lease),
            clock,
            config,
        })
        .with_hooks(hooks(&runtime));
        Self {
            controller: SandboxController::new(reconciler),
            runtime,
        }
    }

    /// One pass, and the steps it left running in tasks of their own.
    async fn reconcile(&self, id: &SandboxId) -> Result<Requeue, ReconcileError> {
        let outcome = self.controller.reconciler().reconcile(id).await;
        self.controller.reconciler().background_settled().await;
        outcome
    }

    /// Whether `id` runs here (the runtime has its memory).
    fn runs(&self, id: &SandboxId) -> bool {
        self.runtime.memory(id).is_some()
    }

    /// [`Self::reconcile`], which must succeed: when to look again.
    async fn pass(&self, id: &SandboxId) -> Requeue {
        self.reconcile(id).await.unwrap()
    }

    fn reconciler(&self) -> &Reconciler {
        self.controller.reconciler()
    }

    /// The requeue of a pass that waits for the lock (it looks again soon).
    fn acquire_poll(&self) -> Requeue {
        Requeue::After(self.reconciler().config().acquire_poll)
    }

    /// Asks for `id` here (now, by its clock), with the pass serving the ask.
    async fn request_here(&self, id: &SandboxId, at: Option<&str>) -> Result<(), ControlError> {
        let (controller, now) = (&self.controller, self.reconciler().clock().now());
        let ask = controller.request_here(id, at, now);
        controller.serving(id, ask).await
    }

    /// Asks for `id` to be in `desired`, with the pass that serves the ask.
    async fn request_state(
        &self,
        id: &SandboxId,
        desired: DesiredState,
        name: Option<&str>,
    ) -> Result<(), ControlError> {
        let ask = self.controller.request_state(id, desired, name);
        self.controller.serving(id, ask).await
    }

    /// [`Self::request_state`], which must succeed.
    async fn ask(&self, id: &SandboxId, desired: DesiredState, name: Option<&str>) {
        self.request_state(id, desired, name).await.unwrap();
    }

    /// Asks for `id` to be in `desired` without running a pass: the next
    /// [`Self::reconcile`] serves the ask; the handle gives its reply.
    async fn send_state(
        &self,
        id: &SandboxId,
        desired: DesiredState,
    ) -> tokio::task::JoinHandle<Result<(), ControlError>> {
        let asked = self.spawn(id, move |c, id| async move {
            c.request_state(&id, desired, None).await
        });
        while self.controller.reconciler().commands_waiting(id) == 0 {
            tokio::task::yield_now().await;
        }
        asked
    }

    /// Asks for `id` checkpointed (as `name`), served by a pass, then one more.
    async fn checkpoint(&self, id: &SandboxId, name: Option<&str>) {
        self.ask(id, DesiredState::Checkpointed, name).await;
        self.pass(id).await;
    }

    /// Asks for `id` here (from its latest checkpoint), then one more pass.
    async fn bring_here(&self, id: &SandboxId) {
        self.request_here(id, None).await.unwrap();
        self.pass(id).await;
    }

    /// Forks `source` at `point` as `metadata`, with the pass serving it.
    async fn fork_from(
        &self,
        source: &SandboxMetadata,
        point: &ForkPoint,
        metadata: SandboxMetadata,
    ) -> Result<(), ControlError> {
        let id = metadata.sandbox_id.clone();
        let fork = self.controller.fork(source, point, metadata);
        self.controller.serving(&id, fork).await
    }

    /// Records `metadata` as a new sandbox, with the pass that serves it.
    async fn create_from(&self, metadata: &SandboxMetadata) -> Result<(), ControlError> {
        let create = self.controller.create(metadata);
        self.controller.serving(&metadata.sandbox_id, create).await
    }

    async fn create(&self, world: &World) -> SandboxId {
        let (id, metadata) = world.new_sandbox(true);
        self.create_from(&metadata).await.unwrap();
        self.pass(&id).await;
        id
    }

    /// Reads the doorbell as the instance's loop does: the sandboxes it names.
    async fn answer_doorbell(&self) -> Vec<SandboxId> {
        self.controller.answer_doorbell().await.unwrap()
    }

    /// Asks for `id` to be deleted, with the pass that serves the ask.
    async fn delete(&self, id: &SandboxId) {
        self.ask(id, DesiredState::Deleted, None).await;
    }

    /// What the instance lease loop does every `renew_interval`.
    async fn heartbeat(&self) {
        let lease = self.reconciler().leases().instance_lease();
        lease.renew().await.unwrap();
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

    /// A sandbox held here with a checkpoint to restore (checkpointed, back).
    async fn create_checkpointed(&self, world: &World) -> SandboxId {
        let id = self.create(world).await;
        self.checkpoint(&id, None).await;
        self.bring_here(&id).await;
        assert!(self.controller.is_held_here(&id));
        id
    }

    /// `task` on this instance's controller and `id`, in a task of its own.
    fn spawn<F: std::future::Future<Output: Send> + Send + 'static>(
        &self,
        id: &SandboxId,
        task: impl FnOnce(Arc<SandboxController>, SandboxId) -> F,
    ) -> tokio::task::JoinHandle<F::Output> {
        tokio::spawn(task(Arc::clone(&self.controller), id.clone()))
    }

    /// Starts `code` in `id`; the execution runs until it is read or killed.
    async fn exec(&self, id: &SandboxId, code: &str) -> crate::runtime::Execution {
        let request = ExecRequest::new(Command::Bash(code.into()));
        self.controller.exec(id, request).await.unwrap()
    }

    async fn run(&self, id: &SandboxId, code: &str) {
        let mut execution = self.exec(id, code).await;
        while execution.events.recv().await.is_some() {}
    }
}

/// A restore's failure for `cause`, as its waiting clients hear it.
fn restore_failed(cause: StartFailure) -> SandboxEvent {
    let kind = StartKind::Restore;
    SandboxEvent::StartFailed { kind, cause }
}

/// The events `events` holds now.
fn drain(events: &mut broadcast::Receiver<SandboxEvent>) -> Vec<SandboxEvent> {
    std::iter::from_fn(|| events.try_recv().ok()).collect()
}
