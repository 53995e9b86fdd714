//! Commands: how the API and this instance's other loops (the doorbell, the
//! drain, the idle timer, admission's eviction) ask a sandbox's owner for
//! something. Nothing outside a sandbox's own pass writes its
//! `metadata.json` or `lock.json`: a caller puts a [`Command`] in the
//! sandbox's slot, queues the sandbox, and awaits the reply; the pass
//! serves its commands first (their writes, each conditional on what the
//! caller read or this owner wrote), replies, and then decides on what
//! those writes left ([`Served`]). The work queue never runs two passes of
//! one sandbox at once, so a pass never meets a write of its sandbox
//! halfway done, and decides on the objects as its own commands left
//! them, as fresh as a read made at that moment and without one.
//!
//! Two writes may outlast their pass (`docs/handoff.md`, "Commands"): an
//! attach whose lock write took the hold does not wait for its spec write,
//! which GCS's per-object rate can hold up for a second or more, and a
//! checkpoint of a sandbox held here does not wait for its intent's write
//! (the hold is fenced by the lock; the checkpoint is acknowledged once
//! the hand-back that carries it lands). The pass decides on the spec as
//! it is being written; until the write ends, the owner's later passes
//! apply the change to what they read (`Slot::spec_in_flight`, applied in
//! `pass.rs`'s one view), and its end is reported to the pass
//! (`Ended::SpecWritten`), as every task that outlives its pass reports its
//! end ([`Reconciler::report`]).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::oneshot;

use crate::api::{
    DesiredState, RestoreRequest, RungIntent, SandboxId, SandboxMetadata, SandboxSpec, SnapshotRef,
    encode,
};
use crate::layout::metadata_key;
use crate::leasing::LeaseError;
use crate::sandboxes::controller::ControlError;
use crate::store::{Decision, Generation, PutMode, RmwError, StoreError, read_modify_write_from};

use super::{ReadLease, ReadMetadata, ReconcileError, Reconciler, create_options, decode_at};

/// Both objects as an attaching client's instance read them (at once).
#[derive(Debug, Clone)]
pub struct AttachRead {
    pub metadata: ReadMetadata,
    pub lock: Option<ReadLease>,
}

/// Where a command's outcome goes.
pub(crate) type Reply = oneshot::Sender<Result<(), ControlError>>;

/// What a caller asks of a sandbox's owner.
pub(crate) enum Command {
    /// Record a new sandbox (desired running) and run it here.
    Create { metadata: Box<SandboxMetadata> },
    /// Run it here (from the checkpoint named, else the latest), from the
    /// objects the caller read at `at`.
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
    /// The instance shuts down: checkpoint it, delete it if it cannot be,
    /// or let a hand-over under way serve the client waiting elsewhere
    /// (`decision::drain_to`).
    Drain,
    /// Record a filesystem snapshot just taken of it, held here, in
    /// `status.latest_snapshot`.
    RecordSnapshot { snapshot: Box<SnapshotRef> },
    /// This instance's doorbell was rung for it, with the attach intent
    /// the ring carried, if any (decision 27).
    Rung { intent: Option<RungIntent> },
    /// A step that outlived its pass ended (sent by its task,
    /// [`Reconciler::report`]): what it changes here, its pass changes.
    Ended(Box<Ended>),
}

/// The end of a step that outlived its pass.
pub(crate) enum Ended {
    /// The record of the hold at `epoch` (a start's, in a task of its own)
    /// failed with `error`.
    RecordFailed { epoch: u64, error: ReconcileError },
    /// The write of `change` (`Slot::spec_in_flight`), for the intent `what`.
    SpecWritten {
        change: SpecChange,
        outcome: Result<(), ControlError>,
        what: &'static str,
    },
    /// The image the hold at `epoch` is to be handed over with, which the
    /// waiting taker watches for, landed, or its watch ended.
    ImageLanded { epoch: u64 },
}

impl Ended {
    /// Whether the sandbox's pass must run for it now, or may wait for its
    /// next look: a record that failed for any reason but a newer holder's
    /// fence is retried by that look, not at once (a store refusing fast
    /// would otherwise make a record and its report go round and round).
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
    /// Both objects as the commands' writes left them (the spec as it is
    /// being written, while that write is under way): the pass decides on
    /// these instead of reading them.
    pub(super) view: Option<(ReadMetadata, Option<ReadLease>)>,
}

/// A change of a sandbox's spec being written by its owner.
pub(super) type SpecChange = Arc<dyn Fn(&mut SandboxSpec) + Send + Sync>;

impl Reconciler {
    /// Puts `command` in `sandbox`'s slot for its next pass, which answers
    /// on `reply` (the caller queues that pass).
    pub(crate) fn send(&self, sandbox: &SandboxId, command: Command, reply: Option<Reply>) {
        self.slots.update(sandbox, |slot| {
            slot.inbox.push((command, reply));
            slot.full_pass_wanted = true;
        });
    }

