//! One reconcile pass for one sandbox here: read desired state (`metadata.json` spec, the lease's
//! `wanted_by`, a rung intent) and observed state (lease, local runtime), perform the step the
//! decision table picks, say when to look again (`docs/principles.md`). A pass first serves
//! callers' `commands` (create, attach, desired state, ring), the only writes not made by a step; a
//! create or attach may take the hold itself (the pass adopts it). A step may write several times
//! (a handover: checkpoint, upload, one fenced transfer); bookkeeping records run in tasks off the
//! queue (decision 21).
//!
//! A pass is light or full (`pass`: `super::decision` picks the step, [`Reconciler`] performs it).
//! Steps live in `hold`, `checkpoint`, `start` and `fork`, settings in `config`, local-only state
//! in `local`; steps publish what happened as domain events (`super::events`).

use chrono::{DateTime, Utc};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;

use crate::api::{
    ApiObject, CheckpointManifest, CheckpointRef, DesiredState, ExtraFields, Lease, Phase,
    ReadyReason, SandboxId, SandboxMetadata, SandboxStatus, decode,
};
use crate::clock::Clock;
use crate::fencing::{FenceError, fenced_update_from};
use crate::hooks::{ColdStart, HookBinding, LifecycleHooks, NoHooks};
use crate::layout::{
    checkpoint_id_of_image, checkpoint_image_key, checkpoint_manifest_key, handoff_checkpoint_id,
    lock_key, metadata_key,
};
use crate::leasing::{HeldLease, LeaseError, Leases, ReadLease, Recorded};
use crate::runtime::{CheckpointRequest, CreateOptions, RuntimeError, SandboxRuntime};
use crate::store::{Generation, ObjectKey, Store, StoreError, Versioned};

use super::decision::{Observed, Step, decide};

mod checkpoint;
mod commands;
mod config;
mod fork;
mod hold;
mod local;
mod pass;
mod slots;
mod start;

pub use checkpoint::{delete_checkpoint_objects, record_carried};
pub use commands::AttachRead;
pub(crate) use commands::Command;
#[cfg(test)]
pub(crate) use commands::Ended;
pub use config::{HandoffPolicy, ReconcilerConfig};
pub use fork::{ForkError, ForkPoint};
use local::Watch;
pub use slots::ReadMetadata;
pub(super) use slots::Slots;
pub(crate) use start::create_options;

use super::events::{CheckpointFailure, LossCause, SandboxEvent, StartFailure, StartKind};

