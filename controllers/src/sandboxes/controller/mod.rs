//! The sandbox controller of one instance: work queue, worker loop, and the narrow API-layer
//! surface: commands to a sandbox's pass (create, attach, desired state), awaiting replies, never
//! writing its objects nor creating, checkpointing or restoring it. Executions and snapshots reach
//! the runtime only for sandboxes held here; a fork copies the source's checkpoint first.

mod doorbell;
mod executions;
mod intents;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::broadcast;

use crate::api::SandboxId;
use crate::leasing::LeaseError;
use crate::runtime::RuntimeError;
use crate::store::StoreError;

use super::events::SandboxEvent;
use super::reconciler::{ForkError, ReconcileError, Reconciler, Requeue};
use super::workqueue::WorkQueue;
use doorbell::DoorbellState;

/// Concurrent reconciles here, one per sandbox (checkpoints take seconds).
const MAX_CONCURRENT_RECONCILES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("sandbox {0} does not exist")]
    NotFound(SandboxId),
    /// Deleted, or being deleted: it takes no other intent.
    #[error("sandbox {0} was deleted")]
    Deleted(SandboxId),
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
    /// A write this call started in a task of its own ended abnormally.
    #[error("{0}")]
    Internal(String),
}

/// The controller: share it behind an `Arc`.
#[derive(Debug)]
pub struct SandboxController {
    reconciler: Arc<Reconciler>,
    queue: WorkQueue,
    reconcile_errors: AtomicU64,
    doorbell: std::sync::Mutex<DoorbellState>,
}

impl SandboxController {
    pub fn new(reconciler: Reconciler) -> Arc<Self> {
        let reconciler = Arc::new(reconciler);
        Reconciler::share(&reconciler);
        let queue = WorkQueue::new(Arc::clone(reconciler.clock()));
        reconciler.wake_with(queue.clone());
        Arc::new(Self {
            reconciler,
            queue,
            reconcile_errors: AtomicU64::new(0),
            doorbell: std::sync::Mutex::new(DoorbellState::default()),
        })
    }

    /// The reconciler, for tests and the simulation only (else: the queue).
    #[cfg(any(test, feature = "testing"))]
    pub fn reconciler(&self) -> &Reconciler {
        &self.reconciler
    }

    /// The reconciler's counters, for the server's `/metrics`.
    pub fn metrics(&self) -> &super::Metrics {
        self.reconciler.metrics()
    }

    /// Sandboxes held here and their transitions, for `sandboxd_sandboxes{phase}`.
    pub fn census(&self) -> super::Census {
        self.reconciler.census()
    }

    /// Runs the worker loop (a task per reconcile, one per sandbox at a time,
    /// failures backed off), lease and doorbell loops; aborting stops all three.
    pub fn spawn_workers(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let workers = Arc::clone(self).work();
        let lease = Arc::clone(self).keep_instance_lease();
        let doorbell = Arc::clone(self).watch_doorbell();
        tokio::spawn(async move {
            tokio::join!(workers, lease, doorbell);
        })
    }

    /// Reconciles in tasks, at most [`MAX_CONCURRENT_RECONCILES`] at once.
    async fn work(self: Arc<Self>) {
        let limit = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_RECONCILES));
        let mut reconciles = tokio::task::JoinSet::new();
        loop {
            // The semaphore is never closed.
            let Ok(permit) = Arc::clone(&limit).acquire_owned().await else {
                return;
            };
            let sandbox = self.queue.next().await;
            while reconciles.try_join_next().is_some() {}
            let controller = Arc::clone(&self);
            reconciles.spawn(async move {
                let _permit = permit;
                match controller.reconciler.reconcile(&sandbox).await {
                    Ok(requeue) => {
                        controller.queue.done(&sandbox);
                        if let Requeue::After(delay) = requeue {
                            controller.queue.add_after(&sandbox, delay);
                        }
                    }
                    Err(err) => {
                        controller.reconcile_errors.fetch_add(1, Ordering::Relaxed);
                        controller.reconciler.want_full_pass(&sandbox);
                        let delay = controller.queue.done_failed(&sandbox);
                        tracing::warn!(%sandbox, %err, retry_in = ?delay, "reconcile failed");
                    }
                }
            });
        }
    }

    /// Queues a full reconcile of `sandbox` now (after writing an intent).
    pub fn enqueue(&self, sandbox: &SandboxId) {
        self.reconciler.want_full_pass(sandbox);
        self.queue.add(sandbox);
    }

    /// Look at `sandbox` soon (an execution ended); storage only if a step is due.
    pub fn poke(&self, sandbox: &SandboxId) {
        self.queue.add(sandbox);
    }

    /// Runs `command` (create, attach, desired state) with the pass serving it,
    /// as a worker would, for callers driving passes by hand (tests, simulation).
    #[cfg(any(test, feature = "testing"))]
    pub async fn serving<T>(
        &self,
        sandbox: &SandboxId,
        command: impl std::future::Future<Output = T>,
    ) -> T {
        let mut command = std::pin::pin!(command);
        loop {
            // The command may fail before it is sent (nothing to serve).
            tokio::select! {
                biased;
                outcome = &mut command => return outcome,
                () = tokio::task::yield_now() => {}
            }
            if self.reconciler.commands_waiting(sandbox) > 0 {
                break;
            }
        }
        let (outcome, _) = tokio::join!(command, self.reconciler.reconcile(sandbox));
        outcome
    }

    /// Takes every sandbox queued now (tests run no workers).
    #[cfg(test)]
    pub(crate) fn drain_queue(&self) -> Vec<SandboxId> {
        self.queue.drain()
    }

    /// Failed reconcile passes so far (each is logged with its reason).
    pub fn reconcile_errors(&self) -> u64 {
        self.reconcile_errors.load(Ordering::Relaxed)
    }

    /// A client attached to (`true`) or left a sandbox held here; one left is
    /// watched closely a while (it may reconnect through another instance).
    pub fn client_attached(&self, sandbox: &SandboxId, attached: bool) {
        self.reconciler.client_attached(sandbox, attached);
        if !attached {
            self.queue.add(sandbox);
        }
    }

    /// The client of `sandbox` sent a frame: the doorbell is read at the active
    /// interval a while (a dropped client reconnects elsewhere within seconds).
    pub fn client_active(&self, sandbox: &SandboxId) {
        self.reconciler.client_active(sandbox);
    }

    /// The reconciler's progress on `sandbox`, from now on.
    pub fn subscribe(&self, sandbox: &SandboxId) -> broadcast::Receiver<SandboxEvent> {
        self.reconciler.subscribe(sandbox)
    }

    pub fn is_held_here(&self, sandbox: &SandboxId) -> bool {
        self.reconciler.held(sandbox).is_some()
    }

    pub fn held_sandboxes(&self) -> Vec<SandboxId> {
        self.reconciler.held_sandboxes()
    }
}
