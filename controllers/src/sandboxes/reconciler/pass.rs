//! One pass for one sandbox: first the commands callers left for it (`commands.rs`), then one step:
//! a light pass for a held sandbox nothing happened to (lease upkeep; in the minute after its
//! client left, the departure watch's read of both objects), else a full pass (what it decides on,
//! [`Reconciler::observe`]; the table's one step, performed).

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::commands::Served;
use super::hold::Reverified;
use super::*;
use crate::sandboxes::decision::{LightStep, Quiet, decide_light};

/// Both objects as a pass decides on them: as its commands left them or read.
type View = (ReadMetadata, Option<ReadLease>);

/// How many times one pass drops a read for a command that came meanwhile.
const GIVE_WAY_AT_MOST: u32 = 4;

/// What a light pass leaves for the rest of the pass.
enum Light {
    /// Upkeep done; look again then.
    Done(Requeue),
    /// A command came while it read: serve it first.
    Commanded,
    /// Something changed or is due: a full pass (on both objects, if read).
    Full(Option<Box<View>>),
}

impl Reconciler {
    /// One step toward `sandbox`'s desired state (module docs).
    #[tracing::instrument(skip(self), fields(instance = %self.leases.instance()))]
    pub async fn reconcile(&self, sandbox: &SandboxId) -> Result<Requeue, ReconcileError> {
        let mut rounds = 0_u32;
        loop {
            let give_way = rounds < GIVE_WAY_AT_MOST;
            rounds = rounds.saturating_add(1);
            let Served { view } = self.serve(sandbox).await;
            let full_pass_wanted = self.take_full_pass_wanted(sandbox);
            let light = match self.held_and_watch(sandbox) {
                Some((held, watch)) if view.is_none() => {
                    self.light_pass(sandbox, full_pass_wanted, held, watch, give_way)
                        .await?
                }
                _ => Light::Full(view.map(Box::new)),
            };
            let view = match light {
                Light::Done(requeue) => return Ok(requeue),
                Light::Commanded => continue,
                Light::Full(view) => view.map(|view| *view),
            };
            let Some(outcome) = self.full_pass(sandbox, view, give_way).await.transpose() else {
                continue;
            };
            let now = self.clock.now();
            self.update_watch(sandbox, |watch| watch.last_full_pass = now);
            return outcome;
        }
    }

    /// `read`, unless a command comes first (`None`; only a read is dropped):
    /// the command is served before a read its writes make stale, at most
    /// [`GIVE_WAY_AT_MOST`] times a pass (fast commands must not starve it).
    async fn unless_commanded<T>(
        &self,
        sandbox: &SandboxId,
        give_way: bool,
        read: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        if !give_way {
            return Some(read.await);
        }
        let commanded = async {
            loop {
                let changed = self.slots.changed();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if self.slots.view(sandbox, |slot| !slot.inbox.is_empty()) {
                    return;
                }
                changed.await;
            }
        };
        tokio::select! {
            biased;
            value = read => Some(value),
            () = commanded => None,
        }
    }

    pub(super) fn held_and_watch(&self, sandbox: &SandboxId) -> Option<(HeldLease, Watch)> {
        self.slots.view(sandbox, |slot| {
            slot.state.held().cloned().zip(slot.state.watch().copied())
        })
    }