    /// Sends `ended` to `sandbox`'s pass, and queues that pass when the end
    /// wants it now ([`Ended::wants_a_pass_now`]; without a controller the
    /// next pass serves it): how a task that outlived its pass reports its
    /// end to the sandbox's owner.
    pub(in crate::sandboxes) fn report(&self, sandbox: &SandboxId, ended: Ended) {
        let now = ended.wants_a_pass_now();
        self.send(sandbox, Command::Ended(Box::new(ended)), None);
        if let Some(queue) = self.wake.get().filter(|_| now) {
            queue.add(sandbox);
        }
    }

    /// How many commands wait for `sandbox`'s next pass.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn commands_waiting(&self, sandbox: &SandboxId) -> usize {
        self.slots.view(sandbox, |slot| slot.inbox.len())
    }

    /// Serves the commands waiting in `sandbox`'s slot, in the order they
    /// came, and replies to each.
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
                    // A hold transferred here after all is then an orphan,
                    // released.
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

    /// Takes up the end of a step that outlived its pass.
    async fn serve_ended(&self, sandbox: &SandboxId, ended: Ended) {
        match ended {
            // This pass is a full one (as for every command), on both
            // objects: a record a newer holder fenced left that holder's
            // epoch in `status`, on which the table stops the hold
            // (`Step::StopLost`); after any other failure it records again.
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
            // Only the wait for that image ends: a wait for a later hold's
            // image has a task of its own.
            Ended::ImageLanded { epoch } => self.slots.update(sandbox, |slot| {
                if let Some(handoff) = slot.state.handoff_mut() {
                    handoff.image_landed(epoch);
                }
            }),
        }
    }

    /// Decides, on both objects, what the drain asks of the sandbox, and
    /// asks it (`decision::drain_to`). Deciding on nothing new leaves the
    /// pass what was read.
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

    /// A create is its own acquisition (decision 18): `metadata.json` and a
    /// `lock.json` held by this instance at epoch 1 are written at once,
    /// each only if absent, while a fresh sandbox's container boots beside
    /// them (decision 23). If a lock exists already (nothing else could
    /// have written one for a fresh id but an operator), the create falls
    /// back to an attach intent.
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

    /// Asks for the sandbox here from the objects the caller read: the spec
    /// and the lock are written at once, each conditional on what was read.
    /// A lock nobody holds or wants is taken in the same write (the pass
    /// adopts it); a held lock is left alone and its holder is rung with
    /// the intent. A hold taken while the spec's write is under way does
    /// not wait for it (decision 21): the pass decides on the spec as it is
    /// being written.
    async fn serve_attach(
        &self,
        read: AttachRead,
        checkpoint: Option<String>,
        at: DateTime<Utc>,
        served: &mut Served,
    ) -> Result<(), ControlError> {
        let sandbox = read.metadata.0.sandbox_id.clone();
        let sandbox = &sandbox;
        let restore_request = checkpoint.map(|name| RestoreRequest {
            checkpoint: name,
            requested_at: at,
        });
        let change = move |spec: &mut SandboxSpec| {
            spec.desired_state = DesiredState::Running;
            if let Some(request) = &restore_request {
                spec.restore_request = Some(request.clone());
            }
        };
        let leases = &self.leases;
        let me = leases.instance().clone();
        self.mark_waiting(sandbox);
        // The metadata as this owner sees it: what it wrote since the
        // caller's read, or is still writing (a checkpoint asked just
        // before), counts.
        let seen = self.as_owner_sees(sandbox, read.metadata.clone());
        let mut intended = seen.clone();
        change(&mut intended.0.spec);
        // The spec already says so (the usual attach to a running
        // sandbox): the holder may decide on what it knows of it.
        let spec_unchanged = intended.0.spec == seen.0.spec;
        let metadata_read = spec_unchanged.then_some(read.metadata.1);
        let free = read.lock.as_ref().is_none_or(|(lease, _)| {
            lease.holder.is_none() && lease.wanted_elsewhere(&me, at).is_none()
        });
        // The lock as it stands after the write: taken, or with the intent
        // written into it, or as read (the intent went by ring alone).
        let lock_write = async {
            if free {
                match leases.acquire_from(sandbox, read.lock.clone()).await {
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
        // This instance is about to hold it: its lease must vouch by then
        // (a no-op when it was renewed lately).
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
        let mut spec_write = self.spawn_spec_write(sandbox, read.metadata.clone(), change.clone());
        tokio::pin!(lock_and_lease);
        let (spec, lock) = tokio::select! {
            spec = &mut spec_write => (Some(spec_written(spec)), (&mut lock_and_lease).await),
            lock = &mut lock_and_lease => (None, lock),
        };
        match (spec, lock) {
            (Some(Ok(written)), Ok(lock)) => {
                served.view = Some((written, lock));
                Ok(())
            }
            // A hold taken for a spec that could not be written is released
            // by the pass (an orphan).
            (Some(Err(err)), _) => Err(err),
            (Some(Ok(_)), Err(err)) => Err(err.into()),
            (None, Ok(lock)) => {
                // The lock write landed; the spec is still on its way. The
                // pass decides on it as being written.
                served.view = Some((intended, lock));
                self.spec_in_flight(sandbox, Arc::new(change), spec_write, "attach");
                Ok(())
            }
            (None, Err(err)) => {
                // As when the spec lands first: its outcome, then the lock's.
                spec_written(spec_write.await)?;
                Err(err.into())
            }
        }
    }

    /// Writes the desired state. A checkpoint of a sandbox held here whose
    /// metadata this instance knows does not wait for its write (decision
    /// 22): the pass decides on it at once. Any other change is written
    /// first; the holder elsewhere, if any, is rung.
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
            let write = self.spawn_spec_write(sandbox, stored, {
                let change = Arc::clone(&change);
                move |spec: &mut SandboxSpec| change(spec)
            });
            self.spec_in_flight(sandbox, change, write, "checkpoint");
            return Ok(());
        }
        served.view = None;
        let written = self.write_spec(sandbox, None, change).await?;
        match held {
            // Held here: the pass decides on what was just written and the
            // lock as this instance holds it (a change since fails the
            // precondition of the pass's next write, which then reads it).
            Some(held) => served.view = Some((written, Some((held.lease, held.generation)))),
            None => self.ring_holder(sandbox).await,
        }
        Ok(())
    }

    /// The doorbell rang for `sandbox`. A ring's attach intent counts in
    /// this instance's reads of the lock from now on; when it came with the
    /// generations its ringer read both objects at, and this instance holds
    /// the sandbox at that lock generation and knows its metadata at least
    /// that new, the pass decides on what it knows (as fresh as the
    /// ringer's read, the intent heard) instead of reading both again: a
    /// round trip off every handoff.
    fn serve_ring(&self, sandbox: &SandboxId, intent: Option<RungIntent>, served: &mut Served) {
        let Some(rung) = intent else {
            return;
        };
        self.leases.hear(sandbox, rung.clone());
        if served.view.is_some() {
            return;
        }
        let (Some(read), Some(held)) = (rung.read, self.held(sandbox)) else {
            return;
        };
        // What the taker read is as fresh as a read of this pass only while
        // nobody else can have written the lock since: while this hold is
        // vouched for. One that lapsed (a freeze) may have been taken over
        // after the ring was sent; the pass reads.
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

    /// Rings the doorbell of `sandbox`'s holder when that is another
    /// instance, so a change written here takes effect there at once.
    /// Failures are logged: the holder's resync catches up.
    async fn ring_holder(&self, sandbox: &SandboxId) {
        match self.leases.read(sandbox).await {
            Ok(Some((lease, _))) => self.leases.ring_holder(sandbox, &lease).await,
            Ok(None) => {}
            Err(err) => tracing::warn!(%sandbox, %err, "cannot read the lock to ring its holder"),
        }
    }

    /// `change` is being written by `write`, which outlasts this pass:
    /// later passes apply it to what they read until the write ends, whose
    /// end is reported to the sandbox's pass (which then reads it landed,
    /// or the spec as stored).
    fn spec_in_flight(
        &self,
        sandbox: &SandboxId,
        change: SpecChange,
        write: tokio::task::JoinHandle<Result<ReadMetadata, ControlError>>,
        what: &'static str,
    ) {
        self.slots.update(sandbox, |slot| {
            slot.spec_in_flight = Some(Arc::clone(&change));
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

    /// [`Self::write_spec`] from `read` in a task of its own.
    fn spawn_spec_write(
        &self,
        sandbox: &SandboxId,
        read: ReadMetadata,
        change: impl FnMut(&mut SandboxSpec) + Send + 'static,
    ) -> tokio::task::JoinHandle<Result<ReadMetadata, ControlError>> {
        let this = self.shared();
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            let this = this
                .ok_or_else(|| ControlError::Internal("the reconciler is not shared".to_owned()))?;
            this.write_spec(&sandbox, Some(&read), change).await
        })
    }

    /// Read-modify-write of the spec under the object's generation,
    /// starting from the newer of `read` and what this instance last read
    /// or wrote of it. Returns the metadata as stored after it.
    pub(super) async fn write_spec(
        &self,
        sandbox: &SandboxId,
        read: Option<&ReadMetadata>,
        mut change: impl FnMut(&mut SandboxSpec),
    ) -> Result<ReadMetadata, ControlError> {
        let key = metadata_key(sandbox);
        let _turn = self.slots.write_turn(sandbox).await;
        // A status write that held the turn before this one may have left
        // a newer generation: starting from the older costs a refused write
        // and a re-read.
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
                // Deletion is final: a checkpoint or attach written after
                // it would bring the sandbox back from its checkpoint.
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

/// The outcome of a spec write that ran in a task of its own.
fn spec_written(
    joined: Result<Result<ReadMetadata, ControlError>, tokio::task::JoinError>,
) -> Result<ReadMetadata, ControlError> {
    joined.unwrap_or_else(|err| {
        Err(ControlError::Internal(format!(
            "the spec write ended abnormally: {err}"
        )))
    })
}
