//! The steps of a sandbox this instance holds that do not checkpoint it:
//! keep it (re-verifying the hold after an instance-lease lapse), stop it when
//! lost or vanished, record it died, delete it, refuse a checkpoint it was not
//! created for; and the two steps for locks it does not hold: release an
//! orphan, write a tombstone.

use std::time::Duration;

use super::*;

/// What a re-verification of a hold came to.
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
    /// a deletion and a lost checkpoint do), so that no taker finds the lock
    /// free while the status still says the sandbox runs.
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

    /// `desired_state: checkpointed` on a sandbox created without
    /// `enable_checkpoint`: say so, keep it running.
    pub(super) async fn refuse_checkpoint(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<Requeue, ReconcileError> {
        self.report_checkpoint_failure(sandbox, held.epoch, CheckpointFailure::NotConfigured)
            .await?;
        Ok(Requeue::After(self.next_look(sandbox)))
    }

    /// Another instance wants the sandbox: checkpoint (forced unless the
    /// policy waits for a running execution) and release.
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
    /// that failed half-way, a release that did not land, an earlier
    /// incarnation with this id). The instance lease would keep that hold
    /// alive for ever: give it up.
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
        self.leases.release_orphan(sandbox, epoch).await?;
        Ok(Requeue::After(Duration::ZERO))
    }

    /// The instance lease lapsed since the hold was taken (`decide` saw it
    /// not vouched for): re-verifies the hold with one conditional write to
    /// its lock (a taker's concurrent write then fails). What it found when
    /// the write did not land is for the table to decide on.
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

    /// When a held sandbox is looked at again: the departure watch's poll
    /// while the client left within the detached window, else the resync.
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
        // The client is told first: forgetting the hold releases an
        // execution exit held back by the fence, and destroying the sandbox
        // ends its running execution; neither may reach the client as a
        // DONE before the loss does (another instance may hold it now).
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

    /// `desired_state: deleted` on a sandbox nobody runs: write the tombstone
    /// under a lease of our own so no holder is overwritten.
    pub(super) async fn tombstone_unheld(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Requeue, ReconcileError> {
        let held = match self.leases.acquire(sandbox).await {
            Ok(held) => held,
            // Held elsewhere after all (its instance lease is live): its
            // holder was rung and converges it; look again shortly.
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