    /// Lease upkeep for a held sandbox nothing happened to (`decide_light`).
    async fn light_pass(
        &self,
        sandbox: &SandboxId,
        full_pass_wanted: bool,
        held: HeldLease,
        watch: Watch,
        give_way: bool,
    ) -> Result<Light, ReconcileError> {
        let now = self.clock.now();
        let lock_read: Option<ReadLease>;
        let mut seen = Quiet {
            me: self.leases.instance(),
            now,
            full_pass_wanted,
            held: Some(&held),
            resync_due: now >= watch.last_full_pass + chrono_duration(self.config.resync_interval),
            checkpoint_due: self.checkpoint_due(sandbox),
            running_here: self.runtime.is_running(sandbox),
            watching: watch
                .detached_since
                .is_some_and(|since| now < since + chrono_duration(self.config.detached_window)),
            lock_read: None,
            vouched: self.leases.is_safe(&held),
        };
        let mut step = decide_light(&seen);
        let mut view = None;
        if step == LightStep::ReadBoth {
            // Both at once: the full pass a change (an attach elsewhere)
            // calls for decides on these (decision 7, the departure watch).
            let both =
                async { tokio::join!(self.read_metadata(sandbox), self.leases.read(sandbox)) };
            let Some((metadata, lock)) = self.unless_commanded(sandbox, give_way, both).await
            else {
                return Ok(Light::Commanded);
            };
            lock_read = lock?;
            seen.lock_read = Some(lock_read.as_ref().map(|(lease, _)| lease));
            // Whether the instance lease still vouches, after the read.
            seen.vouched = self.leases.is_safe(&held);
            step = decide_light(&seen);
            if step == LightStep::Changed
                && let Ok(Some(metadata)) = metadata
            {
                view = Some((metadata, lock_read.clone()));
            }
        }
        match step {
            LightStep::Upkeep => {
                let until = |at: DateTime<Utc>| (at - now).to_std().unwrap_or(Duration::ZERO);
                let mut next =
                    until(watch.last_full_pass + chrono_duration(self.config.resync_interval));
                if seen.watching {
                    next = next.min(self.config.detached_poll);
                }
                Ok(Light::Done(Requeue::After(
                    next.max(Duration::from_millis(10)),
                )))
            }
            LightStep::Full | LightStep::ReadBoth | LightStep::Changed => {
                Ok(Light::Full(view.map(Box::new)))
            }
        }
    }

    /// What a full pass decides on: `view` (its commands' writes, or its light pass's read) or both
    /// objects read at once; the lock with a ring's intent; metadata as [`Self::as_owner_sees`] it.
    pub(super) async fn observe(
        &self,
        sandbox: &SandboxId,
        view: Option<View>,
    ) -> (
        Result<Option<ReadMetadata>, ReconcileError>,
        Result<Option<ReadLease>, LeaseError>,
    ) {
        let (mut metadata, lock) = match view {
            Some((metadata, lock)) => (
                Ok(Some(metadata)),
                Ok(lock
                    .map(|(lock, generation)| (self.leases.with_heard(sandbox, lock), generation))),
            ),
            None => tokio::join!(self.read_metadata(sandbox), self.leases.read(sandbox)),
        };
        if let Ok(Some(read)) = &mut metadata {
            *read = self.as_owner_sees(sandbox, read.clone());
        }
        (metadata, lock)
    }

    /// `read` as this owner sees it: its own newer write instead (landed while the read travelled),
    /// with the spec change being written applied (`commands.rs`) unless deleting (then refused).
    pub(super) fn as_owner_sees(
        &self,
        sandbox: &SandboxId,
        mut read: ReadMetadata,
    ) -> ReadMetadata {
        if let Some(known) = self.known_read(sandbox, Generation(read.1.0 + 1)) {
            read = known;
        }
        let in_flight = self.slots.view(sandbox, |slot| slot.spec_in_flight.clone());
        if let Some(change) = in_flight.filter(|_| !read.0.is_deleted()) {
            change(&mut read.0.spec);
        }
        read
    }

    /// An attach's read, answered without a bucket request for a vouched hold
    /// with known metadata ([`Self::as_owner_sees`]); `None`: read the bucket.
    pub fn owner_read(&self, sandbox: &SandboxId) -> Option<super::AttachRead> {
        let held = self
            .held(sandbox)
            .filter(|held| self.leases.is_safe(held))?;
        let known = self.known_read(sandbox, Generation(0))?;
        Some(super::AttachRead {
            metadata: self.as_owner_sees(sandbox, known),
            lock: Some((held.lease, held.generation)),
        })
    }

