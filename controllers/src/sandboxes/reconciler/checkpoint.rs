//! Checkpoint steps: handoff and client checkpoint-and-release, periodic
//! checkpoints in place, recording the latest checkpoint, tombstone purges.

use std::time::Duration;

use super::*;
use crate::leasing::HandBack;

/// Makes `reference` the latest, moving the previous into `previous_checkpoints`
/// (newest first, `keep` kept); returns what fell off. Idempotent on retry.
pub(super) fn record_latest(
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

/// Folds the checkpoint `lock` carries (its record not landed yet, or never:
/// decision 18) into `status` if newer, or if `status`'s latest is a late
/// record of an earlier hold ([`Lease::outdates`]), also under its name;
/// returns what fell off. Every reader of `status` folds the lock in first: a
/// client hears CHECKPOINTED before the record lands and may fork or restore
/// it at once, and a frozen former holder's record must not win.
pub fn record_carried(status: &mut SandboxStatus, lock: &Lease, keep: usize) -> Vec<CheckpointRef> {
    let Some(carried) = &lock.checkpoint else {
        return Vec::new();
    };
    let latest = status.latest_checkpoint.as_ref();
    if !carried.is_newer_than(latest) && !latest.is_some_and(|latest| lock.outdates(latest)) {
        return Vec::new();
    }
    record_named(status, carried, keep)
}

/// [`record_latest`], and the checkpoint of its name if it has one.
fn record_named(
    status: &mut SandboxStatus,
    reference: &CheckpointRef,
    keep: usize,
) -> Vec<CheckpointRef> {
    let superseded = record_latest(status, reference, keep);
    if let Some(name) = &reference.name {
        status
            .named_checkpoints
            .insert(name.clone(), reference.clone());
    }
    superseded
}

/// The superseded checkpoints no named checkpoint still points at.
pub(super) fn unreferenced(
    superseded: Vec<CheckpointRef>,
    status: &SandboxStatus,
) -> Vec<CheckpointRef> {
    superseded
        .into_iter()
        .filter(|c| !status.named_checkpoints.values().any(|n| n.path == c.path))
        .collect()
}

/// Deletes a checkpoint's image and manifest by image key (missing ones are fine; a non-checkpoint
/// key deletes nothing): the one place they are removed (retention, purges, `sandboxctl`).
pub async fn delete_checkpoint_objects(
    store: &dyn Store,
    image_path: &str,
) -> Result<(), StoreError> {
    let Some(id) = checkpoint_id_of_image(image_path) else {
        return Ok(());
    };
    for key in [checkpoint_image_key(&id), checkpoint_manifest_key(&id)] {
        match store.delete(&key).await {
            Ok(()) | Err(StoreError::NotFound { .. }) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

impl Reconciler {
    /// Records the failure in `status.last_error` (fenced by `epoch`), emits it.
    pub(super) async fn report_checkpoint_failure(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        cause: CheckpointFailure,
    ) -> Result<(), ReconcileError> {
        let message = format!("checkpoint failed: {cause}");
        self.write_status(sandbox, epoch, |status| {
            status.last_error = Some(message.clone());
        })
        .await?;
        self.emit(sandbox, SandboxEvent::CheckpointFailed(cause));
        Ok(())
    }

    /// Checkpoints a held sandbox in place (record, restore, lease kept) so a crash loses at most
    /// one interval; skipped during an execution, silent to the client. A failure retries next
    /// interval; the next full pass stops one left not running (`MarkDied`) or fenced (`StopLost`).
    pub(super) async fn periodic_checkpoint(
        &self,
        sandbox: &SandboxId,
        held: HeldLease,
    ) -> Result<(), ReconcileError> {
        let request = CheckpointRequest {
            checkpoint_id: SandboxId::random(),
            epoch: held.epoch,
            name: None,
            force: false,
            keep_executions: false,
        };
        let checkpointed = self.runtime.checkpoint(sandbox, request).await;
        let now = self.clock.now();
        self.update_watch(sandbox, |watch| watch.last_checkpoint = now);
        let manifest = match checkpointed {
            Ok(manifest) => manifest,
            Err(RuntimeError::ExecutionInProgress(_)) => return Ok(()),
            Err(err) => {
                tracing::warn!(%sandbox, %err, "periodic checkpoint failed");
                self.want_full_pass(sandbox);
                return Ok(());
            }
        };
        let reference = self.checkpoint_ref(&manifest, held.epoch, None);
        let keep = self.config.keep_checkpoints;
        let mut superseded = Vec::new();
        // Frozen past its lease meanwhile, the hold may have been taken over from an older
        // checkpoint: no record ("A zombie's record"); the full pass re-verifies or stops the hold.
        let recorded = if self.leases.is_safe(&held) {
            self.write_status(sandbox, held.epoch, |status| {
                superseded = record_latest(status, &reference, keep);
            })
            .await
        } else {
            Err(ReconcileError::Interrupted(
                "the hold was not vouched for once the checkpoint was taken".to_owned(),
            ))
        };
        let restored = self.runtime.restore(sandbox, &manifest).await;
        match (recorded, restored) {
            (Ok(recorded), Ok(())) => {
                self.delete_checkpoints(&unreferenced(superseded, &recorded.status))
                    .await;
                tracing::info!(%sandbox, size = manifest.image.size, "periodic checkpoint");
            }
            (recorded, restored) => {
                let (recorded, restored) = (recorded.err(), restored.err());
                tracing::warn!(%sandbox, ?recorded, ?restored, "periodic checkpoint not recorded or not restored");
                self.want_full_pass(sandbox);
            }
        }
        Ok(())
    }

    /// Fault tests: aborts at `step` if configured (handoffs only).
    pub(super) fn failpoint(&self, metadata: &SandboxMetadata, step: &str) {
        if metadata.spec.desired_state == DesiredState::Running
            && self.config.failpoint.as_deref() == Some(step)
        {
            tracing::error!(step, "failpoint reached: aborting the process");
            std::process::abort();
        }
    }

    pub(super) async fn checkpoint_and_release(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        mut held: HeldLease,
        mut lock: Option<ReadLease>,
        force: bool,
    ) -> Result<Requeue, ReconcileError> {
        let _transition = self.slots.in_transition(sandbox, "checkpointing");
        if !self.leases.is_safe(&held) {
            held = self.leases.renew(&held).await?;
            self.renewed(sandbox, held.clone());
            lock = Some((held.lease.clone(), held.generation));
        }
        self.emit(sandbox, SandboxEvent::CheckpointStarted);
        let name = match metadata.spec.desired_state {
            DesiredState::Checkpointed => metadata.spec.checkpoint_name.clone(),
            _ => None,
        };
        // Handed over: an id the taker knows, to prefetch the image (decision 24).
        let taker = lock.as_ref().and_then(|(lease, _)| {
            lease.wanted_elsewhere(self.leases.instance(), self.clock.now())
        });
        let checkpoint_id = match taker {
            Some(intent) => handoff_checkpoint_id(sandbox, held.epoch, &intent.instance),
            None => SandboxId::random(),
        };
        let request = CheckpointRequest {
            checkpoint_id,
            epoch: held.epoch,
            name: name.clone(),
            force: force || self.draining(),
            keep_executions: metadata.spec.keep_executions,
        };
        self.failpoint(metadata, "handoff:before-checkpoint");
        let checkpoint_started = self.clock.instant();
        let manifest = match self.runtime.checkpoint(sandbox, request).await {
            Ok(manifest) => {
                self.failpoint(metadata, "handoff:after-upload");
                self.metrics
                    .checkpoint_seconds
                    .observe(self.clock.instant().duration_since(checkpoint_started));
                crate::sandboxes::Metrics::add(&self.metrics.checkpoint_bytes, manifest.image.size);
                manifest
            }
            Err(RuntimeError::ExecutionInProgress(_)) => {
                self.emit(sandbox, SandboxEvent::CheckpointWaitsForExecution);
                // Not a steady state: the retry must decide again in full.
                self.want_full_pass(sandbox);
                return Ok(Requeue::After(self.config.checkpoint_retry));
            }
            Err(RuntimeError::Lost { detail, .. }) => {
                self.forget(sandbox);
                self.emit(sandbox, SandboxEvent::Stopping);
                let cause = CheckpointFailure::SandboxLost(detail);
                let message = format!("checkpoint failed: {cause}");
                let failed = (Phase::Failed, ReadyReason::Failed);
                self.record_stopped(sandbox, held.epoch, failed, Some(&message))
                    .await?;
                if let Err(err) = self.leases.release(&held).await {
                    tracing::warn!(%sandbox, %err, "cannot release the lease of a lost sandbox");
                }
                self.emit(sandbox, SandboxEvent::CheckpointFailed(cause));
                return Ok(Requeue::Never);
            }
            Err(err) => {
                let cause = CheckpointFailure::Runtime(err.to_string());
                self.report_checkpoint_failure(sandbox, held.epoch, cause)
                    .await?;
                return Err(err.into());
            }
        };
        // The runtime removed the local sandbox with the checkpoint.
        self.forget(sandbox);
        self.emit(sandbox, SandboxEvent::Stopping);
        let reference = self.checkpoint_ref(&manifest, held.epoch, name);
        // The hand-back carries the checkpoint (decision 18): the next holder restores it even if
        // the record lands late or never. The record follows once the lock proved this hold current
        // (the hand-back landed, or `not_taken_over`): else a frozen holder's record could land
        // before its taker's first record moves `status.epoch` on, and a later takeover restore a
        // state the taker never started from (`docs/handoff.md`, "A zombie's record").
        self.emit(sandbox, SandboxEvent::LeaseReleasing);
        let handed = self
            .leases
            .hand_back(&held, lock, &reference, &manifest)
            .await;
        self.failpoint(metadata, "handoff:after-record");
        let record = || {
            let (sandbox, reference, epoch) = (sandbox.clone(), reference.clone(), held.epoch);
            self.spawn_shared(move |me| async move {
                me.record_checkpoint(&sandbox, epoch, &reference).await
            })
        };
        let safe = match &handed {
            Ok(outcome) => {
                if let HandBack::TransferredTo { instance, epoch } = outcome {
                    tracing::info!(%sandbox, to = %instance, epoch, "hold transferred with the checkpoint");
                }
                drop(record());
                Ok(())
            }
            Err(err) => {
                // The lock still names this instance, no longer running it: a
                // pass soon releases it (the next holder waits).
                tracing::warn!(%sandbox, %err, "cannot release the lease after a checkpoint");
                match self.not_taken_over(sandbox, held.epoch, &reference).await {
                    Ok(()) => record().await.unwrap_or_else(|err| {
                        Err(ReconcileError::Interrupted(format!(
                            "the checkpoint's record ended abnormally: {err}"
                        )))
                    }),
                    Err(err) => Err(err),
                }
            }
        };
        if let Err(err) = safe {
            let cause =
                CheckpointFailure::Runtime(format!("the checkpoint could not be recorded: {err}"));
            self.emit(sandbox, SandboxEvent::CheckpointFailed(cause));
            return Err(err);
        }
        // Safe (lock or record), hold gone: the client hears CHECKPOINTED, its
        // session ending to free the next attach, without waiting for the record.
        self.emit(sandbox, SandboxEvent::LeaseReleased);
        let image = manifest.image.key;
        self.emit(sandbox, SandboxEvent::Checkpointed { image });
        Ok(match handed {
            Ok(_) => Requeue::Never,
            Err(_) => Requeue::After(TOMBSTONE_RETRY),
        })
    }

    /// After a checkpoint whose hand-back failed, before its record: `Ok` only if nobody took the
    /// hold over since `epoch` or the lock carries this checkpoint. A record's fence proves
    /// nothing: a taker records its epoch only once its client hears `RUNNING` (decision 21).
    async fn not_taken_over(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        reference: &CheckpointRef,
    ) -> Result<(), ReconcileError> {
        match self.leases.read(sandbox).await? {
            Some((lock, _))
                if lock.epoch == epoch
                    || lock
                        .checkpoint
                        .as_ref()
                        .is_some_and(|carried| carried.path == reference.path) =>
            {
                Ok(())
            }
            Some((lock, _)) => Err(LeaseError::Lost {
                sandbox: sandbox.clone(),
                epoch,
                holder: lock.holder,
                current_epoch: lock.epoch,
            }
            .into()),
            None => Err(LeaseError::Missing {
                sandbox: sandbox.clone(),
            }
            .into()),
        }
    }

    /// Records a checkpoint just taken under `epoch` (and its name), retrying once
    /// with the checkpoint alone, then deletes what it superseded. Fenced (a
    /// newer holder recorded it from the lock): ignorable once the lock has it.
    pub(super) async fn record_checkpoint(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        reference: &CheckpointRef,
    ) -> Result<(), ReconcileError> {
        let keep = self.config.keep_checkpoints;
        let mut superseded = Vec::new();
        let mut record_in =
            |status: &mut SandboxStatus| superseded = record_named(status, reference, keep);
        let first = self
            .write_status(sandbox, epoch, |status| {
                record_in(status);
                status.phase = Phase::Checkpointed;
                status.holder = None;
                status.last_error = None;
                status.set_ready(ReadyReason::Checkpointed, "", self.clock.now());
            })
            .await;
        let written = match first {
            Ok(written) => written,
            Err(err) if err.is_fenced() => return Err(err),
            Err(err) => {
                // The lock carries it; retry once so `status` does not lag.
                tracing::warn!(%sandbox, %err, "cannot record the checkpoint; trying once more");
                self.write_status(sandbox, epoch, &mut record_in)
                    .await
                    .inspect_err(|again| {
                        if !again.is_fenced() {
                            tracing::warn!(%sandbox, err = %again, "cannot record the checkpoint; the lock carries it");
                        }
                    })?
            }
        };
        self.delete_checkpoints(&unreferenced(superseded, &written.status))
            .await;
        Ok(())
    }

    pub(super) fn checkpoint_ref(
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

    /// Deletes checkpoints nothing points at; failures leave garbage (logged).
    pub(super) async fn delete_checkpoints(&self, checkpoints: &[CheckpointRef]) {
        for checkpoint in checkpoints {
            if let Err(err) =
                delete_checkpoint_objects(self.checkpoints.as_ref(), &checkpoint.path).await
            {
                tracing::warn!(path = %checkpoint.path, %err, "cannot delete a superseded checkpoint");
            }
        }
    }

    /// Removes a tombstoned sandbox's objects once its retention has passed.
    pub(super) async fn purge_if_due(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
    ) -> Result<Requeue, ReconcileError> {
        let retention = chrono_duration(self.config.tombstone_retention);
        let deleted_at = metadata.status.deleted_at().unwrap_or(metadata.created_at);
        let now = self.clock.now();
        // Checked: an operator's far-future timestamp keeps the tombstone.
        let purge_at = deleted_at
            .checked_add_signed(retention)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        if now < purge_at {
            let wait = (purge_at - now).to_std().unwrap_or(Duration::ZERO);
            return Ok(Requeue::After(wait.min(Duration::from_secs(3600))));
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
}
