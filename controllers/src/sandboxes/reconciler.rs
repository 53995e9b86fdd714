//! One reconcile pass for one sandbox on this instance: read desired state
//! (`metadata.json` spec, the lease's `wanted_by`) and observed state (the
//! lease, the local runtime), take ONE step toward desired, record it with a
//! fenced write, and say when to look again (`DESIGN.md` §4).
//!
//! The steps, for sandbox S on this instance I:
//! - I holds S but the lease names another holder or epoch: I lost S; stop it
//!   without writing anything.
//! - `desired_state: deleted`: destroy, tombstone (`phase: Deleted`), release.
//! - `desired_state: checkpointed` and I hold S: checkpoint, record it as
//!   `status.latest_checkpoint`, release.
//! - `desired_state: running`, I hold S: renew the lease when due; if another
//!   instance wants S, hand it over (checkpoint and release).
//! - `desired_state: running`, `wanted_by: I`, lease free: acquire, then
//!   restore the requested or latest checkpoint, or create S if it never ran.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::api::{
    CheckpointManifest, CheckpointRef, ConditionStatus, DesiredState, ExtraFields, Lease, Phase,
    SandboxId, SandboxMetadata, SandboxStatus, decode,
};
use crate::clock::Clock;
use crate::fencing::{FenceError, fenced_update};
use crate::hooks::{ColdStart, LifecycleHooks, NoHooks};
use crate::layout::{
    checkpoint_id_of_image, checkpoint_image_key, checkpoint_manifest_key, lock_key, metadata_key,
};
use crate::leasing::{HeldLease, LeaseError, Leases};
use crate::runtime::{CheckpointRequest, CreateOptions, RuntimeError, SandboxRuntime};
use crate::store::{Store, StoreError};

use super::progress::{Operation, Progress, ProgressBus};

/// What a holder does when another instance asks for a sandbox whose
/// execution is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandoffPolicy {
    /// Kill the execution and move the sandbox at once (the earlier server's
    /// behaviour): the new client gets its sandbox fast, the execution is lost.
    #[default]
    Force,
    /// Let the execution finish first; the attach waits (up to its timeout).
    Wait,
}

/// Timing and policy of the reconciler. The defaults keep an idle held
/// sandbox at about 300 storage operations an hour (one lease write every
/// 15 s, one full read every 2 min) while a freshly detached one, whose client
/// may be reconnecting elsewhere, is watched every half second.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// How often a held sandbox gets a full pass (re-reads metadata: operator
    /// edits take effect within this).
    pub resync_interval: Duration,
    /// How often a held lease is renewed (one conditional write).
    pub renew_interval: Duration,
    /// How often the lock of a held sandbox whose client just left is read,
    /// to notice an attach on another instance quickly.
    pub detached_poll: Duration,
    /// For how long after the client left that fast polling lasts.
    pub detached_window: Duration,
    /// How often an instance waiting for another's lease looks again.
    pub acquire_poll: Duration,
    /// How soon a checkpoint refused for a running execution is tried again.
    pub checkpoint_retry: Duration,
    pub handoff: HandoffPolicy,
    /// Superseded unnamed checkpoints kept per sandbox besides the latest;
    /// older ones are deleted.
    pub keep_checkpoints: usize,
    /// How long a deleted sandbox's tombstone stays before its objects
    /// (metadata, lock, checkpoints) are removed.
    pub tombstone_retention: Duration,
    /// Fault tests only: abort the process at this step of a handoff
    /// (`handoff:before-checkpoint`, `handoff:after-upload`,
    /// `handoff:after-record`), as a crash there would.
    pub failpoint: Option<String>,
    /// Checkpoint held checkpointable sandboxes this often (between
    /// executions), bounding what a crash of this instance can lose. Each
    /// costs a checkpoint and a restore (about a second of pause).
    pub checkpoint_interval: Option<Duration>,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            resync_interval: Duration::from_secs(120),
            renew_interval: Duration::from_secs(15),
            detached_poll: Duration::from_millis(250),
            detached_window: Duration::from_secs(60),
            acquire_poll: Duration::from_millis(100),
            checkpoint_retry: Duration::from_secs(2),
            handoff: HandoffPolicy::Force,
            keep_checkpoints: 2,
            tombstone_retention: Duration::from_secs(600),
            checkpoint_interval: None,
            failpoint: None,
        }
    }
}

/// Per held sandbox: when its last full pass was, and since when its client
/// is away (`None`: attached, or never told).
#[derive(Debug, Clone, Copy)]
struct Watch {
    last_full_pass: DateTime<Utc>,
    detached_since: Option<DateTime<Utc>>,
    /// Created with `enable_checkpoint` (periodic checkpoints apply).
    checkpointable: bool,
    /// When it was last checkpointed or started here.
    last_checkpoint: DateTime<Utc>,
}

/// When to reconcile the sandbox again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeue {
    /// Only when something happens (an intent, an operator's edit noticed by
    /// the caller).
    Never,
    After(Duration),
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("{0}")]
    Fence(String),
    #[error("{key} is not a valid document: {detail}")]
    Invalid { key: String, detail: String },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl From<FenceError<Infallible>> for ReconcileError {
    fn from(err: FenceError<Infallible>) -> Self {
        match err {
            FenceError::Store(err) => Self::Store(err),
            FenceError::Invalid { key, source } => Self::Invalid {
                key,
                detail: source.to_string(),
            },
            other => Self::Fence(other.to_string()),
        }
    }
}