    /// Decides on what [`Self::observe`] gives, and performs the one step
    /// the decision table picks. `None`: a command came while it read.
    async fn full_pass(
        &self,
        sandbox: &SandboxId,
        view: Option<View>,
        give_way: bool,
    ) -> Result<Option<Requeue>, ReconcileError> {
        let Some((metadata, lease)) = self
            .unless_commanded(sandbox, give_way, self.observe(sandbox, view))
            .await
        else {
            return Ok(None);
        };
        // A read failed in the store (not an invalid document): the table decides for a hold here.
        let unreachable = match (&metadata, &lease) {
            (Err(err @ ReconcileError::Store(_)), _) => Some(err.to_string()),
            (_, Err(err @ LeaseError::Store(_))) => Some(err.to_string()),
            _ => None,
        };
        let (metadata, mut lease) = match (unreachable.is_some(), metadata) {
            (true, _) => (None, None),
            (false, Ok(metadata)) => {
                let lease = match &metadata {
                    Some(_) => lease?,
                    None => None,
                };
                (metadata, lease)
            }
            (false, Err(err)) => {
                if let ReconcileError::Invalid { .. } = &err {
                    // An operator's typo: tell whoever waits, keep running what runs, retry later.
                    self.restore_failed(sandbox, StartFailure::InvalidMetadata(err.to_string()));
                }
                return Err(err);
            }
        };
        let mut held = self.held(sandbox);
        // A holder's unreadable instance lease counts as alive: wait, not fail.
        let holder_gone = match &lease {
            Some((lease, _)) => self.leases.holder_gone(lease).await.unwrap_or_else(|err| {
                tracing::warn!(%sandbox, %err, "cannot read the holder's instance lease");
                false
            }),
            None => true,
        };
        let (running_here, starting_here) =
            (self.runtime.is_running(sandbox), self.is_starting(sandbox));
        let (waiting_here, checkpoint_due) =
            (self.is_waiting(sandbox), self.checkpoint_due(sandbox));
        let decide_on =
            |held: Option<&HeldLease>, lock: Option<&Lease>, unreachable: Option<&str>| {
                decide(&Observed {
                    me: self.leases.instance(),
                    now: self.clock.now(),
                    metadata: metadata.as_ref().map(|(metadata, _)| metadata),
                    lock,
                    held,
                    vouched: held.is_some_and(|held| self.leases.is_safe(held)),
                    running_here,
                    starting_here,
                    holder_gone,
                    waiting_here,
                    checkpoint_due,
                    draining: self.draining(),
                    unreachable,
                })
            };
        let mut step = decide_on(
            held.as_ref(),
            lease.as_ref().map(|(lease, _)| lease),
            unreachable.as_deref(),
        );
        if let (Step::Reverify, Some(hold)) = (&step, &held) {
            // Its one write; then the table decides again on what it left.
            step = match self.reverify(sandbox, hold).await {
                Reverified::Renewed(renewed) => {
                    let step = decide_on(Some(&renewed), Some(&renewed.lease), None);
                    if step == Step::Reverify {
                        // Slower than the lease it renewed: no write loop.
                        return Ok(Some(Requeue::After(self.next_look(sandbox))));
                    }
                    lease = Some((renewed.lease.clone(), renewed.generation));
                    held = Some(*renewed);
                    step
                }
                Reverified::Found(found) => {
                    lease = None;
                    decide_on(held.as_ref(), found.as_deref(), None)
                }
                Reverified::Failed(why) => decide_on(held.as_ref(), None, Some(&why)),
            };
        }
        tracing::debug!(%sandbox, ?step, "decided");
        self.perform(sandbox, step, metadata, lease, held)
            .await
            .map(Some)
    }