/// How soon a tombstone waiting for a live holder is tried again.
const TOMBSTONE_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeue {
    /// Only when something happens (an intent, an operator's edit noticed).
    Never,
    After(Duration),
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// A refused fenced `metadata.json` write: `Fenced` (a newer holder wrote:
    /// stop acting on it) or `Contended` (else `Store`, `Invalid`, as for reads).
    #[error(transparent)]
    Fence(FenceError<Infallible>),
    #[error("{key} is not a valid document: {detail}")]
    Invalid { key: String, detail: String },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The bucket could not be reached (the table's `Retry`).
    #[error("the bucket cannot be reached: {0}")]
    Unreachable(String),
    #[error("internal error: the decision table chose a step without {0}")]
    Internal(&'static str),
    /// A step run in a task of its own ended abnormally (a panic).
    #[error("{0}")]
    Interrupted(String),
}

impl ReconcileError {
    /// A newer holder wrote: the writer lost the sandbox.
    pub fn is_fenced(&self) -> bool {
        matches!(self, Self::Fence(FenceError::Fenced { .. }))
    }
}

impl From<FenceError<Infallible>> for ReconcileError {
    fn from(err: FenceError<Infallible>) -> Self {
        match err {
            FenceError::Store(err) => Self::Store(err),
            FenceError::Invalid { key, source } => Self::Invalid {
                key,
                detail: source.to_string(),
            },
            refused => Self::Fence(refused),
        }
    }
}

/// Decodes the document read at `key`; one that does not is `Invalid`, named
/// by its key: an operator's edit to fix in that object, not a store failure.
fn decode_at<T: ApiObject>(key: &ObjectKey, data: &[u8]) -> Result<T, ReconcileError> {
    decode(data).map_err(|err| ReconcileError::Invalid {
        key: key.to_string(),
        detail: err.to_string(),
    })
}

fn chrono_duration(duration: Duration) -> chrono::Duration {
    chrono::Duration::from_std(duration).unwrap_or(chrono::Duration::MAX)
}

/// The reconciler of one instance, with the leases it holds.
#[derive(Debug)]
pub struct Reconciler {
    metadata: Arc<dyn Store>,
    checkpoints: Arc<dyn Store>,
    checkpoint_bucket: String,
    snapshot_bucket: String,
    runtime: Arc<dyn SandboxRuntime>,
    leases: Leases,
    clock: Arc<dyn Clock>,
    config: ReconcilerConfig,
    /// Per-sandbox local state (`slots.rs`): hold, watch, waiters, start, intents.
    slots: Slots,
    /// Last hold or start here: the instance lease is renewed a lease past it.
    last_busy: Mutex<Option<DateTime<Utc>>>,
    /// Weak self, set once shared (by the controller): steps outliving a pass.
    shared: std::sync::OnceLock<std::sync::Weak<Reconciler>>,
    /// Those tasks still at work, so a drain (and a test) can wait for them.
    background: Arc<tokio::sync::watch::Sender<usize>>,
    /// Controller's queue: wakes a taker when its image lands (`await_handover`).
    wake: std::sync::OnceLock<super::workqueue::WorkQueue>,
    metrics: Arc<super::metrics::Metrics>,
    /// Shutting down: checkpoints kill running executions instead of waiting.
    draining: std::sync::atomic::AtomicBool,
    hooks: Arc<dyn LifecycleHooks>,
}

/// The ports and settings a [`Reconciler`] is built from.
#[derive(Debug, Clone)]
pub struct ReconcilerParts {
    pub metadata: Arc<dyn Store>,
    pub checkpoints: Arc<dyn Store>,
    /// Recorded in `status.latest_checkpoint.bucket`.
    pub checkpoint_bucket: String,
    /// Recorded in `status.latest_snapshot.bucket`.
    pub snapshot_bucket: String,
    pub runtime: Arc<dyn SandboxRuntime>,
    pub leases: Leases,
    pub clock: Arc<dyn Clock>,
    pub config: ReconcilerConfig,
}

impl Reconciler {
    pub fn new(parts: ReconcilerParts) -> Self {
        // One map per sandbox; progress channels and the leases' rung intents too.
        let slots = Slots::default();
        let mut leases = parts.leases;
        leases.keep_rung_in(Arc::new(slots.clone()));
        Self {
            metadata: parts.metadata,
            checkpoints: parts.checkpoints,
            checkpoint_bucket: parts.checkpoint_bucket,
            snapshot_bucket: parts.snapshot_bucket,
            runtime: parts.runtime,
            leases,
            clock: parts.clock,
            config: parts.config,
            slots,
            last_busy: Mutex::new(None),
            shared: std::sync::OnceLock::new(),
            background: Arc::default(),
            wake: std::sync::OnceLock::new(),
            draining: std::sync::atomic::AtomicBool::new(false),
            metrics: Arc::default(),
            hooks: Arc::new(NoHooks),
        }
    }

    /// Runs `hooks` at the sandboxes' lifecycle points (none by default).
    pub fn with_hooks(mut self, hooks: Arc<dyn LifecycleHooks>) -> Self {
        self.hooks = hooks;
        self
    }

    pub fn metrics(&self) -> &super::metrics::Metrics {
        &self.metrics
    }

    /// Checkpoints no longer wait for executions; nothing more starts here (`Step::ShuttingDown`).
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub(super) fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn runtime(&self) -> &Arc<dyn SandboxRuntime> {
        &self.runtime
    }

    pub fn snapshot_bucket(&self) -> &str {
        &self.snapshot_bucket
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    pub fn config(&self) -> &ReconcilerConfig {
        &self.config
    }

    /// Sends `event` to the sandbox's current subscribers (none is fine).
    fn emit(&self, sandbox: &SandboxId, event: SandboxEvent) {
        tracing::debug!(%sandbox, ?event, "sandbox event");
        self.slots.publish(sandbox, event);
    }

    /// Tells whoever waits for `sandbox` that it will not be restored here.
    fn restore_failed(&self, sandbox: &SandboxId, cause: StartFailure) {
        let kind = StartKind::Restore;
        self.emit(sandbox, SandboxEvent::StartFailed { kind, cause });
    }

    /// The reconciler's progress on `sandbox`, from now on.
    pub fn subscribe(&self, sandbox: &SandboxId) -> broadcast::Receiver<SandboxEvent> {
        self.slots.subscribe(sandbox)
    }

    /// Reads `metadata.json` and its generation (remembered for the next update); `None` if it
    /// does not exist.
    pub async fn read_metadata(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<ReadMetadata>, ReconcileError> {
        let key = metadata_key(sandbox);
        match self.metadata.get(&key).await {
            Ok(object) => {
                let metadata: SandboxMetadata = decode_at(&key, &object.data)?;
                self.slots.remember(sandbox, &object);
                Ok(Some((metadata, object.generation)))
            }
            Err(StoreError::NotFound { .. }) => {
                self.slots.update(sandbox, |slot| slot.known = None);
                Ok(None)
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Lets steps outlive a pass in tasks of their own on `this`.
    pub fn share(this: &Arc<Self>) {
        let _ = this.shared.set(Arc::downgrade(this));
    }

    /// Wakes passes on `queue` for events outside one (a handoff's image landing).
    pub(super) fn wake_with(&self, queue: super::workqueue::WorkQueue) {
        let _ = self.wake.set(queue);
    }

    pub(super) fn shared(&self) -> Option<Arc<Self>> {
        self.shared.get().and_then(std::sync::Weak::upgrade)
    }

    /// Runs `step` on the shared reconciler in a task of its own, counted until
    /// it ends. Shared once its controller is made (`SandboxController::new`).
    pub(super) fn spawn_shared<T, F>(
        &self,
        step: impl FnOnce(Arc<Self>) -> F,
    ) -> tokio::task::JoinHandle<Result<T, ReconcileError>>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T, ReconcileError>> + Send + 'static,
    {
        let step = self.shared().map(step);
        self.background.send_modify(|running| *running += 1);
        let running = BackgroundStep(Arc::clone(&self.background));
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let outcome = match step {
                Some(step) => step.await,
                None => Err(ReconcileError::Internal("the reconciler is not shared")),
            };
            drop(running);
            outcome
        }))
    }

    /// Waits until no step runs in a task of its own (a checkpoint's record).
    pub async fn background_settled(&self) {
        let mut running = self.background.subscribe();
        let _ = running.wait_for(|running| *running == 0).await;
    }

    /// Last `metadata.json` read or written here, decoded if `at_least` that new.
    pub(super) fn known_read(
        &self,
        sandbox: &SandboxId,
        at_least: Generation,
    ) -> Option<ReadMetadata> {
        let known = self
            .slots
            .known(sandbox)
            .filter(|known| known.generation >= at_least)?;
        let metadata = crate::api::decode::<SandboxMetadata>(&known.data).ok()?;
        Some((metadata, known.generation))
    }

    /// Remembers `metadata.json` as written here at `generation`.
    pub(super) fn remember_metadata(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        generation: Generation,
    ) {
        let data = crate::api::encode(metadata);
        self.slots
            .remember(sandbox, &Versioned { data, generation });
    }

    /// Records it runs nowhere (fenced by `epoch`): `phase`, `reason`, `error`.
    async fn record_stopped(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        (phase, reason): (Phase, ReadyReason),
        error: Option<&str>,
    ) -> Result<SandboxMetadata, ReconcileError> {
        self.write_status(sandbox, epoch, |status| {
            status.phase = phase;
            status.holder = None;
            if let Some(error) = error {
                status.last_error = Some(error.to_owned());
            }
            status.set_ready(reason, error.unwrap_or_default(), self.clock.now());
        })
        .await
    }

    /// Writes `status` fenced by `epoch`: the one writer of `status` here.
    pub(crate) async fn write_status(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        mut change: impl FnMut(&mut SandboxStatus),
    ) -> Result<SandboxMetadata, ReconcileError> {
        let _turn = self.slots.write_turn(sandbox).await;
        let (written, generation) = fenced_update_from::<SandboxMetadata, Infallible, _>(
            self.metadata.as_ref(),
            &metadata_key(sandbox),
            self.slots.known(sandbox),
            epoch,
            |metadata| {
                change(&mut metadata.status);
                Ok(())
            },
        )
        .await?;
        self.remember_metadata(sandbox, &written, generation);
        Ok(written)
    }
}

/// One step at work in a task of its own, counted until dropped.
struct BackgroundStep(Arc<tokio::sync::watch::Sender<usize>>);

impl Drop for BackgroundStep {
    fn drop(&mut self) {
        self.0
            .send_modify(|running| *running = running.saturating_sub(1));
    }
}