/// Makes `reference` the latest checkpoint, moving the previous latest into
/// `previous_checkpoints` (newest first, `keep` kept). Returns what fell off.
/// Idempotent: applying it again (a retried write) changes nothing more.
fn record_latest(
    status: &mut SandboxStatus,
    reference: &CheckpointRef,
    keep: usize,
) -> Vec<CheckpointRef> {
    let previous = status.latest_checkpoint.replace(reference.clone());
    if let Some(previous) = previous
        && previous.path != reference.path
    {
        status
            .previous_checkpoints
            .retain(|c| c.path != previous.path);
        status.previous_checkpoints.insert(0, previous);
    }
    if status.previous_checkpoints.len() > keep {
        status.previous_checkpoints.split_off(keep)
    } else {
        Vec::new()
    }
}

/// The superseded checkpoints no named checkpoint still points at.
fn unreferenced(superseded: Vec<CheckpointRef>, status: &SandboxStatus) -> Vec<CheckpointRef> {
    superseded
        .into_iter()
        .filter(|c| !status.named_checkpoints.values().any(|n| n.path == c.path))
        .collect()
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
    bus: ProgressBus,
    config: ReconcilerConfig,
    held: Mutex<HashMap<SandboxId, HeldLease>>,
    watches: Mutex<HashMap<SandboxId, Watch>>,
    /// Sandboxes a client here waits for (an attach intent was written).
    waiting: Mutex<HashSet<SandboxId>>,
    /// Sandboxes this instance is waiting to acquire (LOCK_ACQUIRING was said).
    acquiring: Mutex<HashSet<SandboxId>>,
    /// Sandboxes whose next pass must be a full one (an intent was written).
    full_pass_wanted: Mutex<HashSet<SandboxId>>,
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
    pub bus: ProgressBus,
    pub config: ReconcilerConfig,
}

