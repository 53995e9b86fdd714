//! Starting a sandbox here: tell a waiting client it is not wanted here any
//! more, ring a slow holder again, acquire the lease, then restore the
//! requested or latest checkpoint (manifest checked) or create it.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::*;

/// How often an instance waiting for a sandbox rings its holder again.
const RERING_INTERVAL: Duration = Duration::from_secs(5);

/// Marks a sandbox as being started by a pass until dropped.
pub(super) struct StartingGuard<'a> {
    set: &'a Mutex<HashSet<SandboxId>>,
    sandbox: SandboxId,
}

impl<'a> StartingGuard<'a> {
    pub(super) fn new(set: &'a Mutex<HashSet<SandboxId>>, sandbox: &SandboxId) -> Self {
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

impl Reconciler {
    /// Desired running, not wanted here: a client here that waits for it
    /// (its intent was replaced by another instance's, or expired) is told
    /// now rather than left waiting for a start that will not come.
    pub(super) fn tell_waiter_not_wanted(&self, sandbox: &SandboxId, lease: Option<&Lease>) {
        let now = self.clock.now();
        if self.take_waiting(sandbox) {
            let cause = match lease.and_then(|l| l.live_intent(now)) {
                Some(intent) => StartFailure::WantedElsewhere(intent.instance.clone()),
                None => StartFailure::IntentExpired,
            };
            self.emit(
                sandbox,
                SandboxEvent::StartFailed {
                    kind: StartKind::Restore,
                    cause,
                },
            );
        }
    }

    /// Rings `holder` for `sandbox` if this pass's instance has not for
    /// [`RERING_INTERVAL`] (the first ring came with the attach intent).
    pub(super) async fn ring_again_if_due(
        &self,
        sandbox: &SandboxId,
        holder: &crate::api::InstanceId,
    ) {
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
    pub(super) async fn acquire_and_start(
        &self,
        sandbox: &SandboxId,
        lease: Option<Lease>,
    ) -> Result<Requeue, ReconcileError> {
        let first_try = self
            .acquiring
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.clone());
        if first_try {
            self.emit(sandbox, SandboxEvent::LeaseAcquiring);
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
                    SandboxEvent::StartFailed {
                        kind: StartKind::Restore,
                        cause: StartFailure::WantedElsewhere(instance),
                    },
                );
                return Ok(Requeue::Never);
            }
            Err(err) => return Err(err.into()),
        };
        self.emit(sandbox, SandboxEvent::LeaseAcquired);
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
            Ok(kind) => {
                match kind {
                    StartKind::Create => crate::sandboxes::Metrics::add(&self.metrics.creates, 1),
                    StartKind::Restore => self.metrics.restore_seconds.observe(started.elapsed()),
                }
                if *kind == StartKind::Restore
                    && let Some(intent) = lease.as_ref().and_then(|l| l.wanted_by.as_ref())
                {
                    let waited = (self.clock.now() - intent.requested_at)
                        .to_std()
                        .unwrap_or_default();
                    self.metrics.handoff_in_seconds.observe(waited);
                }
            }
            Err(_) => crate::sandboxes::Metrics::add(&self.metrics.failures, 1),
        }
        match outcome.map(|_| ()) {
            Ok(()) => {
                self.held_map().insert(sandbox.clone(), held.clone());
                self.watch_map().insert(
                    sandbox.clone(),
                    Watch {
                        last_full_pass: self.clock.now(),
                        detached_since: None,
                        last_active: None,
                        checkpointable: metadata.spec.enable_checkpoint,
                        last_checkpoint: self.clock.now(),
                    },
                );
                self.emit(sandbox, SandboxEvent::Running { epoch: held.epoch });
                Ok(Requeue::After(self.config.resync_interval))
            }
            Err((kind, cause)) => {
                tracing::warn!(%sandbox, %kind, %cause, "cannot start the sandbox");
                if let Err(err) = self.runtime.destroy(sandbox).await
                    && !matches!(err, RuntimeError::NotFound(_))
                {
                    tracing::warn!(%sandbox, %err, "cannot destroy a sandbox that failed to start");
                }
                let previous_phase = metadata.status.phase;
                let message = format!("{kind} failed: {cause}");
                let recorded = self
                    .write_status(sandbox, held.epoch, |status| {
                        // A failed restore leaves the checkpoint as it was:
                        // the next attach may try again.
                        let (phase, reason) = match kind {
                            StartKind::Create => (Phase::Failed, ReadyReason::Failed),
                            StartKind::Restore => (previous_phase, ReadyReason::RestoreFailed),
                        };
                        status.phase = phase;
                        self.ready(status, reason, &message);
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
                self.emit(sandbox, SandboxEvent::StartFailed { kind, cause });
                recorded.map(|_| Requeue::Never)
            }
        }
    }

    /// Creates or restores the sandbox under a freshly acquired lease and
    /// records it as running here.
    pub(super) async fn start(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: &HeldLease,
    ) -> Result<StartKind, (StartKind, StartFailure)> {
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
                        StartKind::Restore,
                        StartFailure::NoNamedCheckpoint(request.checkpoint.clone()),
                    ));
                }
            },
            None => metadata.status.latest_checkpoint.clone(),
        };
        let instance = self.leases.instance().clone();
        let served_request = restore_request.map(|r| r.requested_at);
        let kind = match (&source, metadata.status.phase) {
            (Some(_), _) => StartKind::Restore,
            (None, Phase::Pending | Phase::Creating) => StartKind::Create,
            (None, _) => return Err((StartKind::Restore, StartFailure::NoCheckpoint)),
        };
        let fail = |err: String| (kind, StartFailure::Step(err));
        let (phase, transition) = match kind {
            StartKind::Create => (Phase::Creating, "creating"),
            StartKind::Restore => (Phase::Restoring, "restoring"),
        };
        let _transition = self.metrics.in_transition(sandbox.as_str(), transition);
        let record_phase = self.write_status(sandbox, held.epoch, |status| {
            status.phase = phase;
            status.holder = Some(instance.clone());
        });
        match &source {
            Some(reference) => {
                self.emit(sandbox, SandboxEvent::Restoring);
                // The phase and the manifest at once: one round trip less
                // on the handoff path; nothing is restored before both.
                let (recorded, manifest) =
                    tokio::join!(record_phase, self.load_manifest(reference));
                recorded.map_err(|err| fail(err.to_string()))?;
                let manifest = manifest.map_err(|err| fail(err.to_string()))?;
                self.runtime
                    .restore(sandbox, &manifest)
                    .await
                    .map_err(|err| fail(err.to_string()))?;
            }
            None => {
                record_phase.await.map_err(|err| fail(err.to_string()))?;
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
        let start = match kind {
            StartKind::Create => ColdStart::Created,
            StartKind::Restore => ColdStart::Restored,
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
            return Err((kind, StartFailure::ColdStartHook(err.to_string())));
        }
        self.write_status(sandbox, held.epoch, |status| {
            status.phase = Phase::Running;
            status.holder = Some(instance.clone());
            status.last_error = None;
            self.ready(status, ReadyReason::Running, "");
            if served_request.is_some() {
                status.last_restore_request = served_request;
            }
        })
        .await
        .map_err(|err| fail(err.to_string()))?;
        Ok(kind)
    }

    /// Reads the manifest of a recorded checkpoint and checks it describes
    /// the same image (an operator may have edited the reference).
    pub(super) async fn load_manifest(
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
