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

use super::decision::{Observed, Step, decide};
use super::progress::{Operation, Progress, ProgressBus};

/// How often an instance waiting for a sandbox rings its holder again.
const RERING_INTERVAL: Duration = Duration::from_secs(5);

/// How soon a tombstone waiting for a live holder is tried again.
const TOMBSTONE_RETRY: Duration = Duration::from_secs(1);

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

/// Timing and policy of the reconciler. The defaults (priced in
/// `docs/decisions/0007-instance-leases-and-doorbells.md`) keep an idle held
/// sandbox at two reads a minute (its resync) and no writes: its hold lives
/// on the instance lease, renewed once for every sandbox of the instance, and
/// the instance learns of intents from its doorbell, read twice a second.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// How often a held sandbox gets a full pass (re-reads metadata and lock:
    /// operators' raw edits take effect within this, rings or not).
    pub resync_interval: Duration,
    /// How often the instance lease is renewed while the instance holds
    /// sandboxes (one write for all of them).
    pub renew_interval: Duration,
    /// How often the instance reads its doorbell while it holds sandboxes.
    pub doorbell_poll: Duration,
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
            resync_interval: Duration::from_secs(60),
            renew_interval: Duration::from_millis(7_500),
            doorbell_poll: Duration::from_millis(500),
            detached_poll: Duration::from_millis(250),
            detached_window: Duration::from_secs(60),
            acquire_poll: Duration::from_millis(25),
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
    #[error("internal error: the decision table chose a step without {0}")]
    Internal(&'static str),
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

/// Marks a sandbox as being started by a pass until dropped.
struct StartingGuard<'a> {
    set: &'a Mutex<HashSet<SandboxId>>,
    sandbox: SandboxId,
}

impl<'a> StartingGuard<'a> {
    fn new(set: &'a Mutex<HashSet<SandboxId>>, sandbox: &SandboxId) -> Self {
        set.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.clone());
        Self {
            set,
            sandbox: sandbox.clone(),
        }
    }
}

