//! Held-sandbox steps besides checkpoints: keep (re-verify after an
//! instance-lease lapse), stop when lost or vanished, record it died, delete,
//! refuse an unconfigured checkpoint; unheld locks: release orphans, tombstone.

use std::time::Duration;

use super::*;

pub(super) enum Reverified {
    /// The write landed: the hold is vouched for again, as renewed.
    Renewed(Box<HeldLease>),
    /// The lock as found, naming another holder or epoch (`None`: no lock).
    Found(Option<Box<Lease>>),
    /// The write failed in the store (or the instance lease's did): why.
    Failed(String),
}

impl Reconciler {
    /// The local sandbox died while held: record `Failed`, then release (as
    /// deletions and lost checkpoints do): no taker finds it free but running.
    pub(super) async fn mark_died(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        self.forget(sandbox);
        let cause = LossCause::Died;
        let message = cause.to_string();
        let failed = (Phase::Failed, ReadyReason::Failed);
        let recorded = self
            .record_stopped(sandbox, held.epoch, failed, Some(&message))
            .await;
        // Released even when the record was refused: the hold ends either way.
        if let Err(err) = self.leases.release(&held).await {
            tracing::warn!(%sandbox, %err, "cannot release the lease of a sandbox that stopped");
        }
        recorded?;
        self.emit(sandbox, SandboxEvent::Lost(cause));
        Ok(Requeue::Never)
    }

    /// `checkpointed` wanted without `enable_checkpoint`: say so, keep running.
    pub(super) async fn refuse_checkpoint(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        self.report_checkpoint_failure(sandbox, held.epoch, CheckpointFailure::NotConfigured)
            .await?;
        Ok(Requeue::After(self.next_look(sandbox)))
    }

    /// Wanted elsewhere: checkpoint (forced unless the policy waits) and release.
    pub(super) async fn hand_over(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: HeldLease,
        lock: Option<ReadLease>,
    ) -> Result<Requeue, ReconcileError> {
        self.emit(sandbox, SandboxEvent::HandoffRequested);
        let force = self.config.handoff == HandoffPolicy::Force;
        let started = self.clock.instant();
        let outcome = self
            .checkpoint_and_release(sandbox, metadata, held, lock, force)
            .await;
        if outcome.is_ok() && self.held(sandbox).is_none() {
            self.metrics
                .handoff_out_seconds
                .observe(self.clock.instant().duration_since(started));
        }
        outcome
    }

    /// The lock names this instance, which does not run the sandbox (a start
    /// failed half-way, a release not landed, an earlier incarnation of the
    /// id): the instance lease would keep it alive for ever, so give it up.
    pub(super) async fn release_orphan(
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
        self.leases.release_and_withdraw(sandbox, epoch).await?;
        Ok(Requeue::After(Duration::ZERO))
    }

    /// After an instance-lease lapse: one conditional lock write re-verifies the hold (a taker's
    /// concurrent write then fails); if refused, the table decides on what it found.
    pub(super) async fn reverify(&self, sandbox: &SandboxId, held: &HeldLease) -> Reverified {
        let reverified = async {
            self.leases.ensure_instance_lease().await?;
            self.leases.renew_or_found(held).await
        };
        match reverified.await {
            Ok(Ok(renewed)) => {
                tracing::info!(%sandbox, epoch = renewed.epoch, "hold re-verified after the instance lease lapsed");
                self.renewed(sandbox, renewed.clone());
                Reverified::Renewed(Box::new(renewed))
            }
            Ok(Err(found)) => Reverified::Found(found.map(Box::new)),
            Err(err) => Reverified::Failed(format!("the hold could not be re-verified: {err}")),
        }
    }

    /// Next look: the detached poll in the window after a leave, else resync.
    pub(super) fn next_look(&self, sandbox: &SandboxId) -> Duration {
        let now = self.clock.now();
        let watching = self
            .watch(sandbox)
            .and_then(|w| w.detached_since)
            .is_some_and(|since| now < since + chrono_duration(self.config.detached_window));
        if watching {
            self.config.detached_poll
        } else {
            self.config.resync_interval
        }
    }

    /// Stops a sandbox this instance no longer owns, writing nothing.
    pub(super) async fn stop_lost(&self, sandbox: &SandboxId, why: LossCause) {
        tracing::warn!(%sandbox, %why, "stopping a sandbox this instance lost");
        crate::sandboxes::Metrics::add(&self.metrics.lost, 1);
        // The client hears first: forgetting the hold releases an execution
        // exit the fence held back, and destroying ends a running execution;
        // neither may reach it as DONE before the loss (another may hold it).
        self.emit(sandbox, SandboxEvent::Lost(why));
        self.note_lost(sandbox);
        if let Err(err) = self.runtime.destroy(sandbox).await
            && !matches!(err, RuntimeError::NotFound(_))
        {
            tracing::error!(%sandbox, %err, "cannot destroy a lost sandbox");
        }
    }

    pub(super) async fn delete_held(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        let _transition = self.slots.in_transition(sandbox, "deleting");
        self.emit(sandbox, SandboxEvent::Stopping);
        crate::sandboxes::Metrics::add(&self.metrics.deletes, 1);
        if self.runtime.is_running(sandbox)
            && let Some(hooks) = self.hook_binding(sandbox)
        {
            hooks.on_terminate(sandbox).await;
        }
        match self.runtime.destroy(sandbox).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(err) => {
                self.emit(sandbox, SandboxEvent::DeleteFailed(err.to_string()));
                return Err(err.into());
            }
        }
        self.forget(sandbox);
        let deleted = (Phase::Deleted, ReadyReason::Deleted);
        self.record_stopped(sandbox, held.epoch, deleted, None)
            .await?;
        self.emit(sandbox, SandboxEvent::LeaseReleasing);
        self.leases.release(&held).await?;
        self.emit(sandbox, SandboxEvent::LeaseReleased);
        self.emit(sandbox, SandboxEvent::Deleted);
        Ok(Requeue::After(self.config.tombstone_retention))
    }

    /// Deleted and unheld: tombstone under our own lease, overwriting no holder.
    pub(super) async fn tombstone_unheld(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Requeue, ReconcileError> {
        let held = match self.leases.acquire(sandbox).await {
            Ok(held) => held,
            // Held elsewhere after all: its rung holder converges it; retry soon.
            Err(LeaseError::HeldByOther { .. } | LeaseError::WantedByOther { .. }) => {
                return Ok(Requeue::After(TOMBSTONE_RETRY));
            }
            Err(err) => return Err(err.into()),
        };
        self.emit(sandbox, SandboxEvent::Stopping);
        let deleted = (Phase::Deleted, ReadyReason::Deleted);
        self.record_stopped(sandbox, held.epoch, deleted, None)
            .await?;
        self.leases.release(&held).await?;
        self.emit(sandbox, SandboxEvent::Deleted);
        Ok(Requeue::After(self.config.tombstone_retention))
    }
}
