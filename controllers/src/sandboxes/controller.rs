//! The sandbox controller of one instance: the work queue, its worker loop,
//! and the narrow surface the API layer may use. That surface writes intents
//! (spec fields, the lease's `wanted_by`) and queues a reconcile; it never
//! creates, checkpoints or restores a sandbox itself. Executions and
//! filesystem snapshots pass through to the runtime, but only for a sandbox
//! this instance holds. A fork copies its source's checkpoint (data, not
//! state) before recording the new sandbox.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::sync::broadcast;

use crate::api::{
    DesiredState, ForkOrigin, Phase, RestoreRequest, SandboxId, SandboxMetadata, SandboxSpec,
    SnapshotRef, decode, encode,
};
use crate::layout::metadata_key;
use crate::leasing::LeaseError;
use crate::runtime::{ExecRequest, Execution, RuntimeError};
use crate::store::{Decision, PutMode, RmwError, StoreError, read_modify_write};

use super::progress::{Progress, ProgressBus};
use super::reconciler::{ForkError, ForkPoint, ReconcileError, Reconciler, Requeue};
use super::workqueue::WorkQueue;

/// Longest back-off between failed reconciles of one sandbox.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Reconciles running at once on one instance (each is one sandbox; a
/// checkpoint or restore among them may take seconds).
const MAX_CONCURRENT_RECONCILES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("sandbox {0} does not exist")]
    NotFound(SandboxId),
    #[error("sandbox {0} does not run on this instance")]
    NotHere(SandboxId),
    #[error("sandbox {0} already exists")]
    AlreadyExists(SandboxId),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Reconcile(#[from] ReconcileError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("{0} kept changing under concurrent writers; try again")]
    Contended(String),
    #[error(transparent)]
    Fork(#[from] ForkError),
}

/// The controller: share it behind an `Arc`.
#[derive(Debug)]
pub struct SandboxController {
    reconciler: Arc<Reconciler>,
    queue: WorkQueue,
    bus: ProgressBus,
    reconcile_errors: std::sync::atomic::AtomicU64,
    doorbell: std::sync::Mutex<DoorbellState>,
}

/// What this instance last read from its doorbell.
#[derive(Debug, Default)]
struct DoorbellState {
    generation: Option<crate::store::Generation>,
    /// Rings already answered, by sandbox and time.
    answered: HashSet<(SandboxId, chrono::DateTime<chrono::Utc>)>,
}

/// How often the lease loop looks whether a renewal is due (local only).
const LEASE_TICK: Duration = Duration::from_millis(250);

impl SandboxController {
    /// `bus` must be the one the reconciler emits on.
    pub fn new(reconciler: Reconciler, bus: ProgressBus) -> Arc<Self> {
        Arc::new(Self {
            reconciler: Arc::new(reconciler),
            queue: WorkQueue::default(),
            bus,
            reconcile_errors: std::sync::atomic::AtomicU64::new(0),
            doorbell: std::sync::Mutex::new(DoorbellState::default()),
        })
    }

    pub fn reconciler(&self) -> &Reconciler {
        &self.reconciler
    }

    /// Runs the worker loop (each queued sandbox is reconciled in its own
    /// task, one reconcile per sandbox at a time, failures retried with
    /// back-off), the instance lease loop and the doorbell loop. Aborting the
    /// handle stops all three.
    pub fn spawn_workers(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let workers = Arc::clone(self).work();
        let lease = Arc::clone(self).keep_instance_lease();
        let doorbell = Arc::clone(self).watch_doorbell();
        tokio::spawn(async move {
            tokio::join!(workers, lease, doorbell);
        })
    }

    /// Renews the instance lease every `renew_interval` while the instance
    /// holds (or just held) sandboxes. This loop is the only thing that keeps
    /// holds alive, so a long checkpoint or upload never delays it. Holds the
    /// lease stops vouching for (a lapse) are queued: they are re-verified or
    /// stopped.
    async fn keep_instance_lease(self: Arc<Self>) {
        let every = chrono::Duration::from_std(self.reconciler.config().renew_interval)
            .unwrap_or(chrono::Duration::MAX);
        let instance_lease = self.reconciler.leases().instance_lease().clone();
        let mut retry_after: Option<tokio::time::Instant> = None;
        loop {
            tokio::time::sleep(LEASE_TICK).await;
            if !self.reconciler.needs_instance_lease() || !instance_lease.renewal_due(every) {
                continue;
            }
            if retry_after.is_some_and(|at| tokio::time::Instant::now() < at) {
                continue;
            }
            let era = instance_lease.era();
            match instance_lease.renew().await {
                Ok(renewed) => {
                    retry_after = None;
                    if renewed != era {
                        tracing::warn!(
                            era = renewed,
                            "the instance lease had lapsed; re-verifying holds"
                        );
                    }
                }
                Err(err) => {
                    tracing::warn!(%err, "cannot renew the instance lease");
                    retry_after = Some(tokio::time::Instant::now() + Duration::from_secs(1));
                }
            }
            for sandbox in self.reconciler.unvouched() {
                self.enqueue(&sandbox);
            }
        }
    }

    /// Reads the doorbell every `doorbell_poll` while the instance holds
    /// sandboxes (nobody rings an instance that holds none), every
    /// `doorbell_poll_active` while a client attached here is active.
    async fn watch_doorbell(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.reconciler.doorbell_interval()).await;
            if !self.reconciler.needs_instance_lease() {
                continue;
            }
            if let Err(err) = self.answer_doorbell().await {
                tracing::warn!(%err, "cannot read the doorbell");
            }
        }
    }

    /// Reads the doorbell once and queues a full pass of every sandbox rung
    /// for since the last read. Returns them.
    pub async fn answer_doorbell(&self) -> Result<Vec<SandboxId>, ControlError> {
        let Some((bell, generation)) = self
            .reconciler
            .leases()
            .instance_lease()
            .read_doorbell()
            .await?
        else {
            return Ok(Vec::new());
        };
        let rung = {
            let mut state = self
                .doorbell
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if state.generation == Some(generation) {
                return Ok(Vec::new());
            }
            state.generation = Some(generation);
            let present: HashSet<_> = bell
                .rings
                .iter()
                .map(|ring| (ring.sandbox.clone(), ring.rung_at))
                .collect();
            state.answered.retain(|ring| present.contains(ring));
            let mut rung = Vec::new();
            for ring in present {
                if state.answered.insert(ring.clone()) && !rung.contains(&ring.0) {
                    rung.push(ring.0);
                }
            }
            rung
        };
        for sandbox in &rung {
            tracing::debug!(%sandbox, "doorbell rung");
            self.enqueue(sandbox);
        }
        Ok(rung)
    }

    /// The worker loop proper. Its reconciles are its own tasks: at most
    /// [`MAX_CONCURRENT_RECONCILES`] at once (more wait in the queue), and
    /// aborted with the loop when the server stops its workers.
    async fn work(self: Arc<Self>) {
        let controller = self;
        {
            let failures = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<
                SandboxId,
                u32,
            >::new()));
            let limit = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_RECONCILES));
            let mut reconciles = tokio::task::JoinSet::new();
            loop {
                // The semaphore is never closed.
                let Ok(permit) = Arc::clone(&limit).acquire_owned().await else {
                    return;
                };
                let sandbox = controller.queue.next().await;
                while reconciles.try_join_next().is_some() {}
                let controller = Arc::clone(&controller);
                let failures = Arc::clone(&failures);
                reconciles.spawn(async move {
                    let _permit = permit;
                    let outcome = controller.reconciler.reconcile(&sandbox).await;
                    controller.queue.done(&sandbox);
                    let mut failures = failures
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    match outcome {
                        Ok(requeue) => {
                            failures.remove(&sandbox);
                            if let Requeue::After(delay) = requeue {
                                controller.queue.add_after(&sandbox, delay);
                            }
                        }
                        Err(err) => {
                            controller
                                .reconcile_errors
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            controller.reconciler.want_full_pass(&sandbox);
                            let count = failures.entry(sandbox.clone()).or_insert(0);
                            *count = count.saturating_add(1);
                            let delay = backoff(*count);
                            tracing::warn!(%sandbox, %err, retry_in = ?delay, "reconcile failed");
                            controller.queue.add_after(&sandbox, delay);
                        }
                    }
                });
            }
        }
    }

    /// Queues a full reconcile of `sandbox` now (after writing an intent).
    pub fn enqueue(&self, sandbox: &SandboxId) {
        self.reconciler.want_full_pass(sandbox);
        self.queue.add(sandbox);
    }

    /// Something local happened to `sandbox` (an execution ended): look at
    /// it soon. Costs nothing in storage unless a step is due.
    pub fn poke(&self, sandbox: &SandboxId) {
        self.queue.add(sandbox);
    }

    /// Failed reconcile passes so far (each is logged with its reason).
    pub fn reconcile_errors(&self) -> u64 {
        self.reconcile_errors
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A client attached to (`true`) or left a sandbox held here. A sandbox
    /// whose client left is watched closely for a while: the client may be
    /// reconnecting through another instance.
    pub fn client_attached(&self, sandbox: &SandboxId, attached: bool) {
        self.reconciler.client_attached(sandbox, attached);
        if !attached {
            self.queue.add(sandbox);
        }
    }

    /// The client attached to `sandbox` sent a frame: for a while the
    /// doorbell is read at the active interval (a client whose network drops
    /// mid-use reconnects through another instance within seconds).
    pub fn client_active(&self, sandbox: &SandboxId) {
        self.reconciler.client_active(sandbox);
    }

    /// The reconciler's progress on `sandbox`, from now on.
    pub fn subscribe(&self, sandbox: &SandboxId) -> broadcast::Receiver<Progress> {
        self.bus.subscribe(sandbox)
    }

    pub fn is_held_here(&self, sandbox: &SandboxId) -> bool {
        self.reconciler.held(sandbox).is_some()
    }

    pub fn held_sandboxes(&self) -> Vec<SandboxId> {
        self.reconciler.held_sandboxes()
    }

    pub async fn read(&self, sandbox: &SandboxId) -> Result<Option<SandboxMetadata>, ControlError> {
        Ok(self.reconciler.read_metadata(sandbox).await?)
    }

    /// Records a new sandbox (desired running) and asks for it here.
    pub async fn create(&self, metadata: &SandboxMetadata) -> Result<(), ControlError> {
        let sandbox = &metadata.sandbox_id;
        match self
            .reconciler
            .metadata_store()
            .put(&metadata_key(sandbox), encode(metadata), PutMode::Create)
            .await
        {
            Ok(_) => {}
            Err(StoreError::PreconditionFailed { .. }) => {
                return Err(ControlError::AlreadyExists(sandbox.clone()));
            }
            Err(err) => return Err(err.into()),
        }
        self.reconciler.leases().request_attach(sandbox).await?;
        self.enqueue(sandbox);
        Ok(())
    }

    /// Records `metadata` (a new sandbox) as a fork of `source` at `point`
    /// and asks for it here: it is restored from its own copy of that
    /// checkpoint, on the image and kind of network the checkpoint needs.
    pub async fn fork(
        &self,
        source: &SandboxMetadata,
        point: &ForkPoint,
        mut metadata: SandboxMetadata,
    ) -> Result<(), ControlError> {
        let forked = self
            .reconciler
            .copy_checkpoint_for_fork(source, point, &metadata.sandbox_id)
            .await?;
        metadata.spec.network = forked.manifest.network;
        metadata.spec.image.clone_from(&source.spec.image);
        metadata.status.phase = Phase::Checkpointed;
        metadata.status.forked_from = Some(ForkOrigin {
            sandbox_id: source.sandbox_id.clone(),
            checkpoint: forked.source_checkpoint,
            name: match point {
                ForkPoint::Latest => None,
                ForkPoint::Named(name) => Some(name.clone()),
            },
        });
        metadata.status.latest_checkpoint = Some(forked.reference);
        tracing::info!(
            fork = %metadata.sandbox_id,
            source = %source.sandbox_id,
            ?point,
            "forking a sandbox"
        );
        self.create(&metadata).await
    }

    /// Asks for `sandbox` to run here, from the checkpoint named `checkpoint`
    /// if given (else the latest).
    pub async fn request_here(
        &self,
        sandbox: &SandboxId,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        self.update_spec(sandbox, |spec| {
            spec.desired_state = DesiredState::Running;
            if let Some(name) = checkpoint {
                spec.restore_request = Some(RestoreRequest {
                    checkpoint: name.to_owned(),
                    requested_at: now,
                });
            }
        })
        .await?;
        self.reconciler.mark_waiting(sandbox);
        self.reconciler.leases().request_attach(sandbox).await?;
        self.enqueue(sandbox);
        Ok(())
    }

    /// Withdraws this instance's wish to run `sandbox` (its client gave up).
    pub async fn withdraw_request(&self, sandbox: &SandboxId) -> Result<(), ControlError> {
        self.reconciler.leases().withdraw_attach(sandbox).await?;
        Ok(())
    }

    /// Asks for `sandbox` to be checkpointed (under `name`, if given) or deleted.
    pub async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
        checkpoint_name: Option<&str>,
    ) -> Result<(), ControlError> {
        self.update_spec(sandbox, |spec| {
            spec.desired_state = desired;
            if desired == DesiredState::Checkpointed {
                spec.checkpoint_name = checkpoint_name.map(str::to_owned);
            }
        })
        .await?;
        self.enqueue(sandbox);
        self.ring_holder(sandbox).await;
        Ok(())
    }

    /// Rings the doorbell of `sandbox`'s holder when that is another
    /// instance, so an intent written here takes effect there at once.
    /// Failures are logged: the holder's resync catches up.
    async fn ring_holder(&self, sandbox: &SandboxId) {
        if self.is_held_here(sandbox) {
            return;
        }
        let leases = self.reconciler.leases();
        match leases.read(sandbox).await {
            Ok(Some((lease, _))) => {
                if let Some(holder) = lease.holder.filter(|h| h != leases.instance())
                    && let Err(err) = leases.instance_lease().ring(&holder, sandbox).await
                {
                    tracing::warn!(%sandbox, %holder, %err, "cannot ring the holder's doorbell");
                }
            }
            Ok(None) => {}
            Err(err) => tracing::warn!(%sandbox, %err, "cannot read the lock to ring its holder"),
        }
    }

    /// Read-modify-write of the spec under the object's generation.
    async fn update_spec(
        &self,
        sandbox: &SandboxId,
        mut change: impl FnMut(&mut SandboxSpec),
    ) -> Result<(), ControlError> {
        let store = self.reconciler.metadata_store();
        let key = metadata_key(sandbox);
        let outcome = read_modify_write(store.as_ref(), &key, |current| {
            let current = current.ok_or_else(|| ControlError::NotFound(sandbox.clone()))?;
            let mut metadata: SandboxMetadata =
                decode(&current.data).map_err(|err| ReconcileError::Invalid {
                    key: key.to_string(),
                    detail: err.to_string(),
                })?;
            let before = metadata.spec.clone();
            change(&mut metadata.spec);
            Ok(if metadata.spec == before {
                Decision::Keep(())
            } else {
                Decision::Write(encode(&metadata), ())
            })
        })
        .await;
        match outcome {
            Ok(_) => Ok(()),
            Err(RmwError::Rejected(err)) => Err(err),
            Err(RmwError::Store(err)) => Err(err.into()),
            Err(RmwError::Contended { key, .. }) => Err(ControlError::Contended(key)),
        }
    }

    /// Shutdown: asks for every sandbox held here to be checkpointed (or
    /// deleted, if it cannot be), forcing checkpoints past running executions,
    /// and waits until none is held or `grace` has passed. Returns how many
    /// were still held at the end.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.reconciler.start_draining();
        let deadline = tokio::time::Instant::now() + grace;
        for sandbox in self.held_sandboxes() {
            let desired = match self.read(&sandbox).await {
                Ok(Some(metadata)) if metadata.spec.enable_checkpoint => DesiredState::Checkpointed,
                _ => DesiredState::Deleted,
            };
            // A client waits for it on another instance: hand it over (the
            // drain forces the checkpoint) rather than overwrite that
            // attach's `running` with `checkpointed`, which would leave it
            // waiting for a start that never comes.
            if desired == DesiredState::Checkpointed && self.wanted_elsewhere(&sandbox).await {
                self.enqueue(&sandbox);
                continue;
            }
            if let Err(err) = self.request_state(&sandbox, desired, None).await {
                tracing::warn!(%sandbox, %err, "cannot ask for the sandbox to stop at shutdown");
            }
        }
        loop {
            let left = self.held_sandboxes().len();
            if left == 0 || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// True when another instance's live attach intent names `sandbox`.
    async fn wanted_elsewhere(&self, sandbox: &SandboxId) -> bool {
        let leases = self.reconciler.leases();
        match leases.read(sandbox).await {
            Ok(Some((lease, _))) => lease
                .live_intent(self.reconciler.clock().now())
                .is_some_and(|intent| &intent.instance != leases.instance()),
            _ => false,
        }
    }

    /// Starts an execution in a sandbox held here.
    pub async fn exec(
        &self,
        sandbox: &SandboxId,
        request: ExecRequest,
    ) -> Result<Execution, ControlError> {
        if !self.is_held_here(sandbox) {
            return Err(ControlError::NotHere(sandbox.clone()));
        }
        // A periodic checkpoint is taken in place and lasts about a second:
        // an execution asked for meanwhile waits for it rather than fail. If
        // the checkpoint moved the sandbox away, the wait ends with the hold.
        let give_up = tokio::time::Instant::now() + CHECKPOINT_WAIT;
        let execution = loop {
            match self
                .reconciler
                .runtime()
                .exec(sandbox, request.clone())
                .await
            {
                // Between a periodic checkpoint and its restore the runtime
                // has no sandbox while the hold stays: wait that out too.
                Err(RuntimeError::Checkpointing(_) | RuntimeError::NotFound(_))
                    if self.is_held_here(sandbox) && tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(FENCE_EXIT_POLL).await;
                }
                other => break other?,
            }
        };
        let hooks = self.reconciler.hooks();
        let execution = if hooks.wants_after_exec(sandbox) {
            crate::hooks::run_after_exec(execution, Arc::clone(hooks), sandbox.clone())
        } else {
            execution
        };
        Ok(fence_exit(
            execution,
            Arc::clone(&self.reconciler),
            sandbox.clone(),
        ))
    }

    /// The execution a restore here brought back with the sandbox (created
    /// with `keep_executions`), once, wrapped like one [`Self::exec`] started.
    pub fn take_resumed(&self, sandbox: &SandboxId) -> Option<Execution> {
        let execution = self.reconciler.runtime().take_resumed(sandbox)?;
        let hooks = self.reconciler.hooks();
        let execution = if hooks.wants_after_exec(sandbox) {
            crate::hooks::run_after_exec(execution, Arc::clone(hooks), sandbox.clone())
        } else {
            execution
        };
        Some(fence_exit(
            execution,
            Arc::clone(&self.reconciler),
            sandbox.clone(),
        ))
    }

    /// Saves the sandbox's changed files as snapshot `name` and records it in
    /// `status.latest_snapshot`.
    pub async fn snapshot_filesystem(
        &self,
        sandbox: &SandboxId,
        name: &str,
    ) -> Result<SnapshotRef, ControlError> {
        let held = self
            .reconciler
            .held(sandbox)
            .ok_or_else(|| ControlError::NotHere(sandbox.clone()))?;
        let manifest = self
            .reconciler
            .runtime()
            .snapshot_filesystem(sandbox, name)
            .await?;
        let reference = SnapshotRef {
            name: manifest.name.clone(),
            bucket: self.reconciler.snapshot_bucket().to_owned(),
            path: manifest.archive.key.clone(),
            sha256: manifest.archive.sha256.clone(),
            size: manifest.archive.size,
            created_at: manifest.created_at,
            extra: crate::api::ExtraFields::new(),
        };
        let recorded = reference.clone();
        let written =
            crate::fencing::fenced_update::<SandboxMetadata, std::convert::Infallible, _>(
                self.reconciler.metadata_store().as_ref(),
                &metadata_key(sandbox),
                held.epoch,
                |metadata| {
                    metadata.status.latest_snapshot = Some(recorded.clone());
                    Ok(())
                },
            )
            .await;
        if let Err(err) = written {
            // The snapshot exists; only its mention in the metadata is missing.
            tracing::warn!(%sandbox, %err, "cannot record the snapshot in metadata.json");
        }
        Ok(reference)
    }
}

