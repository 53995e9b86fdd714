//! One reconcile pass for one sandbox on this instance: read desired state
//! (`metadata.json` spec, the lease's `wanted_by`) and observed state (the
//! lease, the local runtime), take ONE step toward desired, record it with a
//! fenced write, and say when to look again (`DESIGN.md` §4).
//!
//! A held sandbox nothing happened to gets a light pass (no storage request)
//! until its resync; otherwise a full pass reads metadata and lock, the
//! decision table (`super::decision`) picks the one step, and [`Reconciler`]
//! performs it. The steps live by concept: `hold` (keep, re-verify, stop,
//! delete, orphans, tombstones), `checkpoint` (handoff, client and periodic
//! checkpoints, purge), `start` (acquire, restore or create).

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

mod checkpoint;
mod fork;
mod hold;
mod start;

pub use checkpoint::delete_checkpoint_objects;
pub use fork::{ForkError, ForkPoint};

use super::progress::{Operation, Progress, ProgressBus};

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
/// the instance learns of intents from its doorbell, read every 400 ms.
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
    /// How often it reads it instead while a client attached here has sent
    /// something within `detached_window`: a client whose network drops
    /// mid-use reconnects through another instance within seconds, and this
    /// is when an instance serves requests anyway.
    pub doorbell_poll_active: Duration,
    /// How often the lock of a held sandbox whose client just left is read,
    /// to notice an attach on another instance quickly.
    pub detached_poll: Duration,
    /// For how long after the client left (or last sent a frame while
    /// attached) that fast polling lasts.
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
            renew_interval: Duration::from_secs(10),
            doorbell_poll: Duration::from_millis(400),
            doorbell_poll_active: Duration::from_millis(200),
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
    /// When its attached client last attached or sent a frame.
    last_active: Option<DateTime<Utc>>,
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
            if attached {
                watch.last_active = Some(now);
            }
        }
    }

    /// The attached client of `sandbox` sent a frame.
    pub fn client_active(&self, sandbox: &SandboxId) {
        let now = self.clock.now();
        if let Some(watch) = self.watch_map().get_mut(sandbox) {
            watch.last_active = Some(now);
        }
    }

    /// How long the doorbell loop sleeps before its next read: the active
    /// interval while any client attached here sent something within the
    /// fast window, the idle one otherwise.
    pub fn doorbell_interval(&self) -> Duration {
        let now = self.clock.now();
        let window = chrono_duration(self.config.detached_window);
        let active = self.watch_map().values().any(|watch| {
            watch.detached_since.is_none() && watch.last_active.is_some_and(|at| now < at + window)
        });
        if active {
            self.config.doorbell_poll_active
        } else {
            self.config.doorbell_poll
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
            Step::CheckpointedMeanwhile => {
                if self.take_waiting(sandbox) {
                    self.emit(
                        sandbox,
                        Progress::Failed {
                            operation: Operation::Restore,
                            message: format!(
                                "Sandbox {sandbox} was checkpointed by its instance (shutting down, or an operator) before it could move here; attach again to restore it"
                            ),
                        },
                    );
                }
                Ok(Requeue::Never)
            }
            Step::Acquire => {
                let metadata = metadata.ok_or(needs("metadata to start"))?;
                self.acquire_and_start(sandbox, metadata, lease).await
            }
        }
    }
}
