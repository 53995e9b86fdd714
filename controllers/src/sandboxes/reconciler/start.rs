//! Starting a sandbox here: tell a waiting client it is unwanted, re-ring a slow holder, acquire
//! the lease, restore the requested or latest checkpoint (manifest checked) or create it.

use std::time::Duration;

use super::checkpoint::{record_carried, unreferenced};
use super::commands::Ended;
use super::slots::{LocalState, OnDrop, Slots};
use super::*;
use crate::runtime::ImageLanded;

/// How often an instance waiting for a sandbox rings its holder again.
const RERING_INTERVAL: Duration = Duration::from_secs(5);

/// A start in flight: [`LocalState::Starting`] until it takes the hold up; dropped before (failure,
/// early return, pass cancelled), back to the state it started from (`LocalState::start_ended`).
fn begin_start(slots: &Slots, sandbox: &SandboxId) -> OnDrop {
    slots.update(sandbox, |slot| slot.step(|state| (state.begin_start(), ())));
    slots.on_drop(sandbox, |slot| slot.step(|state| (state.start_ended(), ())))
}

impl Reconciler {
    /// Desired running, not wanted here: a client here still waiting (its
    /// intent replaced or expired) is told now, not left waiting.
    pub(super) fn tell_waiter_not_wanted(&self, sandbox: &SandboxId, lease: Option<&Lease>) {
        let now = self.clock.now();
        if self.take_waiting(sandbox).is_some() {
            // A live intent won, or the holder passed it on (decision 27).
            let elsewhere = lease.and_then(|l| {
                l.live_intent(now)
                    .map(|intent| intent.instance.clone())
                    .or_else(|| {
                        l.holder
                            .clone()
                            .filter(|_| self.leases.own_intent_spent(sandbox, l))
                    })
            });
            let cause = match elsewhere {
                Some(instance) => StartFailure::WantedElsewhere(instance),
                None => StartFailure::IntentExpired,
            };
            self.restore_failed(sandbox, cause);
        }
    }

    /// Starts nothing while draining (`Step::ShuttingDown`): tells a client waiting here, gives
    /// back a hold transferred here (its checkpoint stays in the lock) or withdraws the intent.
    pub(super) async fn refuse_while_draining(
        &self,
        sandbox: &SandboxId,
        release: Option<u64>,
    ) -> Result<Requeue, ReconcileError> {
        if self.take_waiting(sandbox).is_some() {
            self.done_acquiring(sandbox);
            self.restore_failed(sandbox, StartFailure::ShuttingDown);
        }
        match release {
            Some(epoch) => {
                tracing::info!(%sandbox, epoch, "shutting down: giving back a hold transferred here");
                self.leases.release_and_withdraw(sandbox, epoch).await?;
            }
            None => self.leases.withdraw_attach(sandbox).await?,
        }
        Ok(Requeue::Never)
    }

    /// Desired running here, held by another live holder, which hands it over naming this instance
    /// (the next pass adopts it). Tells the client once, re-rings every [`RERING_INTERVAL`] lest a
    /// ring was lost; look again soon, or later until the hand-over image lands (decision 29).
    pub(super) async fn await_handover(
        &self,
        sandbox: &SandboxId,
        holder: &crate::api::InstanceId,
        lease: Option<&Lease>,
    ) -> Duration {
        self.note_acquiring(sandbox);
        let now = self.clock.now();
        let due = self.slots.update(sandbox, |slot| {
            slot.state
                .handoff_mut()
                .is_some_and(|handoff| handoff.ring_due(now, chrono_duration(RERING_INTERVAL)))
        });
        let mut next = self.config.acquire_poll;
        if let Some(lease) = lease
            && lease.wanted_by_me(self.leases.instance(), now)
        {
            // The image the holder will hand over with (decision 24).
            let id = handoff_checkpoint_id(sandbox, lease.epoch, self.leases.instance());
            if let Some(landed) = self
                .runtime
                .prefetch_checkpoint(sandbox, &checkpoint_image_key(&id))
            {
                self.wake_when_landed(sandbox, lease.epoch, landed);
                next = self.config.await_image_poll;
            }
        }
        if due && let Some(lease) = lease {
            tracing::debug!(%sandbox, %holder, "ringing the holder again");
            self.leases.ring_holder(sandbox, lease).await;
        }
        next
    }

