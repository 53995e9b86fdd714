//! Commands: how the API and this instance's other loops (doorbell, drain, idle timer, admission's
//! eviction) ask a sandbox's owner for something. Only the sandbox's own pass writes its
//! `metadata.json` and `lock.json`: a caller puts a [`Command`] in its slot, queues it and awaits
//! the reply; the pass serves its commands first (each write conditional on what the caller read or
//! this owner wrote), replies, then decides on what they left ([`Served`]): as fresh as a read,
//! since the work queue never runs two passes of one sandbox at once.
//!
//! Two writes may outlast their pass (`docs/handoff.md`, "Commands"): an attach's spec write once
//! its lock write took the hold (GCS's per-object rate can delay it a second or more), and a held
//! sandbox's checkpoint intent (the lock fences the hold; the hand-back carrying the checkpoint
//! acknowledges it). Passes decide on the change as written (`Slot::spec_in_flight`, in `pass.rs`'s
//! one view) until its end is reported (`Ended::SpecWritten`, [`Reconciler::report`]).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::oneshot;

use crate::api::{
    DesiredState, RestoreRequest, RungIntent, SandboxId, SandboxMetadata, SandboxSpec, SnapshotRef,
    encode,
};
use crate::layout::metadata_key;
use crate::leasing::{LeaseError, Recorded};
use crate::sandboxes::controller::ControlError;
use crate::store::{Decision, Generation, PutMode, RmwError, StoreError, read_modify_write_from};

use super::{ReadLease, ReadMetadata, ReconcileError, Reconciler, create_options, decode_at};

/// Both objects as an attaching client's instance read them (at once).
#[derive(Debug, Clone)]
pub struct AttachRead {
    pub metadata: ReadMetadata,
    pub lock: Option<ReadLease>,
}

pub(crate) type Reply = oneshot::Sender<Result<(), ControlError>>;

/// What a caller asks of a sandbox's owner.
pub(crate) enum Command {
    /// Record a new sandbox (desired running) and run it here.
    Create { metadata: Box<SandboxMetadata> },
    /// Run it here from the named checkpoint (else the latest) as read at `at`.
    Attach {
        read: Box<AttachRead>,
        checkpoint: Option<String>,
        at: DateTime<Utc>,
    },
    /// Checkpoint it (under `name`, if given), delete it, or run it.
    Desire {
        desired: DesiredState,
        name: Option<String>,
    },
    /// This instance's client gave up waiting for it.
    Withdraw,
    /// Shutdown: checkpoint it, else delete it, or let a hand-over under way
    /// serve the client waiting elsewhere (`decision::drain_to`).
    Drain,
    /// Record a snapshot just taken of it (held here) as its latest.
    RecordSnapshot { snapshot: Box<SnapshotRef> },
    /// The doorbell rang for it, with its attach intent if any (decision 27).
    Rung { intent: Option<RungIntent> },
    /// A step that outlived its pass ended ([`Reconciler::report`]).
    Ended(Box<Ended>),
}

pub(crate) enum Ended {
    /// A start's record of the hold at `epoch`, in its own task, failed.
    RecordFailed { epoch: u64, error: ReconcileError },
    /// The write of `change` (`Slot::spec_in_flight`), for the intent `what`.
    SpecWritten {
        change: SpecChange,
        outcome: Result<(), ControlError>,
        what: &'static str,
    },
    /// The hand-over image of the hold at `epoch` landed, or its watch ended.
    ImageLanded { epoch: u64 },
}

impl Ended {
    /// Whether the pass must run now: a record not fenced by a newer holder
    /// waits for the next look (a fast-refusing store would loop it).
    fn wants_a_pass_now(&self) -> bool {
        match self {
            Self::RecordFailed { error, .. } => error.is_fenced(),
            Self::SpecWritten { .. } | Self::ImageLanded { .. } => true,
        }
    }
}

/// What serving a pass's commands left for it.
#[derive(Default)]
pub(super) struct Served {
    /// Both objects as the commands left them: the pass decides on these.
    pub(super) view: Option<(ReadMetadata, Option<ReadLease>)>,
}

/// A change of a sandbox's spec being written by its owner.
pub(super) type SpecChange = Arc<dyn Fn(&mut SandboxSpec) + Send + Sync>;

impl Reconciler {
    /// Leaves `command` for `sandbox`'s next pass (the caller queues it).
    pub(crate) fn send(&self, sandbox: &SandboxId, command: Command, reply: Option<Reply>) {
        self.slots.update(sandbox, |slot| {
            slot.inbox.push((command, reply));
            slot.full_pass_wanted = true;
        });
    }