impl Reconciler {
    pub fn new(parts: ReconcilerParts) -> Self {
        Self {
            metadata: parts.metadata,
            checkpoints: parts.checkpoints,
            checkpoint_bucket: parts.checkpoint_bucket,
            snapshot_bucket: parts.snapshot_bucket,
            runtime: parts.runtime,
            leases: parts.leases,
            clock: parts.clock,
            bus: parts.bus,
            config: parts.config,
            held: Mutex::new(HashMap::new()),
            watches: Mutex::new(HashMap::new()),
            full_pass_wanted: Mutex::new(HashSet::new()),
            acquiring: Mutex::new(HashSet::new()),
            waiting: Mutex::new(HashSet::new()),
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

    pub fn hooks(&self) -> &Arc<dyn LifecycleHooks> {
        &self.hooks
    }

    pub fn metrics(&self) -> &super::metrics::Metrics {
        &self.metrics
    }

    /// From now on checkpoints do not wait for running executions.
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
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

    pub fn metadata_store(&self) -> &Arc<dyn Store> {
        &self.metadata
    }

    /// The lease this instance holds on `sandbox`, if it runs here.
    pub fn held(&self, sandbox: &SandboxId) -> Option<HeldLease> {
        self.held_map().get(sandbox).cloned()
    }

    /// Every sandbox this instance holds.
    pub fn held_sandboxes(&self) -> Vec<SandboxId> {
        self.held_map().keys().cloned().collect()
    }

    fn held_map(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, HeldLease>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn forget(&self, sandbox: &SandboxId) {
        self.held_map().remove(sandbox);
        self.watch_map().remove(sandbox);
        self.hooks.forget(sandbox);
    }

    fn watch_map(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Watch>> {
        self.watches.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next pass of `sandbox` reads everything (an intent was written).
    pub fn want_full_pass(&self, sandbox: &SandboxId) {
        self.full_pass_wanted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.clone());
    }

    fn take_full_pass_wanted(&self, sandbox: &SandboxId) -> bool {
        self.full_pass_wanted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(sandbox)
    }

    /// A client here waits for `sandbox` to start (its intent was written).
    pub fn mark_waiting(&self, sandbox: &SandboxId) {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.clone());
    }

    fn take_waiting(&self, sandbox: &SandboxId) -> bool {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(sandbox)
    }

    /// The API layer's news: a client attached to (or left) a sandbox held here.
    pub fn client_attached(&self, sandbox: &SandboxId, attached: bool) {
        let now = self.clock.now();
        if let Some(watch) = self.watch_map().get_mut(sandbox) {
            watch.detached_since = if attached { None } else { Some(now) };
        }
    }

    fn emit(&self, sandbox: &SandboxId, event: Progress) {
        self.bus.emit(sandbox, event);
    }

    /// Reads `metadata.json`; `None` if it does not exist.
    pub async fn read_metadata(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<SandboxMetadata>, ReconcileError> {
        let key = metadata_key(sandbox);
        match self.metadata.get(&key).await {
            Ok(object) => decode(&object.data)
                .map(Some)
                .map_err(|err| ReconcileError::Invalid {
                    key: key.to_string(),
                    detail: err.to_string(),
                }),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(err) => Err(err.into()),
        }
    }

    /// Sets the `Ready` condition.
    fn ready(&self, status: &mut SandboxStatus, ready: bool, reason: &str, message: &str) {
        let value = if ready {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        status.set_condition("Ready", value, reason, message, self.clock.now());
    }

    /// Writes `status` fields under `epoch`, refusing if a newer holder wrote.
    async fn write_status(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        mut change: impl FnMut(&mut SandboxStatus),
    ) -> Result<SandboxMetadata, ReconcileError> {
        let (written, _) = fenced_update::<SandboxMetadata, Infallible, _>(
            self.metadata.as_ref(),
            &metadata_key(sandbox),
            epoch,
            |metadata| {
                change(&mut metadata.status);
                Ok(())
            },
        )
        .await?;
        Ok(written)
    }

    /// One step toward the desired state of `sandbox`. A held sandbox with
    /// nothing new gets a light pass (lease upkeep, maybe one lock read); a
    /// full pass reads metadata and lock and decides.
    #[tracing::instrument(skip(self), fields(instance = %self.leases.instance()))]
    pub async fn reconcile(&self, sandbox: &SandboxId) -> Result<Requeue, ReconcileError> {
        let full_wanted = self.take_full_pass_wanted(sandbox);
        let watch = self.watch_map().get(sandbox).copied();
        if !full_wanted
            && let Some(held) = self.held(sandbox)
            && let Some(watch) = watch
            && self.clock.now()
                < watch.last_full_pass + chrono_duration(self.config.resync_interval)
            && self.runtime.is_running(sandbox)
            && let Some(requeue) = self.light_pass(sandbox, held, watch).await?
        {
            self.checkpoint_if_due(sandbox).await?;
            return Ok(requeue);
        }
        let outcome = self.full_pass(sandbox).await;
        if let Some(watch) = self.watch_map().get_mut(sandbox) {
            watch.last_full_pass = self.clock.now();
        }
        outcome
    }

    /// Runs a periodic checkpoint when one is due (after a light pass: the
    /// lease is fresh).
    async fn checkpoint_if_due(&self, sandbox: &SandboxId) -> Result<(), ReconcileError> {
        let Some(interval) = self.config.checkpoint_interval else {
            return Ok(());
        };
        let watch = self.watch_map().get(sandbox).copied();
        if let (Some(held), Some(watch)) = (self.held(sandbox), watch)
            && watch.checkpointable
            && self.clock.now() >= watch.last_checkpoint + chrono_duration(interval)
            && self.runtime.is_running(sandbox)
            && self.leases.is_safe(&held)
        {
            self.periodic_checkpoint(sandbox, held).await?;
        }
        Ok(())
    }

    /// Checkpoints a held sandbox in place (checkpoint, record, restore
    /// here, lease kept), so a crash of this instance loses at most one
    /// interval. Skipped while an execution runs. Silent to the client.
    async fn periodic_checkpoint(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<(), ReconcileError> {
        let request = CheckpointRequest {
            checkpoint_id: SandboxId::random(),
            epoch: held.epoch,
            name: None,
            force: false,
        };
        let manifest = match self.runtime.checkpoint(sandbox, request).await {
            Ok(manifest) => manifest,
            Err(RuntimeError::ExecutionInProgress(_)) => return Ok(()),
            Err(err) => {
                tracing::warn!(%sandbox, %err, "periodic checkpoint failed");
                if !self.runtime.is_running(sandbox) {
                    self.stop_lost(sandbox, &format!("a periodic checkpoint failed: {err}"))
                        .await;
                }
                return Ok(());
            }
        };
        let reference = self.checkpoint_ref(&manifest, held.epoch, None);
        let keep = self.config.keep_checkpoints;
        let mut superseded = Vec::new();
        let recorded = self
            .write_status(sandbox, held.epoch, |status| {
                superseded = record_latest(status, &reference, keep);
            })
            .await;
        let restored = self.runtime.restore(sandbox, &manifest).await;
        match (recorded, restored) {
            (Ok(recorded), Ok(())) => {
                self.delete_checkpoints(&unreferenced(superseded, &recorded.status))
                    .await;
                if let Some(watch) = self.watch_map().get_mut(sandbox) {
                    watch.last_checkpoint = self.clock.now();
                }
                tracing::info!(%sandbox, size = manifest.image.size, "periodic checkpoint");
                Ok(())
            }
            (recorded, restored) => {
                let detail = match (&recorded, &restored) {
                    (Err(err), _) => format!("recording it failed: {err}"),
                    (_, Err(err)) => format!("restoring it failed: {err}"),
                    _ => String::new(),
                };
                self.stop_lost(sandbox, &format!("after a periodic checkpoint, {detail}"))
                    .await;
                Ok(())
            }
        }
    }

    /// Lease upkeep for a held sandbox nothing happened to. `None`: something
    /// changed, do a full pass.
    async fn light_pass(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
        watch: Watch,
    ) -> Result<Option<Requeue>, ReconcileError> {
        let now = self.clock.now();
        let watching = watch
            .detached_since
            .is_some_and(|since| now < since + chrono_duration(self.config.detached_window));
        if watching {
            let lease = self.leases.read(sandbox).await?.map(|(lease, _)| lease);
            let ours = lease
                .as_ref()
                .is_some_and(|l| l.is_held_by(self.leases.instance()) && l.epoch == held.epoch);
            let wanted_elsewhere = lease
                .as_ref()
                .and_then(|l| l.live_intent(now))
                .is_some_and(|intent| &intent.instance != self.leases.instance());
            if !ours || wanted_elsewhere {
                return Ok(None);
            }
        }
        let mut renewed_at = held.renewed_at;
        if now >= held.renewed_at + chrono_duration(self.config.renew_interval) {
            match self.leases.renew_unchanged(&held).await {
                Ok(Some(renewed)) => {
                    renewed_at = renewed.renewed_at;
                    self.held_map().insert(sandbox.clone(), renewed);
                }
                // The lock changed: an intent, an operator, a new holder.
                Ok(None) => return Ok(None),
                Err(err) => {
                    if !self.leases.is_safe(&held) {
                        self.stop_lost(sandbox, &format!("the lease could not be renewed: {err}"))
                            .await;
                        return Ok(Some(Requeue::Never));
                    }
                    return Err(err.into());
                }
            }
        }
        let until = |at: DateTime<Utc>| (at - now).to_std().unwrap_or(Duration::ZERO);
        let mut next = until(renewed_at + chrono_duration(self.config.renew_interval)).min(until(
            watch.last_full_pass + chrono_duration(self.config.resync_interval),
        ));
        if watching {
            next = next.min(self.config.detached_poll);
        }
        Ok(Some(Requeue::After(next.max(Duration::from_millis(10)))))
    }

    async fn full_pass(&self, sandbox: &SandboxId) -> Result<Requeue, ReconcileError> {
        let metadata = match self.read_metadata(sandbox).await {
            Ok(Some(metadata)) => metadata,
            Ok(None) => {
                // Deleted from the bucket (garbage collection, an operator):
                // nothing may keep running.
                if self.held(sandbox).is_some() {
                    self.stop_lost(sandbox, "its metadata.json was deleted")
                        .await;
                }
                return Ok(Requeue::Never);
            }
            Err(err) => {
                if let ReconcileError::Invalid { .. } = &err {
                    // An operator's typo: report it to whoever waits, keep
                    // running what runs, and look again later.
                    self.emit(
                        sandbox,
                        Progress::Failed {
                            operation: Operation::Restore,
                            message: err.to_string(),
                        },
                    );
                }
                return Err(err);
            }
        };
        let lease = self.leases.read(sandbox).await?.map(|(lease, _)| lease);
        if let Some(held) = self.held(sandbox) {
            return self.reconcile_held(sandbox, &metadata, lease, held).await;
        }
        match metadata.spec.desired_state {
            DesiredState::Deleted => self.tombstone_unheld(sandbox, &metadata, lease).await,
            DesiredState::Checkpointed => Ok(Requeue::Never),
            DesiredState::Running => self.start_if_wanted(sandbox, &metadata, lease).await,
        }
    }

    async fn reconcile_held(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        lease: Option<Lease>,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        let still_ours = lease
            .as_ref()
            .is_some_and(|l| l.is_held_by(self.leases.instance()) && l.epoch == held.epoch);
        if !still_ours {
            let holder = lease
                .and_then(|l| l.holder.map(|h| h.to_string()))
                .unwrap_or_else(|| "nobody".to_owned());
            self.stop_lost(
                sandbox,
                &format!("the lease was taken over (holder now {holder})"),
            )
            .await;
            return Ok(Requeue::Never);
        }
        if !self.runtime.is_running(sandbox) {
            self.forget(sandbox);
            let _ = self.leases.release(&held).await;
            let message = "the sandbox stopped unexpectedly on this instance".to_owned();
            self.write_status(sandbox, held.epoch, |status| {
                status.phase = Phase::Failed;
                status.holder = None;
                status.last_error = Some(message.clone());
                self.ready(status, false, "Failed", &message);
            })
            .await?;
            self.emit(sandbox, Progress::Lost { message });
            return Ok(Requeue::Never);
        }
        match metadata.spec.desired_state {
            DesiredState::Deleted => self.delete_held(sandbox, metadata, held).await,
            DesiredState::Checkpointed => {
                if !metadata.spec.enable_checkpoint {
                    let message = format!("Sandbox {sandbox} is not configured for checkpointing.");
                    self.write_status(sandbox, held.epoch, |status| {
                        status.last_error = Some(message.clone());
                    })
                    .await?;
                    self.emit(
                        sandbox,
                        Progress::Failed {
                            operation: Operation::Checkpoint,
                            message,
                        },
                    );
                    return self.keep_running(sandbox, held).await;
                }
                self.checkpoint_and_release(sandbox, metadata, held, false)
                    .await
            }
            DesiredState::Running => {
                let now = self.clock.now();
                let wanted_elsewhere = lease
                    .as_ref()
                    .and_then(|l| l.live_intent(now))
                    .is_some_and(|intent| &intent.instance != self.leases.instance());
                if wanted_elsewhere && metadata.spec.enable_checkpoint {
                    self.emit(sandbox, Progress::LockReleaseRequested);
                    let force = self.config.handoff == HandoffPolicy::Force;
                    let started = std::time::Instant::now();
                    let outcome = self
                        .checkpoint_and_release(sandbox, metadata, held, force)
                        .await;
                    if outcome.is_ok() && self.held(sandbox).is_none() {
                        self.metrics.handoff_out_seconds.observe(started.elapsed());
                    }
                    return outcome;
                }
                self.keep_running(sandbox, held).await
            }
        }
    }

    /// Renews the lease when due, and says when to look again.
    async fn keep_running(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        let renew_every = chrono_duration(self.config.renew_interval);
        let now = self.clock.now();
        let next_pass = |renewed_at: DateTime<Utc>| {
            let watching = self
                .watch_map()
                .get(sandbox)
                .and_then(|w| w.detached_since)
                .is_some_and(|since| now < since + chrono_duration(self.config.detached_window));
            let until_renewal = (renewed_at + renew_every - now)
                .to_std()
                .unwrap_or(Duration::ZERO)
                .max(Duration::from_millis(10));
            if watching {
                until_renewal.min(self.config.detached_poll)
            } else {
                until_renewal
            }
        };
        if now < held.renewed_at + renew_every {
            return Ok(Requeue::After(next_pass(held.renewed_at)));
        }
        let renewed = match self.leases.renew_unchanged(&held).await {
            Ok(Some(renewed)) => Ok(renewed),
            Ok(None) => self.leases.renew(&held).await,
            Err(err) => Err(err),
        };
        match renewed {
            Ok(renewed) => {
                let renewed_at = renewed.renewed_at;
                self.held_map().insert(sandbox.clone(), renewed);
                Ok(Requeue::After(next_pass(renewed_at)))
            }
            Err(LeaseError::Lost { .. } | LeaseError::Missing { .. }) => {
                self.stop_lost(sandbox, "the lease was taken over").await;
                Ok(Requeue::Never)
            }
            Err(err) => {
                if !self.leases.is_safe(&held) {
                    // Past the lease we can vouch for: another instance may
                    // start it; two copies must never run.
                    self.stop_lost(sandbox, &format!("the lease could not be renewed: {err}"))
                        .await;
                    return Ok(Requeue::Never);
                }
                Err(err.into())
            }
        }
    }

    /// Stops a sandbox this instance no longer owns, writing nothing.
    async fn stop_lost(&self, sandbox: &SandboxId, why: &str) {
        tracing::warn!(%sandbox, why, "stopping a sandbox this instance lost");
        super::metrics::Metrics::add(&self.metrics.lost, 1);
        self.forget(sandbox);
        if let Err(err) = self.runtime.destroy(sandbox).await
            && !matches!(err, RuntimeError::NotFound(_))
        {
            tracing::error!(%sandbox, %err, "cannot destroy a lost sandbox");
        }
        self.emit(
            sandbox,
            Progress::Lost {
                message: format!("Sandbox {sandbox} stopped on this instance: {why}"),
            },
        );
    }

    async fn delete_held(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        let handoff = metadata.spec.enable_sandbox_handoff;
        let _transition = self.metrics.in_transition(sandbox.as_str(), "deleting");
        self.emit(sandbox, Progress::Deleting);
        super::metrics::Metrics::add(&self.metrics.deletes, 1);
        if self.runtime.is_running(sandbox) {
            self.hooks.on_terminate(sandbox).await;
        }
        match self.runtime.destroy(sandbox).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(err) => {
                self.emit(
                    sandbox,
                    Progress::Failed {
                        operation: Operation::Delete,
                        message: err.to_string(),
                    },
                );
                return Err(err.into());
            }
        }
        self.forget(sandbox);
        self.write_status(sandbox, held.epoch, |status| {
            status.phase = Phase::Deleted;
            status.holder = None;
            self.ready(status, false, "Deleted", "");
        })
        .await?;
        if handoff {
            self.emit(sandbox, Progress::LockReleasing);
        }
        self.leases.release(&held).await?;
        if handoff {
            self.emit(sandbox, Progress::LockReleased);
        }
        self.emit(sandbox, Progress::Deleted);
        Ok(Requeue::After(self.config.tombstone_retention))
    }

    /// `desired_state: deleted` on a sandbox nobody runs: write the tombstone
    /// under a lease of our own so no holder is overwritten.
    async fn tombstone_unheld(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        lease: Option<Lease>,
    ) -> Result<Requeue, ReconcileError> {
        if metadata.status.phase == Phase::Deleted {
            self.emit(sandbox, Progress::Deleted);
            return self.purge_if_due(sandbox, metadata).await;
        }
        let now = self.clock.now();
        if let Some(lease) = &lease
            && !lease.is_free(now, self.leases.config().skew_tolerance)
        {
            // Its holder converges it; check again once the lease could expire.
            return Ok(Requeue::After(self.config.resync_interval));
        }
        let held = match self.leases.acquire(sandbox).await {
            Ok(held) => held,
            Err(LeaseError::HeldByOther { .. } | LeaseError::WantedByOther { .. }) => {
                return Ok(Requeue::After(self.config.acquire_poll));
            }
            Err(err) => return Err(err.into()),
        };
        self.emit(sandbox, Progress::Deleting);
        self.write_status(sandbox, held.epoch, |status| {
            status.phase = Phase::Deleted;
            status.holder = None;
            self.ready(status, false, "Deleted", "");
        })
        .await?;
        self.leases.release(&held).await?;
        self.emit(sandbox, Progress::Deleted);
        Ok(Requeue::After(self.config.tombstone_retention))
    }

    /// Fault tests: dies here if told to (a handoff only, not a client's
    /// checkpoint).
    fn failpoint(&self, metadata: &SandboxMetadata, step: &str) {
        if metadata.spec.desired_state == DesiredState::Running
            && self.config.failpoint.as_deref() == Some(step)
        {
            tracing::error!(step, "failpoint reached: aborting the process");
            std::process::abort();
        }
    }

    /// Checkpoints a held sandbox, records the checkpoint, and releases it.
    async fn checkpoint_and_release(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        mut held: HeldLease,
        force: bool,
    ) -> Result<Requeue, ReconcileError> {
        let handoff = metadata.spec.enable_sandbox_handoff;
        let _transition = self
            .metrics
            .in_transition(sandbox.as_str(), "checkpointing");
        if !self.leases.is_safe(&held) {
            held = self.leases.renew(&held).await?;
            self.held_map().insert(sandbox.clone(), held.clone());
        }
        self.emit(sandbox, Progress::Checkpointing);
        let name = match metadata.spec.desired_state {
            DesiredState::Checkpointed => metadata.spec.checkpoint_name.clone(),
            _ => None,
        };
        let request = CheckpointRequest {
            checkpoint_id: SandboxId::random(),
            epoch: held.epoch,
            name: name.clone(),
            force: force || self.draining.load(std::sync::atomic::Ordering::Acquire),
        };
        self.failpoint(metadata, "handoff:before-checkpoint");
        let checkpoint_started = std::time::Instant::now();
        let manifest = match self.runtime.checkpoint(sandbox, request).await {
            Ok(manifest) => {
                self.failpoint(metadata, "handoff:after-upload");
                self.metrics
                    .checkpoint_seconds
                    .observe(checkpoint_started.elapsed());
                super::metrics::Metrics::add(&self.metrics.checkpoint_bytes, manifest.image.size);
                manifest
            }
            Err(RuntimeError::ExecutionInProgress(_)) => {
                self.emit(sandbox, Progress::ExecutionInProgress);
                // Not a steady state: the retry must decide again in full.
                self.want_full_pass(sandbox);
                return Ok(Requeue::After(self.config.checkpoint_retry));
            }
            Err(RuntimeError::Lost { detail, .. }) => {
                self.forget(sandbox);
                self.emit(sandbox, Progress::Deleting);
                let message = format!("Failed to checkpoint sandbox {sandbox}: {detail}");
                self.write_status(sandbox, held.epoch, |status| {
                    status.phase = Phase::Failed;
                    status.holder = None;
                    status.last_error = Some(message.clone());
                    self.ready(status, false, "Failed", &message);
                })
                .await?;
                let _ = self.leases.release(&held).await;
                self.emit(sandbox, Progress::Deleted);
                self.emit(
                    sandbox,
                    Progress::Failed {
                        operation: Operation::Checkpoint,
                        message,
                    },
                );
                return Ok(Requeue::Never);
            }
            Err(err) => {
                let message = format!("Failed to checkpoint sandbox {sandbox}: {err}");
                self.write_status(sandbox, held.epoch, |status| {
                    status.last_error = Some(message.clone());
                })
                .await?;
                self.emit(
                    sandbox,
                    Progress::Failed {
                        operation: Operation::Checkpoint,
                        message,
                    },
                );
                return Err(err.into());
            }
        };
        // The runtime removed the local sandbox with the checkpoint.
        self.forget(sandbox);
        self.emit(sandbox, Progress::Deleting);
        let reference = self.checkpoint_ref(&manifest, held.epoch, name.clone());
        let keep = self.config.keep_checkpoints;
        let mut superseded = Vec::new();
        let recorded = self
            .write_status(sandbox, held.epoch, |status| {
                superseded = record_latest(status, &reference, keep);
                if let Some(name) = &name {
                    status
                        .named_checkpoints
                        .insert(name.clone(), reference.clone());
                }
                status.phase = Phase::Checkpointed;
                status.holder = None;
                status.last_error = None;
                self.ready(status, false, "Checkpointed", "");
            })
            .await?;
        self.delete_checkpoints(&unreferenced(superseded, &recorded.status))
            .await;
        self.failpoint(metadata, "handoff:after-record");
        if handoff {
            self.emit(sandbox, Progress::LockReleasing);
        }
        if let Err(err) = self.leases.release(&held).await {
            // The checkpoint is recorded; an unreleased lease only delays the
            // next holder until it expires.
            tracing::warn!(%sandbox, %err, "cannot release the lease after a checkpoint");
        }
        if handoff {
            self.emit(sandbox, Progress::LockReleased);
        }
        self.emit(sandbox, Progress::Deleted);
        self.emit(
            sandbox,
            Progress::Checkpointed {
                image: manifest.image.key,
            },
        );
        Ok(Requeue::Never)
    }

    /// `desired_state: running` and not here: start it if this instance wants it.
    async fn start_if_wanted(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        lease: Option<Lease>,
    ) -> Result<Requeue, ReconcileError> {
        let now = self.clock.now();
        let wanted_here = lease
            .as_ref()
            .and_then(|l| l.live_intent(now))
            .is_some_and(|intent| &intent.instance == self.leases.instance());
        if !wanted_here {
            // Someone here waits for it, but the intent is gone (another
            // instance's attach replaced it, or it expired): tell them now
            // rather than let them wait for a start that will not come.
            if self.take_waiting(sandbox) {
                let message = match lease.as_ref().and_then(|l| l.live_intent(now)) {
                    Some(intent) => format!(
                        "instance {} asked for the sandbox meanwhile",
                        intent.instance
                    ),
                    None => {
                        "the attach request expired before the sandbox could be started".to_owned()
                    }
                };
                self.emit(
                    sandbox,
                    Progress::Failed {
                        operation: Operation::Restore,
                        message,
                    },
                );
            }
            return Ok(Requeue::Never);
        }
        let handoff = metadata.spec.enable_sandbox_handoff;
        let first_try = self
            .acquiring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.clone());
        if handoff && first_try {
            self.emit(sandbox, Progress::LockAcquiring);
        }
        let acquired = self.leases.acquire(sandbox).await;
        if !matches!(acquired, Err(LeaseError::HeldByOther { .. })) {
            self.acquiring
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(sandbox);
        }
        let held = match acquired {
            Ok(held) => held,
            Err(LeaseError::HeldByOther { .. }) => {
                // The holder hands it over (or its lease expires): look again soon.
                return Ok(Requeue::After(self.config.acquire_poll));
            }
            Err(LeaseError::WantedByOther { instance, .. }) => {
                self.emit(
                    sandbox,
                    Progress::Failed {
                        operation: Operation::Restore,
                        message: format!("instance {instance} asked for the sandbox meanwhile"),
                    },
                );
                return Ok(Requeue::Never);
            }
            Err(err) => return Err(err.into()),
        };
        if handoff {
            self.emit(sandbox, Progress::LockAcquired);
        }
        self.take_waiting(sandbox);
        let started = std::time::Instant::now();
        let outcome = self.start(sandbox, metadata, &held).await;
        match &outcome {
            Ok(operation) => {
                match operation {
                    Operation::Create => super::metrics::Metrics::add(&self.metrics.creates, 1),
                    _ => self.metrics.restore_seconds.observe(started.elapsed()),
                }
                if *operation == Operation::Restore
                    && let Some(intent) = lease.as_ref().and_then(|l| l.wanted_by.as_ref())
                {
                    let waited = (self.clock.now() - intent.requested_at)
                        .to_std()
                        .unwrap_or_default();
                    self.metrics.handoff_in_seconds.observe(waited);
                }
            }
            Err(_) => super::metrics::Metrics::add(&self.metrics.failures, 1),
        }
        match outcome.map(|_| ()) {
            Ok(()) => {
                self.held_map().insert(sandbox.clone(), held.clone());
                self.watch_map().insert(
                    sandbox.clone(),
                    Watch {
                        last_full_pass: self.clock.now(),
                        detached_since: None,
                        checkpointable: metadata.spec.enable_checkpoint,
                        last_checkpoint: self.clock.now(),
                    },
                );
                self.emit(sandbox, Progress::Running { epoch: held.epoch });
                Ok(Requeue::After(self.config.renew_interval))
            }
            Err((operation, message)) => {
                tracing::warn!(%sandbox, ?operation, %message, "cannot start the sandbox");
                let _ = self.runtime.destroy(sandbox).await;
                let previous_phase = metadata.status.phase;
                let recorded = self
                    .write_status(sandbox, held.epoch, |status| {
                        // A failed restore leaves the checkpoint as it was:
                        // the next attach may try again.
                        status.phase = match operation {
                            Operation::Create => Phase::Failed,
                            _ => previous_phase,
                        };
                        let reason = match operation {
                            Operation::Create => "Failed",
                            _ => "RestoreFailed",
                        };
                        self.ready(status, false, reason, &message);
                        status.holder = None;
                        status.last_error = Some(message.clone());
                    })
                    .await;
                let _ = self.leases.release(&held).await;
                let _ = self.leases.withdraw_attach(sandbox).await;
                self.emit(sandbox, Progress::Failed { operation, message });
                recorded.map(|_| Requeue::Never)
            }
        }
    }

    /// Creates or restores the sandbox under a freshly acquired lease and
    /// records it as running here.
    async fn start(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: &HeldLease,
    ) -> Result<Operation, (Operation, String)> {
        let restore_request = metadata
            .spec
            .restore_request
            .as_ref()
            .filter(|r| metadata.status.last_restore_request != Some(r.requested_at));
        let source = match restore_request {
            Some(request) => match metadata.status.named_checkpoints.get(&request.checkpoint) {
                Some(found) => Some(found.clone()),
                None => {
                    return Err((
                        Operation::Restore,
                        format!(
                            "Failed to restore sandbox {sandbox}: no checkpoint named {:?}",
                            request.checkpoint
                        ),
                    ));
                }
            },
            None => metadata.status.latest_checkpoint.clone(),
        };
        let instance = self.leases.instance().clone();
        let served_request = restore_request.map(|r| r.requested_at);
        let operation = match (&source, metadata.status.phase) {
            (Some(_), _) => Operation::Restore,
            (None, Phase::Pending | Phase::Creating) => Operation::Create,
            (None, _) => {
                return Err((
                    Operation::Restore,
                    format!(
                        "Failed to restore sandbox {sandbox}: it has no checkpoint to restore \
                         (its instance stopped while it ran)"
                    ),
                ));
            }
        };
        let fail = |err: String| {
            let verb = match operation {
                Operation::Create => "Failed to create gVisor container",
                _ => "Failed to restore sandbox",
            };
            (operation, format!("{verb} {sandbox}: {err}"))
        };
        let phase = match operation {
            Operation::Create => Phase::Creating,
            _ => Phase::Restoring,
        };
        let _transition = self.metrics.in_transition(
            sandbox.as_str(),
            if operation == Operation::Create {
                "creating"
            } else {
                "restoring"
            },
        );
        self.write_status(sandbox, held.epoch, |status| {
            status.phase = phase;
            status.holder = Some(instance.clone());
        })
        .await
        .map_err(|err| fail(err.to_string()))?;
        match &source {
            Some(reference) => {
                self.emit(sandbox, Progress::Restoring);
                let manifest = self
                    .load_manifest(reference)
                    .await
                    .map_err(|err| fail(err.to_string()))?;
                self.runtime
                    .restore(sandbox, &manifest)
                    .await
                    .map_err(|err| fail(err.to_string()))?;
            }
            None => {
                let options = CreateOptions {
                    snapshot_name: metadata.spec.filesystem_snapshot_name.clone(),
                    network: metadata.spec.network,
                    image: metadata.spec.image.clone(),
                };
                self.runtime
                    .create(sandbox, &options)
                    .await
                    .map_err(|err| fail(err.to_string()))?;
            }
        }
        let start = match operation {
            Operation::Create => ColdStart::Created,
            _ => ColdStart::Restored,
        };
        if let Err(err) = self
            .hooks
            .on_cold_start(sandbox, &metadata.spec, start)
            .await
        {
            self.hooks.forget(sandbox);
            if let Err(destroy) = self.runtime.destroy(sandbox).await {
                tracing::warn!(%sandbox, %destroy, "cannot destroy a sandbox whose cold start hook failed");
            }
            return Err(fail(format!("the cold start hook failed: {err}")));
        }
        self.write_status(sandbox, held.epoch, |status| {
            status.phase = Phase::Running;
            status.holder = Some(instance.clone());
            status.last_error = None;
            self.ready(status, true, "Running", "");
            if served_request.is_some() {
                status.last_restore_request = served_request;
            }
        })
        .await
        .map_err(|err| fail(err.to_string()))?;
        Ok(operation)
    }

    /// The record of a checkpoint the runtime just took.
    fn checkpoint_ref(
        &self,
        manifest: &CheckpointManifest,
        epoch: u64,
        name: Option<String>,
    ) -> CheckpointRef {
        CheckpointRef {
            bucket: self.checkpoint_bucket.clone(),
            path: manifest.image.key.clone(),
            epoch,
            sha256: manifest.image.sha256.clone(),
            size: manifest.image.size,
            created_at: manifest.created_at,
            name,
            extra: ExtraFields::new(),
        }
    }

    /// Deletes checkpoint images and manifests nothing points at any more.
    /// Failures only leave garbage behind; they are logged.
    async fn delete_checkpoints(&self, checkpoints: &[CheckpointRef]) {
        for checkpoint in checkpoints {
            let Some(id) = checkpoint_id_of_image(&checkpoint.path) else {
                continue;
            };
            for key in [checkpoint_image_key(&id), checkpoint_manifest_key(&id)] {
                match self.checkpoints.delete(&key).await {
                    Ok(()) | Err(StoreError::NotFound { .. }) => {}
                    Err(err) => tracing::warn!(%key, %err, "cannot delete a superseded checkpoint"),
                }
            }
        }
    }

    /// Removes a tombstoned sandbox's objects once its retention has passed.
    async fn purge_if_due(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
    ) -> Result<Requeue, ReconcileError> {
        let retention = chrono_duration(self.config.tombstone_retention);
        let deleted_at = metadata
            .status
            .condition("Ready")
            .filter(|c| c.reason == "Deleted")
            .map_or(metadata.created_at, |c| c.last_transition_time);
        let now = self.clock.now();
        if now < deleted_at + retention {
            return Ok(Requeue::After(
                (deleted_at + retention - now)
                    .to_std()
                    .unwrap_or(Duration::ZERO),
            ));
        }
        let status = &metadata.status;
        let mut checkpoints: Vec<CheckpointRef> = status.previous_checkpoints.clone();
        checkpoints.extend(status.latest_checkpoint.clone());
        checkpoints.extend(status.named_checkpoints.values().cloned());
        self.delete_checkpoints(&checkpoints).await;
        for key in [lock_key(sandbox), metadata_key(sandbox)] {
            match self.metadata.delete(&key).await {
                Ok(()) | Err(StoreError::NotFound { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        tracing::info!(%sandbox, "purged a deleted sandbox's objects");
        Ok(Requeue::Never)
    }

    /// Reads the manifest of a recorded checkpoint and checks it describes
    /// the same image (an operator may have edited the reference).
    async fn load_manifest(
        &self,
        reference: &CheckpointRef,
    ) -> Result<CheckpointManifest, ReconcileError> {
        let invalid = |detail: String| ReconcileError::Invalid {
            key: "status.latest_checkpoint".to_owned(),
            detail,
        };
        let checkpoint_id = checkpoint_id_of_image(&reference.path).ok_or_else(|| {
            invalid(format!(
                "path {:?} is not a checkpoint image key",
                reference.path
            ))
        })?;
        let key = checkpoint_manifest_key(&checkpoint_id);
        let object = self.checkpoints.get(&key).await?;
        let manifest: CheckpointManifest =
            decode(&object.data).map_err(|err| ReconcileError::Invalid {
                key: key.to_string(),
                detail: err.to_string(),
            })?;
        if manifest.image.key != reference.path
            || manifest.image.sha256 != reference.sha256
            || manifest.image.size != reference.size
        {
            return Err(invalid(format!(
                "{key} describes a different image than the recorded checkpoint"
            )));
        }
        Ok(manifest)
    }
}