    /// Wakes the pass when the hold at `epoch`'s hand-over image lands (one wait per image; the
    /// runtime's watch has its own limit). Not a background step: drains, tests don't await it.
    fn wake_when_landed(&self, sandbox: &SandboxId, epoch: u64, landed: ImageLanded) {
        let Some(me) = self.shared.get().filter(|_| self.wake.get().is_some()) else {
            return;
        };
        let me = me.clone();
        // Only while waiting to acquire (see `await_handover`), once per image.
        let fresh = self.slots.update(sandbox, |slot| {
            slot.state
                .handoff_mut()
                .is_some_and(|handoff| handoff.await_image(epoch))
        });
        if !fresh {
            return;
        }
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            landed.await;
            if let Some(me) = me.upgrade() {
                me.report(&sandbox, Ended::ImageLanded { epoch });
            }
        });
    }

    /// Notes the wait to acquire, telling the client `LOCK_ACQUIRING` once.
    fn note_acquiring(&self, sandbox: &SandboxId) {
        let first = self
            .slots
            .update(sandbox, |slot| slot.step(LocalState::wait_to_acquire));
        if first {
            self.emit(sandbox, SandboxEvent::LeaseAcquiring);
        }
    }

    fn done_acquiring(&self, sandbox: &SandboxId) {
        self.slots.update(sandbox, |slot| {
            slot.step(|state| (state.done_acquiring(), ()))
        });
    }

    /// Wanted here, the lock free or expired: acquire it (as read), then start.
    pub(super) async fn acquire_and_start(
        &self,
        sandbox: &SandboxId,
        metadata: SandboxMetadata,
        lock: Option<ReadLease>,
    ) -> Result<Requeue, ReconcileError> {
        self.note_acquiring(sandbox);
        let starting = begin_start(&self.slots, sandbox);
        // Its holder died holding it: it may have run it without recording so.
        let holder_died = lock.as_ref().is_some_and(|(lease, _)| {
            lease.holder.is_some() && !lease.is_held_by(self.leases.instance())
        });
        // A lock this version released carries its checkpoint, so this pass's read suffices (the
        // newer is restored); one without (by hand, older versions) may postdate it: read again,
        // after the lock (read before the write, which names what it took over).
        let metadata = if lock
            .as_ref()
            .is_some_and(|(lease, _)| lease.checkpoint.is_some())
        {
            metadata
        } else {
            match self.read_metadata(sandbox).await {
                Ok(Some((fresh, _))) => fresh,
                Ok(None) => {
                    self.done_acquiring(sandbox);
                    return Ok(Requeue::Never);
                }
                Err(err) => {
                    self.done_acquiring(sandbox);
                    return Err(err);
                }
            }
        };
        let recorded = Recorded::Latest(metadata.status.latest_checkpoint.as_ref());
        let held = match self
            .leases
            .acquire_from(sandbox, lock.clone(), recorded)
            .await
        {
            Ok(held) => held,
            Err(LeaseError::HeldByOther { holder, .. }) => {
                // Holder live after all: await its hand-over (or expiry).
                drop(starting);
                let lease = lock.map(|(lease, _)| lease);
                let next = self.await_handover(sandbox, &holder, lease.as_ref()).await;
                return Ok(Requeue::After(next));
            }
            Err(LeaseError::WantedByOther { instance, .. }) => {
                self.done_acquiring(sandbox);
                self.restore_failed(sandbox, StartFailure::WantedElsewhere(instance));
                return Ok(Requeue::Never);
            }
            Err(err) => {
                self.done_acquiring(sandbox);
                return Err(err.into());
            }
        };
        self.start_held(sandbox, &metadata, held, holder_died, starting)
            .await
    }

    /// The lock names this instance and a client here waits (a transfer, or
    /// a create or attach here that took the hold in its write): start it.
    pub(super) async fn adopt_and_start(
        &self,
        sandbox: &SandboxId,
        metadata: SandboxMetadata,
        (lease, generation): ReadLease,
    ) -> Result<Requeue, ReconcileError> {
        self.note_acquiring(sandbox);
        let starting = begin_start(&self.slots, sandbox);
        let adopted = self.leases.adopt(sandbox, &lease, generation).await;
        let held = adopted.inspect_err(|_| self.done_acquiring(sandbox))?;
        self.start_held(sandbox, &metadata, held, false, starting)
            .await
    }

    /// Starts it under `held`, tells the client, only then records it in
    /// `status` (the lock's epoch already fences the hold: bookkeeping).
    async fn start_held(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: HeldLease,
        holder_died: bool,
        _starting: OnDrop,
    ) -> Result<Requeue, ReconcileError> {
        self.done_acquiring(sandbox);
        self.emit(sandbox, SandboxEvent::LeaseAcquired);
        let waited_since = self.take_waiting(sandbox);
        let started = self.clock.instant();
        let outcome = self.start(sandbox, metadata, &held, holder_died).await;
        match &outcome {
            Ok((StartKind::Create, ..)) => crate::sandboxes::Metrics::add(&self.metrics.creates, 1),
            Ok((StartKind::Restore, ..)) => {
                self.metrics
                    .restore_seconds
                    .observe(self.clock.instant().duration_since(started));
                if let Some(since) = waited_since {
                    let waited = (self.clock.now() - since).to_std().unwrap_or_default();
                    self.metrics.handoff_in_seconds.observe(waited);
                }
            }
            Err(_) => crate::sandboxes::Metrics::add(&self.metrics.failures, 1),
        }
        match outcome {
            Ok((_, served_request, hooks)) => {
                let watch = Watch {
                    last_full_pass: self.clock.now(),
                    detached_since: None,
                    last_active: None,
                    checkpointable: metadata.spec.enable_checkpoint,
                    last_checkpoint: self.clock.now(),
                };
                self.slots.update(sandbox, |slot| {
                    slot.step(|_| (LocalState::hold(held.clone(), watch, hooks), ()));
                });
                self.emit(sandbox, SandboxEvent::Running { epoch: held.epoch });
                // Recorded after RUNNING, in its own task: GCS's per-object write rate can delay it
                // a second or more, and the next pass (a handoff's checkpoint) must not wait.
                let lock = Some(held.lease.clone());
                self.record_running_in_background(sandbox, &held, lock, served_request);
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
                // A failed restore keeps the checkpoint for the next attach.
                let ended = match kind {
                    StartKind::Create => (Phase::Failed, ReadyReason::Failed),
                    StartKind::Restore => (previous_phase, ReadyReason::RestoreFailed),
                };
                let recorded = self
                    .record_stopped(sandbox, held.epoch, ended, Some(&message))
                    .await;
                if let Err(err) = self.leases.release_and_withdraw(sandbox, held.epoch).await {
                    tracing::warn!(%sandbox, %err, "cannot release the lease after a failed start");
                }
                self.emit(sandbox, SandboxEvent::StartFailed { kind, cause });
                recorded.map(|_| Requeue::Never)
            }
        }
    }

    /// Records it running at `held`'s epoch, restore request served, with the lock's checkpoint if
    /// newer than `status`'s (the last holder's record may be missing or postdate the read).
    pub(super) async fn record_running(
        &self,
        sandbox: &SandboxId,
        held: &HeldLease,
        lock: Option<&Lease>,
        served_request: Option<DateTime<Utc>>,
    ) -> Result<(), ReconcileError> {
        let instance = self.leases.instance().clone();
        let keep = self.config.keep_checkpoints;
        let mut superseded = Vec::new();
        let written = self
            .write_status(sandbox, held.epoch, |status| {
                // This hold's checkpoint was recorded first: the phase stays.
                let ended = status.phase == Phase::Checkpointed
                    && status
                        .latest_checkpoint
                        .as_ref()
                        .is_some_and(|latest| latest.epoch == held.epoch);
                if !ended {
                    status.phase = Phase::Running;
                    status.holder = Some(instance.clone());
                    status.last_error = None;
                    status.set_ready(ReadyReason::Running, "", self.clock.now());
                }
                if served_request.is_some() {
                    status.last_restore_request = served_request;
                }
                if let Some(lock) = lock {
                    superseded = record_carried(status, lock, keep);
                }
            })
            .await?;
        self.delete_checkpoints(&unreferenced(superseded, &written.status))
            .await;
        Ok(())
    }

    /// [`Self::record_running`] in its own task, unless one for that hold runs.
    pub(super) fn record_running_in_background(
        &self,
        sandbox: &SandboxId,
        held: &HeldLease,
        lock: Option<Lease>,
        served_request: Option<DateTime<Utc>>,
    ) {
        let epoch = held.epoch;
        let fresh = self
            .slots
            .update(sandbox, |slot| slot.recording.insert(epoch));
        if !fresh {
            return;
        }
        let recording = self.slots.on_drop(sandbox, move |slot| {
            slot.recording.remove(&epoch);
        });
        let (sandbox, held) = (sandbox.clone(), held.clone());
        drop(self.spawn_shared(move |me| async move {
            let outcome = me
                .record_running(&sandbox, &held, lock.as_ref(), served_request)
                .await;
            drop(recording);
            if let Err(error) = outcome {
                me.report(&sandbox, Ended::RecordFailed { epoch, error });
            }
            Ok(())
        }));
    }

    /// Restores the requested named checkpoint, else the newer of the lock's and `status`'s latest
    /// (the lock's manifest if it is that one's: no read), or creates one never recorded running,
    /// unless `holder_died`: the dead holder may have said RUNNING before its record landed, and a
    /// fresh sandbox would hide the loss. Returns kind, request served, hooks.
    pub(super) async fn start(
        &self,
        sandbox: &SandboxId,
        metadata: &SandboxMetadata,
        held: &HeldLease,
        holder_died: bool,
    ) -> Result<(StartKind, Option<DateTime<Utc>>, Option<HookBinding>), (StartKind, StartFailure)>
    {
        let restore_request = metadata
            .spec
            .restore_request
            .as_ref()
            .filter(|r| metadata.status.last_restore_request != Some(r.requested_at));
        // With the lock's checkpoint when its record has not landed yet: the
        // client heard CHECKPOINTED and may ask for it by name at once.
        let mut status = metadata.status.clone();
        record_carried(&mut status, &held.lease, usize::MAX);
        let source = match restore_request {
            Some(request) => match status.named_checkpoints.remove(&request.checkpoint) {
                Some(found) => Some(found),
                None => {
                    return Err((
                        StartKind::Restore,
                        StartFailure::NoNamedCheckpoint(request.checkpoint.clone()),
                    ));
                }
            },
            None => status.latest_checkpoint,
        };
        let served_request = restore_request.map(|r| r.requested_at);
        let kind = match (&source, metadata.status.phase) {
            (Some(_), _) => StartKind::Restore,
            (None, Phase::Pending | Phase::Creating) if !holder_died => StartKind::Create,
            (None, Phase::Failed) => {
                let cause = metadata
                    .status
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "no cause was recorded".to_owned());
                return Err((
                    StartKind::Restore,
                    StartFailure::FailedWithoutCheckpoint(cause),
                ));
            }
            (None, _) => return Err((StartKind::Restore, StartFailure::NoCheckpoint)),
        };
        let fail = |err: String| (kind, StartFailure::Step(err));
        let (transition, start) = match kind {
            StartKind::Create => ("creating", ColdStart::Created),
            StartKind::Restore => ("restoring", ColdStart::Restored),
        };
        let _transition = self.slots.in_transition(sandbox, transition);
        let started = match &source {
            Some(reference) => {
                // Traces a lost state that came back to the checkpoint (and epoch) restored.
                tracing::info!(%sandbox, epoch = held.epoch, checkpoint = %reference.path, checkpoint_epoch = reference.epoch, "restoring");
                self.emit(sandbox, SandboxEvent::Restoring);
                let carried = held
                    .lease
                    .carried_manifest()
                    .filter(|manifest| manifest.image.key == reference.path);
                let manifest = match carried {
                    Some(manifest) => manifest.clone(),
                    None => self
                        .load_manifest(reference)
                        .await
                        .map_err(|err| fail(err.to_string()))?,
                };
                self.runtime.restore(sandbox, &manifest).await
            }
            None => {
                let options = create_options(&metadata.spec);
                self.runtime.create(sandbox, &options).await
            }
        };
        started.map_err(|err| fail(err.to_string()))?;
        let hooked = self.hooks.on_cold_start(sandbox, &metadata.spec, start);
        match hooked.await {
            Ok(hooks) => Ok((kind, served_request, hooks)),
            Err(err) => {
                if let Err(destroy) = self.runtime.destroy(sandbox).await {
                    tracing::warn!(%sandbox, %destroy, "cannot destroy a sandbox whose cold start hook failed");
                }
                Err((kind, StartFailure::ColdStartHook(err.to_string())))
            }
        }
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
        let manifest: CheckpointManifest = decode_at(&key, &object.data)?;
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

pub(crate) fn create_options(spec: &crate::api::SandboxSpec) -> CreateOptions {
    CreateOptions {
        snapshot_name: spec.filesystem_snapshot_name.clone(),
        network: spec.network,
        image: spec.image.clone(),
    }
}