/// Exponential back-off with jitter: 0.5 s, 1 s, 2 s … up to 30 s.
/// How long an execution waits for a checkpoint in progress to end.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(30);

/// How often an exit held back by [`fence_exit`] looks at the hold again.
const FENCE_EXIT_POLL: Duration = Duration::from_millis(50);

/// Relays an execution's events, but reports its exit only while this
/// instance can vouch for its hold. A holder frozen past its lease (the runsc
/// sandbox kept running) may find, when it resumes, an execution that ended
/// meanwhile, while another instance already took the sandbox over and
/// acknowledged executions of its own: reporting that exit would acknowledge
/// work on two instances at once. The exit is held back until the hold is
/// vouched for again (re-verified) and then reported, or until the sandbox
/// is no longer held here (lost: the events end without an exit, and the
/// session reports the loss), at most two leases.
fn fence_exit(
    mut execution: Execution,
    reconciler: Arc<Reconciler>,
    sandbox: SandboxId,
) -> Execution {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(event) = execution.events.recv().await {
            if let crate::runtime::ExecEvent::Exited(_) = event {
                let give_up = tokio::time::Instant::now()
                    + (reconciler.leases().config().duration * 2)
                        .to_std()
                        .unwrap_or(Duration::from_secs(60));
                loop {
                    match reconciler.held(&sandbox) {
                        Some(held) if reconciler.leases().is_safe(&held) => {
                            let _ = tx.send(event).await;
                            break;
                        }
                        Some(_) if tokio::time::Instant::now() < give_up => {
                            tokio::time::sleep(FENCE_EXIT_POLL).await;
                        }
                        _ => {
                            tracing::warn!(%sandbox, "an execution ended while this instance could not vouch for its hold: its exit is not reported");
                            break;
                        }
                    }
                }
                return;
            }
            if tx.send(event).await.is_err() {
                // Nobody listens; keep draining so the runtime never blocks.
                while execution.events.recv().await.is_some() {}
                return;
            }
        }
    });
    Execution {
        events: rx,
        control: execution.control,
    }
}

fn backoff(failures: u32) -> Duration {
    let base = Duration::from_millis(500)
        .saturating_mul(1 << failures.saturating_sub(1).min(6))
        .min(MAX_BACKOFF);
    let jitter = rand::rng().random_range(0.8..1.2);
    base.mul_f64(jitter)
}