impl Drop for StartingGuard<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.sandbox);
    }
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
    /// Sandboxes being acquired and started by a pass right now: their lock
    /// may name this instance before they are held.
    starting: Mutex<HashSet<SandboxId>>,
    /// When this instance last rang the holder of a sandbox it waits for.
    rung: Mutex<HashMap<SandboxId, DateTime<Utc>>>,
    /// When this instance last held or started anything: its instance lease
    /// is renewed until a lease after that.
    last_busy: Mutex<Option<DateTime<Utc>>>,
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
            starting: Mutex::new(HashSet::new()),
            rung: Mutex::new(HashMap::new()),
            last_busy: Mutex::new(None),
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

    pub fn config(&self) -> &ReconcilerConfig {
        &self.config
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

    fn starting_set(&self) -> std::sync::MutexGuard<'_, HashSet<SandboxId>> {
        self.starting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// True while this instance's lease must be kept: it holds or starts a
    /// sandbox, or did within the last lease duration (a release in flight,
    /// a lock still naming it).
    pub fn needs_instance_lease(&self) -> bool {
        let now = self.clock.now();
        let busy = !self.held_map().is_empty() || !self.starting_set().is_empty();
        let mut last = self
            .last_busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if busy {
            *last = Some(now);
            return true;
        }
        last.is_some_and(|at| now < at + self.leases.config().duration)
    }

    /// Held sandboxes whose hold the instance lease does not vouch for (its
    /// renewal lapsed): each must be re-verified or stopped.
    pub fn unvouched(&self) -> Vec<SandboxId> {
        self.held_map()
            .iter()
            .filter(|(_, held)| !self.leases.instance_lease().vouches_for(held.era))
            .map(|(id, _)| id.clone())
            .collect()
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
        if matches!(outcome, Ok(Requeue::After(_))) && self.held(sandbox).is_some() {
            self.checkpoint_if_due(sandbox).await?;
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
        if !self.leases.is_safe(&held) {
            // The instance lease lapsed: re-verify in a full pass.
            return Ok(None);
        }
        let until = |at: DateTime<Utc>| (at - now).to_std().unwrap_or(Duration::ZERO);
        let mut next = until(watch.last_full_pass + chrono_duration(self.config.resync_interval));
        if watching {
            next = next.min(self.config.detached_poll);
        }
        Ok(Some(Requeue::After(next.max(Duration::from_millis(10)))))
    }

    /// Reads metadata and lock, asks the decision table for the one next
    /// step, and performs it.
    async fn full_pass(&self, sandbox: &SandboxId) -> Result<Requeue, ReconcileError> {
        // Both reads at once: one round trip, not two (a rung handoff starts here).
        let (metadata, lease) =
            tokio::join!(self.read_metadata(sandbox), self.leases.read(sandbox));
        let metadata = match metadata {
            Ok(metadata) => metadata,
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
        let lease = match &metadata {
            Some(_) => lease?.map(|(lease, _)| lease),
            None => None,
        };
        let held = self.held(sandbox);
        let now = self.clock.now();
        let step = decide(&Observed {
            me: self.leases.instance(),
            now,
            metadata: metadata.as_ref(),
            lock: lease.as_ref(),
            held: held.as_ref(),
            vouched: held.as_ref().is_some_and(|held| self.leases.is_safe(held)),
            running_here: self.runtime.is_running(sandbox),
            starting_here: self.starting_set().contains(sandbox),
            lock_expired: lease
                .as_ref()
                .is_none_or(|lease| lease.is_free(now, self.leases.config().skew_tolerance)),
        });
        tracing::debug!(%sandbox, ?step, "decided");
        self.perform(sandbox, step, metadata, lease, held).await
    }

    /// Performs the step the decision table chose.
    async fn perform(
        &self,
        sandbox: &SandboxId,
        step: Step,
        metadata: Option<SandboxMetadata>,
        lease: Option<Lease>,
        held: Option<HeldLease>,
    ) -> Result<Requeue, ReconcileError> {
        let metadata = metadata.as_ref();
        let needs = |what: &'static str| ReconcileError::Internal(what);
        match step {
            Step::Nothing => Ok(Requeue::Never),
            Step::StopVanished => {
                self.stop_lost(sandbox, "its metadata.json was deleted")
                    .await;
                Ok(Requeue::Never)
            }
            Step::StopLost { holder } => {
                let holder = holder.map_or_else(|| "nobody".to_owned(), |h| h.to_string());
                self.stop_lost(
                    sandbox,
                    &format!("the lease was taken over (holder now {holder})"),
                )
                .await;
                Ok(Requeue::Never)
            }
            Step::MarkDied => {
                let held = held.ok_or(needs("a hold to mark died"))?;
                self.mark_died(sandbox, held).await
            }
            Step::Delete => {
                let (metadata, held) = metadata
                    .zip(held)
                    .ok_or(needs("metadata and a hold to delete"))?;
                self.delete_held(sandbox, metadata, held).await
            }
            Step::RefuseCheckpoint => {
                let held = held.ok_or(needs("a hold to refuse a checkpoint"))?;
                self.refuse_checkpoint(sandbox, held).await
            }
            Step::CheckpointAndRelease => {
                let (metadata, held) = metadata
                    .zip(held)
                    .ok_or(needs("metadata and a hold to checkpoint"))?;
                self.checkpoint_and_release(sandbox, metadata, held, false)
                    .await
            }
            Step::HandOver => {
                let (metadata, held) = metadata
                    .zip(held)
                    .ok_or(needs("metadata and a hold to hand over"))?;
                self.hand_over(sandbox, metadata, held).await
            }
            Step::Reverify | Step::KeepRunning => {
                let held = held.ok_or(needs("a hold to keep"))?;
                self.keep_running(sandbox, held).await
            }
            Step::ReleaseOrphan { epoch } => self.release_orphan(sandbox, epoch).await,
            Step::Purge => {
                let metadata = metadata.ok_or(needs("metadata to purge"))?;
                self.emit(sandbox, Progress::Deleted);
                self.purge_if_due(sandbox, metadata).await
            }
            // Its holder converges it; look again once the lock could expire.
            Step::AwaitHolder => Ok(Requeue::After(self.config.resync_interval)),
            Step::Tombstone => self.tombstone_unheld(sandbox).await,
            Step::NotWantedHere => {
                self.tell_waiter_not_wanted(sandbox, lease.as_ref());
                Ok(Requeue::Never)
            }
            Step::Acquire => {
                let metadata = metadata.ok_or(needs("metadata to start"))?;
                self.acquire_and_start(sandbox, metadata, lease).await
            }
        }
    }

    /// The local sandbox died while held: record `Failed`, release.
    async fn mark_died(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        self.forget(sandbox);
        if let Err(err) = self.leases.release(&held).await {
            tracing::warn!(%sandbox, %err, "cannot release the lease of a sandbox that stopped");
        }
        let message = "the sandbox stopped unexpectedly on this instance".to_owned();
        self.write_status(sandbox, held.epoch, |status| {
            status.phase = Phase::Failed;
            status.holder = None;
            status.last_error = Some(message.clone());
            self.ready(status, false, "Failed", &message);
        })
        .await?;
        self.emit(sandbox, Progress::Lost { message });
        Ok(Requeue::Never)
    }

    /// `desired_state: checkpointed` on a sandbox created without
    /// `enable_checkpoint`: say so, keep it running.
    async fn refuse_checkpoint(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
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
        self.keep_running(sandbox, held).await
    }

    /// Another instance wants the sandbox: checkpoint (forced unless the
    /// policy waits for a running execution) and release.
    async fn hand_over(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        self.emit(sandbox, Progress::LockReleaseRequested);
        let force = self.config.handoff == HandoffPolicy::Force;
        let started = std::time::Instant::now();
        let outcome = self
            .checkpoint_and_release(sandbox, metadata, held, force)
            .await;
        if outcome.is_ok() && self.held(sandbox).is_none() {
            self.metrics.handoff_out_seconds.observe(started.elapsed());
        }
        outcome
    }

    /// The lock names this instance, which does not run the sandbox (a start
    /// that failed half-way, a release that did not land, an earlier
    /// incarnation with this id). The instance lease would keep that hold
    /// alive for ever: give it up.
    async fn release_orphan(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
    ) -> Result<Requeue, ReconcileError> {
        if self.runtime.is_running(sandbox)
            && let Err(err) = self.runtime.destroy(sandbox).await
        {
            tracing::warn!(%sandbox, %err, "cannot destroy an unheld sandbox");
        }
        tracing::warn!(%sandbox, epoch, "releasing a lock that names this instance but is not held here");
        self.leases.release_orphan(sandbox, epoch).await?;
        Ok(Requeue::After(Duration::ZERO))
    }

    /// Keeps a held sandbox running: nothing to write while the instance
    /// lease vouches for the hold; after a lapse, re-verifies the hold with one
    /// conditional write to its lock (a taker's concurrent write then fails),
    /// or stops it. Says when to look again.
    async fn keep_running(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        let now = self.clock.now();
        let watching = self
            .watch_map()
            .get(sandbox)
            .and_then(|w| w.detached_since)
            .is_some_and(|since| now < since + chrono_duration(self.config.detached_window));
        let next = if watching {
            self.config.detached_poll
        } else {
            self.config.resync_interval
        };
        if self.leases.is_safe(&held) {
            return Ok(Requeue::After(next));
        }
        let reverified = async {
            self.leases.ensure_instance_lease().await?;
            self.leases.renew(&held).await
        };
        match reverified.await {
            Ok(renewed) => {
                tracing::info!(%sandbox, epoch = renewed.epoch, "hold re-verified after the instance lease lapsed");
                self.held_map().insert(sandbox.clone(), renewed);
                Ok(Requeue::After(next))
            }
            Err(LeaseError::Lost { .. } | LeaseError::Missing { .. }) => {
                self.stop_lost(sandbox, "the lease was taken over").await;
                Ok(Requeue::Never)
            }
            Err(err) => {
                // Past the lease we can vouch for: another instance may
                // start it; two copies must never run.
                self.stop_lost(sandbox, &format!("the lease could not be renewed: {err}"))
                    .await;
                Ok(Requeue::Never)
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
    async fn tombstone_unheld(&self, sandbox: &SandboxId) -> Result<Requeue, ReconcileError> {
        let held = match self.leases.acquire(sandbox).await {
            Ok(held) => held,
            // Held elsewhere after all (its instance lease is live): its
            // holder was rung and converges it; look again shortly.
            Err(LeaseError::HeldByOther { .. } | LeaseError::WantedByOther { .. }) => {
                return Ok(Requeue::After(TOMBSTONE_RETRY));
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
                if let Err(err) = self.leases.release(&held).await {
                    tracing::warn!(%sandbox, %err, "cannot release the lease of a lost sandbox");
                }
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
        self.failpoint(metadata, "handoff:after-record");
        if handoff {
            self.emit(sandbox, Progress::LockReleasing);
        }
        let released = self.leases.release(&held).await;
        if let Err(err) = &released {
            // The checkpoint is recorded. The lock still names this
            // instance, which no longer runs it: a pass soon releases that
            // orphan (the next holder waits until then).
            tracing::warn!(%sandbox, %err, "cannot release the lease after a checkpoint");
        }
        if handoff {
            self.emit(sandbox, Progress::LockReleased);
        }
        // After the release: the next holder need not wait for this.
        self.delete_checkpoints(&unreferenced(superseded, &recorded.status))
            .await;
        self.emit(sandbox, Progress::Deleted);
        self.emit(
            sandbox,
            Progress::Checkpointed {
                image: manifest.image.key,
            },
        );
        Ok(match released {
            Ok(()) => Requeue::Never,
            Err(_) => Requeue::After(TOMBSTONE_RETRY),
        })
    }

    /// Desired running, not wanted here: a client here that waits for it
    /// (its intent was replaced by another instance's, or expired) is told
    /// now rather than left waiting for a start that will not come.
    fn tell_waiter_not_wanted(&self, sandbox: &SandboxId, lease: Option<&Lease>) {
        let now = self.clock.now();
        if self.take_waiting(sandbox) {
            let message = match lease.and_then(|l| l.live_intent(now)) {
                Some(intent) => format!(
                    "instance {} asked for the sandbox meanwhile",
                    intent.instance
                ),
                None => "the attach request expired before the sandbox could be started".to_owned(),
            };
            self.emit(
                sandbox,
                Progress::Failed {
                    operation: Operation::Restore,
                    message,
                },
            );
        }
    }

    /// Rings `holder` for `sandbox` if this pass's instance has not for
    /// [`RERING_INTERVAL`] (the first ring came with the attach intent).
    async fn ring_again_if_due(&self, sandbox: &SandboxId, holder: &crate::api::InstanceId) {
        let now = self.clock.now();
        let due = {
            let mut rung = self.rung.lock().unwrap_or_else(PoisonError::into_inner);
            let last = rung.entry(sandbox.clone()).or_insert(now);
            if now >= *last + chrono_duration(RERING_INTERVAL) {
                *last = now;
                true
            } else {
                false
            }
        };
        if due && let Err(err) = self.leases.instance_lease().ring(holder, sandbox).await {
            tracing::warn!(%sandbox, %holder, %err, "cannot ring the holder again");
        }
    }

    /// Desired running and wanted here: acquire the lease, then restore the
    /// requested or latest checkpoint, or create the sandbox.
    async fn acquire_and_start(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        lease: Option<Lease>,
    ) -> Result<Requeue, ReconcileError> {
        let handoff = metadata.spec.enable_sandbox_handoff;
        let first_try = self
            .acquiring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.clone());
        if handoff && first_try {
            self.emit(sandbox, Progress::LockAcquiring);
        }
        let _starting = StartingGuard::new(&self.starting, sandbox);
        let acquired = self.leases.acquire(sandbox).await;
        if !matches!(acquired, Err(LeaseError::HeldByOther { .. })) {
            self.rung
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(sandbox);
            self.acquiring
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(sandbox);
        }
        let held = match acquired {
            Ok(held) => held,
            Err(LeaseError::HeldByOther { holder, .. }) => {
                // The holder hands it over (or its lease expires): look again
                // soon, and ring it again now and then in case a ring was
                // lost or it released nothing (an orphan lock).
                self.ring_again_if_due(sandbox, &holder).await;
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
        // The metadata this pass read may predate the previous holder's last
        // record (it records its checkpoint, then releases, and this pass
        // read metadata before the record and the lock after the release).
        // Acquiring orders after that release: read it again.
        let fresh = match self.read_metadata(sandbox).await {
            Ok(Some(fresh)) => fresh,
            Ok(None) => {
                self.leases.release(&held).await?;
                return Ok(Requeue::Never);
            }
            Err(err) => {
                if let Err(release) = self.leases.release(&held).await {
                    tracing::warn!(%sandbox, %release, "cannot release after failing to re-read metadata");
                }
                return Err(err);
            }
        };
        let metadata = &fresh;
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
                Ok(Requeue::After(self.config.resync_interval))
            }
            Err((operation, message)) => {
                tracing::warn!(%sandbox, ?operation, %message, "cannot start the sandbox");
                if let Err(err) = self.runtime.destroy(sandbox).await
                    && !matches!(err, RuntimeError::NotFound(_))
                {
                    tracing::warn!(%sandbox, %err, "cannot destroy a sandbox that failed to start");
                }
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
                if let Err(err) = self.leases.release(&held).await {
                    tracing::warn!(%sandbox, %err, "cannot release the lease after a failed start");
                }
                if let Err(err) = self.leases.withdraw_attach(sandbox).await {
                    tracing::warn!(%sandbox, %err, "cannot withdraw the attach intent after a failed start");
                }
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