    async fn perform(
        &self,
        sandbox: &SandboxId,
        step: Step,
        read: Option<ReadMetadata>,
        lock: Option<ReadLease>,
        held: Option<HeldLease>,
    ) -> Result<Requeue, ReconcileError> {
        let metadata = read.as_ref().map(|(metadata, _)| metadata);
        let lease = lock.as_ref().map(|(lease, _)| lease.clone());
        let needs = |what: &'static str| ReconcileError::Internal(what);
        match step {
            Step::Nothing => Ok(Requeue::Never),
            Step::CutOff { why } => {
                self.stop_lost(sandbox, LossCause::RenewalFailed(why)).await;
                Ok(Requeue::Never)
            }
            Step::Retry { why } => Err(ReconcileError::Unreachable(why)),
            Step::StopVanished => {
                self.stop_lost(sandbox, LossCause::MetadataDeleted).await;
                Ok(Requeue::Never)
            }
            Step::StopLost { holder } => {
                self.stop_lost(sandbox, LossCause::TakenOver { holder })
                    .await;
                Ok(Requeue::Never)
            }
            Step::MarkDied => {
                let held = held.ok_or(needs("a hold to mark died"))?;
                self.mark_died(sandbox, held).await
            }
            Step::Delete => {
                let held = held.ok_or(needs("a hold to delete"))?;
                self.delete_held(sandbox, held).await
            }
            Step::RefuseCheckpoint => {
                let held = held.ok_or(needs("a hold to refuse a checkpoint"))?;
                self.refuse_checkpoint(sandbox, held).await
            }
            Step::CheckpointAndRelease => {
                let (metadata, held) = metadata
                    .zip(held)
                    .ok_or(needs("metadata and a hold to checkpoint"))?;
                self.checkpoint_and_release(sandbox, metadata, held, lock, false)
                    .await
            }
            Step::HandOver => {
                let (metadata, held) = metadata
                    .zip(held)
                    .ok_or(needs("metadata and a hold to hand over"))?;
                self.hand_over(sandbox, metadata, held, lock).await
            }
            // Performed by the full pass, which decides again on what it found.
            Step::Reverify => Err(needs("a hold to re-verify")),
            Step::KeepRunning => Ok(Requeue::After(self.next_look(sandbox))),
            Step::RecordRunning => {
                let held = held.ok_or(needs("a hold to record"))?;
                // Off the pass (decision 21): a ring during a rate-limited
                // record is answered by the next pass, not after it.
                self.record_running_in_background(sandbox, &held, lease.clone(), None);
                Ok(Requeue::After(self.next_look(sandbox)))
            }
            Step::PeriodicCheckpoint => {
                let held = held.ok_or(needs("a hold to checkpoint"))?;
                self.periodic_checkpoint(sandbox, held).await?;
                Ok(Requeue::After(Duration::ZERO))
            }
            Step::Adopt => {
                let (read, lock) = read
                    .zip(lock)
                    .ok_or(needs("metadata and a lock to adopt"))?;
                self.adopt_and_start(sandbox, read.0, lock).await
            }
            Step::AwaitHandover { holder } => Ok(Requeue::After(
                self.await_handover(sandbox, &holder, lease.as_ref()).await,
            )),
            Step::ReleaseOrphan { epoch } => self.release_orphan(sandbox, epoch).await,
            Step::ShuttingDown { release } => self.refuse_while_draining(sandbox, release).await,
            Step::Purge => {
                let metadata = metadata.ok_or(needs("metadata to purge"))?;
                self.emit(sandbox, SandboxEvent::Deleted);
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
                if self.take_waiting(sandbox).is_some() {
                    self.restore_failed(sandbox, StartFailure::CheckpointedMeanwhile);
                }
                Ok(Requeue::Never)
            }
            Step::Acquire => {
                let (metadata, _) = read.ok_or(needs("metadata to start"))?;
                self.acquire_and_start(sandbox, metadata, lock).await
            }
        }
    }
}