    /// How a task that outlived its pass reports its end: queues the pass if
    /// wanted now ([`Ended::wants_a_pass_now`]) and a controller is set.
    pub(in crate::sandboxes) fn report(&self, sandbox: &SandboxId, ended: Ended) {
        let now = ended.wants_a_pass_now();
        self.send(sandbox, Command::Ended(Box::new(ended)), None);
        if let Some(queue) = self.wake.get().filter(|_| now) {
            queue.add(sandbox);
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn commands_waiting(&self, sandbox: &SandboxId) -> usize {
        self.slots.view(sandbox, |slot| slot.inbox.len())
    }

    /// Serves `sandbox`'s waiting commands in arrival order, replying to each.
    pub(super) async fn serve(&self, sandbox: &SandboxId) -> Served {
        let commands = self
            .slots
            .update(sandbox, |slot| std::mem::take(&mut slot.inbox));
        let mut served = Served::default();
        for (command, reply) in commands {
            let outcome = match command {
                Command::Create { metadata } => self.serve_create(&metadata, &mut served).await,
                Command::Attach {
                    read,
                    checkpoint,
                    at,
                } => self.serve_attach(*read, checkpoint, at, &mut served).await,
                Command::Desire { desired, name } => {
                    self.serve_desire(sandbox, desired, name, &mut served).await
                }
                Command::Withdraw => {
                    // A hold transferred here anyway is an orphan, released.
                    self.take_waiting(sandbox);
                    served.view = None;
                    self.leases
                        .withdraw_attach(sandbox)
                        .await
                        .map_err(Into::into)
                }
                Command::Drain => self.serve_drain(sandbox, &mut served).await,
                Command::RecordSnapshot { snapshot } => {
                    // The status moves on: the pass reads what it decides on.
                    served.view = None;
                    self.record_snapshot(sandbox, *snapshot).await
                }
                Command::Rung { intent } => {
                    self.serve_ring(sandbox, intent, &mut served);
                    Ok(())
                }
                Command::Ended(ended) => {
                    self.serve_ended(sandbox, *ended).await;
                    Ok(())
                }
            };
            if let Some(reply) = reply {
                let _ = reply.send(outcome);
            }
        }
        served
    }

    async fn serve_ended(&self, sandbox: &SandboxId, ended: Ended) {
        match ended {
            // A full pass: a fenced record left the newer holder's epoch in
            // `status` (so `Step::StopLost`); any other failure records again.
            Ended::RecordFailed { epoch, error } => {
                tracing::warn!(%sandbox, epoch, %error, "a start's record failed; this pass decides on both objects");
            }
            Ended::SpecWritten {
                change,
                outcome,
                what,
            } => {
                if let Err(err) = outcome {
                    tracing::warn!(%sandbox, %err, intent = what, "the intent was not written; this pass reads the stored spec");
                }
                self.slots.update(sandbox, |slot| {
                    if slot
                        .spec_in_flight
                        .as_ref()
                        .is_some_and(|current| Arc::ptr_eq(current, &change))
                    {
                        slot.spec_in_flight = None;
                    }
                });
            }
            // Only that image's wait ends: a later hold's has its own task.
            Ended::ImageLanded { epoch } => self.slots.update(sandbox, |slot| {
                if let Some(handoff) = slot.state.handoff_mut() {
                    handoff.image_landed(epoch);
                }
            }),
        }
    }

    /// Asks what `decision::drain_to` picks, if anything (else keeps the read).
    async fn serve_drain(
        &self,
        sandbox: &SandboxId,
        served: &mut Served,
    ) -> Result<(), ControlError> {
        let (metadata, lock) = self.observe(sandbox, served.view.take()).await;
        let (metadata, lock) = (metadata.ok().flatten(), lock.ok().flatten());
        let desired = crate::sandboxes::decision::drain_to(
            self.leases.instance(),
            metadata.as_ref().map(|(metadata, _)| metadata),
            lock.as_ref().map(|(lease, _)| lease),
            self.clock.now(),
        );
        match desired {
            Some(desired) => self.serve_desire(sandbox, desired, None, served).await,
            None => {
                served.view = metadata.map(|metadata| (metadata, lock));
                Ok(())
            }
        }
    }

    /// Records `snapshot` as the sandbox's latest, fenced by its hold here.
    async fn record_snapshot(
        &self,
        sandbox: &SandboxId,
        snapshot: SnapshotRef,
    ) -> Result<(), ControlError> {
        let held = self
            .held(sandbox)
            .ok_or_else(|| ControlError::NotHere(sandbox.clone()))?;
        self.write_status(sandbox, held.epoch, |status| {
            status.latest_snapshot = Some(snapshot.clone());
        })
        .await?;
        Ok(())
    }

    /// A create is its own acquisition (decision 18): `metadata.json` and a `lock.json` held here
    /// at epoch 1 are written at once, each if absent, as a fresh container boots (decision 23); an
    /// existing lock (only an operator's, for a fresh id) turns it into an attach intent.
    async fn serve_create(
        &self,
        metadata: &SandboxMetadata,
        served: &mut Served,
    ) -> Result<(), ControlError> {
        let sandbox = &metadata.sandbox_id;
        let boots = metadata.status.latest_checkpoint.is_none();
        let options = create_options(&metadata.spec);
        let prepared = async {
            if boots {
                self.runtime.prepare_create(sandbox, &options).await;
            }
        };
        let key = metadata_key(sandbox);
        let (written, held, ()) = tokio::join!(
            self.metadata.put(&key, encode(metadata), PutMode::Create),
            self.leases.create_held(sandbox),
            prepared
        );
        if !matches!((&written, &held), (Ok(_), Ok(Some(_)))) {
            self.runtime.forget_prepared(sandbox);
        }
        let generation = match written {
            Ok(generation) => generation,
            Err(err) => {
                if let Ok(Some(held)) = &held
                    && let Err(release) = self.leases.release(held).await
                {
                    tracing::warn!(%sandbox, %release, "cannot release the lock of a create that failed");
                }
                return Err(match err {
                    StoreError::PreconditionFailed { .. } => {
                        ControlError::AlreadyExists(sandbox.clone())
                    }
                    err => err.into(),
                });
            }
        };
        self.remember_metadata(sandbox, metadata, generation);
        match held? {
            Some(held) => {
                self.mark_waiting(sandbox);
                served.view = Some((
                    (metadata.clone(), generation),
                    Some((held.lease, held.generation)),
                ));
            }
            None => {
                served.view = None;
                self.leases.request_attach(sandbox).await?;
            }
        }
        Ok(())
    }

    /// Asks for the sandbox here: spec and lock are written at once, each conditional on the
    /// caller's read. A lock nobody holds or wants is taken (the pass adopts it), else its holder
    /// is rung with the intent; a hold taken does not wait for the spec's write (decision 21).
    async fn serve_attach(
        &self,
        read: AttachRead,
        checkpoint: Option<String>,
        at: DateTime<Utc>,
        served: &mut Served,
    ) -> Result<(), ControlError> {
        let sandbox = &read.metadata.0.sandbox_id.clone();
        let restore_request = checkpoint.map(|name| RestoreRequest {
            checkpoint: name,
            requested_at: at,
        });
        let change: SpecChange = Arc::new(move |spec: &mut SandboxSpec| {
            spec.desired_state = DesiredState::Running;
            if let Some(request) = &restore_request {
                spec.restore_request = Some(request.clone());
            }
        });
        let leases = &self.leases;
        let me = leases.instance().clone();
        self.mark_waiting(sandbox);
        // As this owner sees it: its writes since the caller's read count, even one under way.
        let seen = self.as_owner_sees(sandbox, read.metadata.clone());
        let mut intended = seen.clone();
        change(&mut intended.0.spec);
        // Spec unchanged (the usual attach): the holder may use what it knows.
        let spec_unchanged = intended.0.spec == seen.0.spec;
        let metadata_read = spec_unchanged.then_some(read.metadata.1);
        let free = read.lock.as_ref().is_none_or(|(lease, _)| {
            lease.holder.is_none() && lease.wanted_elsewhere(&me, at).is_none()
        });
        let latest = seen.0.status.latest_checkpoint.clone();
        // The lock after: taken, with the intent in it, or as read (ring only).
        let lock_write = async {
            if free {
                match leases
                    .acquire_from(
                        sandbox,
                        read.lock.clone(),
                        Recorded::Latest(latest.as_ref()),
                    )
                    .await
                {
                    Ok(held) => return Ok(Some((held.lease, held.generation))),
                    Err(LeaseError::HeldByOther { .. } | LeaseError::WantedByOther { .. }) => {}
                    Err(err) => return Err(err),
                }
            }
            let (_, written) = leases
                .request_attach_writing(sandbox, read.lock.clone(), metadata_read)
                .await?;
            Ok(written.or_else(|| read.lock.clone()))
        };
        // About to hold it: its lease must vouch by then (no-op if fresh).
        let lock_and_lease = async {
            let (lock, ensured) = tokio::join!(lock_write, leases.ensure_instance_lease());
            if let Err(err) = ensured {
                tracing::warn!(%sandbox, %err, "cannot renew the instance lease before a start");
            }
            lock
        };
        served.view = None;
        if spec_unchanged {
            served.view = Some((intended, lock_and_lease.await?));
            return Ok(());
        }
        let mut spec_write = self.spawn_spec_write(sandbox, read.metadata.clone(), &change);
        tokio::pin!(lock_and_lease);
        let (spec, lock) = tokio::select! {
            spec = &mut spec_write => (Some(spec_written(spec)), (&mut lock_and_lease).await),
            lock = &mut lock_and_lease => (None, lock),
        };
        match (spec, lock) {
            (Some(Ok(written)), Ok(lock)) => {
                self.spec_landed(sandbox);
                served.view = Some((written, lock));
                Ok(())
            }
            // The pass releases a hold taken for an unwritten spec (orphan).
            (Some(Err(err)), _) => Err(err),
            (Some(Ok(_)), Err(err)) => Err(err.into()),
            (None, Ok(lock)) => {
                // The lock write landed; the spec is still being written.
                served.view = Some((intended, lock));
                self.spec_in_flight(sandbox, change, spec_write, "attach");
                Ok(())
            }
            (None, Err(err)) => {
                // As when the spec lands first: its outcome, then the lock's.
                spec_written(spec_write.await)?;
                Err(err.into())
            }
        }
    }

    /// Writes the desired state, then rings a holder elsewhere; a checkpoint
    /// of a sandbox held here, metadata known, does not wait (decision 22).
    async fn serve_desire(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
        name: Option<String>,
        served: &mut Served,
    ) -> Result<(), ControlError> {
        let change = move |spec: &mut SandboxSpec| {
            spec.desired_state = desired;
            if desired == DesiredState::Checkpointed {
                spec.checkpoint_name.clone_from(&name);
            }
        };
        let held = self.held(sandbox);
        let known = self.known_read(sandbox, Generation(0));
        if desired == DesiredState::Checkpointed
            && let Some(held) = &held
            && let Some(stored) = known.filter(|(stored, _)| !stored.is_deleted())
        {
            let mut intended = stored.clone();
            change(&mut intended.0.spec);
            served.view = Some((intended, Some((held.lease.clone(), held.generation))));
            let change: SpecChange = Arc::new(change);
            let write = self.spawn_spec_write(sandbox, stored, &change);
            self.spec_in_flight(sandbox, change, write, "checkpoint");
            return Ok(());
        }
        served.view = None;
        let written = self.write_spec(sandbox, None, change).await?;
        self.spec_landed(sandbox);
        match held {
            // Held here: the pass decides on this and the lock as held (a
            // change since fails its next write's precondition; it re-reads).
            Some(held) => served.view = Some((written, Some((held.lease, held.generation)))),
            None => self.ring_holder(sandbox).await,
        }
        Ok(())
    }

    /// The doorbell rang: its attach intent counts in lock reads from now on. If the ringer read
    /// this hold's lock generation and metadata this instance knows (or older), the pass decides on
    /// what it knows without re-reading: a round trip off every handoff.
    fn serve_ring(&self, sandbox: &SandboxId, intent: Option<RungIntent>, served: &mut Served) {
        let Some(rung) = intent else { return };
        self.leases.hear(sandbox, rung.clone());
        if served.view.is_some() {
            return;
        }
        let (Some(read), Some(held)) = (rung.read, self.held(sandbox)) else {
            return;
        };
        // The taker's read stands for this pass's only while this hold is
        // vouched for: a lapsed one (a freeze) may have been taken over since.
        if held.epoch != rung.epoch
            || held.generation != Generation(read.lock)
            || !self.leases.is_safe(&held)
        {
            return;
        }
        if let Some(known) = self.known_read(sandbox, Generation(read.metadata)) {
            served.view = Some((known, Some((held.lease, held.generation))));
        }
    }

    /// Rings `sandbox`'s holder if another instance, so a change written here
    /// applies at once; failures are logged (its resync catches up).
    async fn ring_holder(&self, sandbox: &SandboxId) {
        match self.leases.read(sandbox).await {
            Ok(Some((lease, _))) => self.leases.ring_holder(sandbox, &lease).await,
            Ok(None) => {}
            Err(err) => tracing::warn!(%sandbox, %err, "cannot read the lock to ring its holder"),
        }
    }

    /// Marks `change` in flight (module docs) until `write` reports its end. A change still in
    /// flight from before is kept, applied first: its write had its turn first.
    fn spec_in_flight(
        &self,
        sandbox: &SandboxId,
        change: SpecChange,
        write: tokio::task::JoinHandle<Result<ReadMetadata, ControlError>>,
        what: &'static str,
    ) {
        let change = self.slots.update(sandbox, |slot| {
            let change: SpecChange = match slot.spec_in_flight.take() {
                Some(earlier) => Arc::new(move |spec: &mut SandboxSpec| {
                    earlier(spec);
                    change(spec);
                }),
                None => change,
            };
            slot.spec_in_flight = Some(Arc::clone(&change));
            change
        });
        let sandbox = sandbox.clone();
        drop(self.spawn_shared(move |me| async move {
            let outcome = spec_written(write.await).map(drop);
            me.report(
                &sandbox,
                Ended::SpecWritten {
                    change,
                    outcome,
                    what,
                },
            );
            Ok(())
        }));
    }

    /// A spec write this pass awaited landed: every change in flight was issued before it (the
    /// pass serves one command at a time) and had its turn first, so none is in flight any more.
    fn spec_landed(&self, sandbox: &SandboxId) {
        self.slots
            .update(sandbox, |slot| slot.spec_in_flight = None);
    }

    fn spawn_spec_write(
        &self,
        sandbox: &SandboxId,
        read: ReadMetadata,
        change: &SpecChange,
    ) -> tokio::task::JoinHandle<Result<ReadMetadata, ControlError>> {
        let (this, change) = (self.shared(), Arc::clone(change));
        let sandbox = sandbox.clone();
        // In the queue before the task runs: writes land in the order issued.
        let turn = self.slots.queue_for_write_turn(&sandbox);
        tokio::spawn(async move {
            let this = this
                .ok_or_else(|| ControlError::Internal("the reconciler is not shared".to_owned()))?;
            this.write_spec_in_turn(turn, &sandbox, Some(&read), |spec| change(spec))
                .await
        })
    }

    /// Read-modify-write of the spec, from the newer of `read` and what this
    /// instance last read or wrote; returns the metadata as stored after.
    pub(super) async fn write_spec(
        &self,
        sandbox: &SandboxId,
        read: Option<&ReadMetadata>,
        change: impl FnMut(&mut SandboxSpec),
    ) -> Result<ReadMetadata, ControlError> {
        let turn = self.slots.queue_for_write_turn(sandbox);
        self.write_spec_in_turn(turn, sandbox, read, change).await
    }

    /// [`Self::write_spec`] in `turn` (taken when the write was issued).
    async fn write_spec_in_turn(
        &self,
        turn: super::slots::WriteTurn,
        sandbox: &SandboxId,
        read: Option<&ReadMetadata>,
        mut change: impl FnMut(&mut SandboxSpec),
    ) -> Result<ReadMetadata, ControlError> {
        let key = metadata_key(sandbox);
        let _turn = turn.wait().await;
        // An earlier status write may have left a newer generation; starting
        // from the older costs a refused write and a re-read.
        let written_here = self.slots.known(sandbox);
        let known = match read {
            Some((metadata, generation))
                if written_here
                    .as_ref()
                    .is_none_or(|known| known.generation <= *generation) =>
            {
                Some(crate::store::Versioned {
                    data: encode(metadata),
                    generation: *generation,
                })
            }
            _ => written_here,
        };
        let outcome = read_modify_write_from(self.metadata.as_ref(), &key, known, |current| {
            let current = current.ok_or_else(|| ControlError::NotFound(sandbox.clone()))?;
            let mut metadata: SandboxMetadata = decode_at(&key, &current.data)?;
            let before = metadata.spec.clone();
            let deleted = metadata.is_deleted();
            change(&mut metadata.spec);
            if metadata.spec == before {
                return Ok(Decision::Keep(metadata));
            }
            if deleted && metadata.spec.desired_state != DesiredState::Deleted {
                // Deletion is final: a later checkpoint or attach would revive it.
                return Err(ControlError::Deleted(sandbox.clone()));
            }
            Ok(Decision::Write(encode(&metadata), metadata))
        })
        .await;
        match outcome {
            Ok((metadata, Some(generation))) => {
                self.remember_metadata(sandbox, &metadata, generation);
                Ok((metadata, generation))
            }
            Ok((_, None)) => Err(ControlError::NotFound(sandbox.clone())),
            Err(RmwError::Rejected(err)) => Err(err),
            Err(RmwError::Store(err)) => Err(err.into()),
            Err(RmwError::Contended { key, .. }) => Err(ControlError::Contended(key)),
        }
    }
}

fn spec_written(
    joined: Result<Result<ReadMetadata, ControlError>, tokio::task::JoinError>,
) -> Result<ReadMetadata, ControlError> {
    joined.unwrap_or_else(|err| {
        Err(ControlError::Internal(format!(
            "the spec write ended abnormally: {err}"
        )))
    })
}
