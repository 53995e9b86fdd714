//! What this instance already knows of a sandbox's two JSON objects, so that
//! the next request for them is a write, not a read and a write
//! (decision 18). On GCS a read costs tens of milliseconds on the critical
//! path; every read saved here is one the client does not wait for.
//!
//! Two kinds of knowledge, both with the object's generation:
//! - **known**: the last `metadata.json` this instance read or wrote. It is
//!   the first read of the next read-modify-write of that object: if nobody
//!   wrote in between, the conditional write lands at once; if somebody
//!   did, its precondition fails and the loop reads afresh. Correctness
//!   never rests on it being current.
//! - **primed**: what an intent writer here just wrote or read of both
//!   objects (a create, an attach, a client's checkpoint request). The next
//!   full pass decides on it instead of reading both again. It is as fresh
//!   as a read made at the same moment, and every write the pass then makes
//!   is conditional on those generations, so a change in between is caught
//!   exactly as it would be after a read.
//!
//! Both live in the sandbox's slot (`slots.rs`). This instance's own writes
//! of one `metadata.json` take turns (`Slots::write_turn`): an intent written while the reconciler's
//! status write is in flight (a client's checkpoint right after its create
//! meets RecordRunning) would start from the generation before it, fail its
//! precondition and pay a read and a second write; waiting its turn, it
//! starts from the generation that write left.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::api::{Lease, RungIntent, SandboxId, SandboxMetadata};
use crate::store::Generation;

pub use super::slots::ReadMetadata;
use super::slots::{Primed, SpecChange};

use super::super::events::{CheckpointFailure, SandboxEvent};
use super::{ReadLease, Reconciler, chrono_duration};

/// Both objects as an attaching client's instance read them (at once).
#[derive(Debug, Clone)]
pub struct AttachRead {
    pub metadata: ReadMetadata,
    pub lock: Option<(Lease, Generation)>,
}

/// How long primed objects stand in for a read. A pass that comes later
/// (the instance was paused, the queue was long) reads afresh: the lock may
/// have been taken meanwhile, and a hold must never be taken up on a stale
/// view of it.
const PRIMED_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// How soon a pass that found an intent being written looks again.
pub(super) const INTENT_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// Marks an intent writer at work on a sandbox until dropped.
#[derive(Debug)]
pub(crate) struct IntentGuard<'a> {
    reconciler: &'a Reconciler,
    sandbox: SandboxId,
}

impl Drop for IntentGuard<'_> {
    fn drop(&mut self) {
        self.reconciler.slots.update(&self.sandbox, |slot| {
            slot.intents.in_flight = slot.intents.in_flight.saturating_sub(1);
        });
    }
}

impl Reconciler {
    /// The next full pass of `sandbox` decides on these objects, which the
    /// caller has just written or read, instead of reading them again.
    pub fn prime(&self, sandbox: &SandboxId, metadata: ReadMetadata, lock: Option<ReadLease>) {
        self.remember_metadata(sandbox, &metadata.0, metadata.1);
        let primed = Primed {
            metadata,
            lock,
            at: self.clock.now(),
            era: self.leases.instance_lease().era(),
        };
        self.slots
            .update(sandbox, |slot| slot.primed = Some(primed));
    }

    /// `change` is being written to `sandbox`'s spec: passes apply it to
    /// what they read until [`Self::spec_written`] with the ticket returned.
    /// A pass applies it to the spec it reads until the write ends (landed
    /// or failed): an attach whose lock write landed need not wait for its
    /// spec write, which GCS's per-object rate can hold up for a second or
    /// more (decision 21).
    pub(crate) fn spec_pending(&self, sandbox: &SandboxId, change: SpecChange) -> u64 {
        let ticket = self
            .spec_tickets
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        self.slots
            .update(sandbox, |slot| slot.pending_spec = Some((ticket, change)));
        ticket
    }

    /// Whether a spec write of `sandbox` has not ended yet (tests: the
    /// task that ends it queues a pass).
    #[cfg(test)]
    pub(crate) fn spec_write_pending(&self, sandbox: &SandboxId) -> bool {
        self.slots.view(sandbox, |slot| slot.pending_spec.is_some())
    }

    /// The write of ticket `ticket` ended: passes read the spec as stored.
    pub(crate) fn spec_written(&self, sandbox: &SandboxId, ticket: u64) {
        self.slots.update(sandbox, |slot| {
            if slot
                .pending_spec
                .as_ref()
                .is_some_and(|(current, _)| *current == ticket)
            {
                slot.pending_spec = None;
            }
        });
    }

    /// A checkpoint intent primed before its write failed to be written:
    /// if no pass took the primed objects up, they are withdrawn and the
    /// waiting client told (nothing was checkpointed; the sandbox runs on).
    pub(crate) fn checkpoint_request_unwritten(
        &self,
        sandbox: &SandboxId,
        err: &dyn std::fmt::Display,
    ) {
        let unused = self
            .slots
            .update(sandbox, |slot| slot.primed.take())
            .is_some();
        if unused {
            self.emit(
                sandbox,
                SandboxEvent::CheckpointFailed(CheckpointFailure::Runtime(format!(
                    "the checkpoint request could not be recorded: {err}"
                ))),
            );
        }
    }

    /// Replaces `read` by the `metadata.json` this instance last read or
    /// wrote when that is newer (a higher generation): an intent of this
    /// instance that landed while the read was on its way is then no
    /// longer pending (its overlay gone) yet missing from the read, and a
    /// pass must not decide on the state from before it.
    pub(super) fn newer_known(&self, sandbox: &SandboxId, read: &mut ReadMetadata) {
        let Some(known) = self.known_metadata(sandbox) else {
            return;
        };
        if known.generation > read.1
            && let Ok(metadata) = crate::api::decode::<SandboxMetadata>(&known.data)
        {
            *read = (metadata, known.generation);
        }
    }

    /// [`Self::prime`] with what a pass of its own just read, unless an
    /// intent writer primed the next pass meanwhile: what it wrote is newer
    /// than any read that overlapped its write.
    pub(super) fn prime_with_read(
        &self,
        sandbox: &SandboxId,
        metadata: ReadMetadata,
        lock: Option<ReadLease>,
    ) {
        let primed = Primed {
            metadata,
            lock,
            at: self.clock.now(),
            era: self.leases.instance_lease().era(),
        };
        self.slots.update(sandbox, |slot| {
            slot.primed.get_or_insert(primed);
        });
    }

    /// A ring's attach intent came with the generations its ringer read
    /// both objects at: when this instance holds the sandbox at that lock
    /// generation and epoch, and knows its metadata at least that new, the
    /// next pass decides on what it knows (as fresh as the ringer's read,
    /// the intent heard) instead of reading both again: a round trip off
    /// every handoff. A newer pass's or intent writer's prime is kept.
    pub(crate) fn prime_from_ring(&self, sandbox: &SandboxId, rung: &RungIntent) {
        let Some(read) = rung.read else {
            return;
        };
        let Some(held) = self.held(sandbox) else {
            return;
        };
        if held.epoch != rung.epoch || held.generation != Generation(read.lock) {
            return;
        }
        let Some(known) = self
            .known_metadata(sandbox)
            .filter(|known| known.generation >= Generation(read.metadata))
        else {
            return;
        };
        let Ok(metadata) = crate::api::decode::<SandboxMetadata>(&known.data) else {
            return;
        };
        self.prime_with_read(
            sandbox,
            (metadata, known.generation),
            Some((held.lease, held.generation)),
        );
    }

    /// Applies the spec change being written to `sandbox`, if any, unless
    /// the sandbox is being deleted: that write will be refused.
    pub(super) fn overlay_pending_spec(&self, sandbox: &SandboxId, metadata: &mut SandboxMetadata) {
        if metadata.is_deleted() {
            return;
        }
        let change = self.slots.view(sandbox, |slot| {
            slot.pending_spec
                .as_ref()
                .map(|(_, change)| Arc::clone(change))
        });
        if let Some(change) = change {
            change(&mut metadata.spec);
        }
    }

    /// The primed objects of `sandbox`, if still fresh (else `None`: read).
    pub(super) fn take_primed(&self, sandbox: &SandboxId) -> Option<Primed> {
        let primed = self.slots.update(sandbox, |slot| slot.primed.take())?;
        let fresh = self.clock.now() <= primed.at + chrono_duration(PRIMED_FOR)
            && primed.era == self.leases.instance_lease().era();
        fresh.then_some(primed)
    }

    /// An intent writer starts on `sandbox`: passes decide nothing until the
    /// guard is dropped (after it primed and queued the next one).
    pub(crate) fn writing_intent(&self, sandbox: &SandboxId) -> IntentGuard<'_> {
        self.slots.update(sandbox, |slot| {
            slot.intents.in_flight += 1;
            slot.intents.started += 1;
        });
        IntentGuard {
            reconciler: self,
            sandbox: sandbox.clone(),
        }
    }

    /// How many intent writers ever started on `sandbox`, if none is at
    /// work now (`None`: one is).
    pub(crate) fn intents_settled(&self, sandbox: &SandboxId) -> Option<u64> {
        let count = self.slots.view(sandbox, |slot| slot.intents);
        (count.in_flight == 0).then_some(count.started)
    }

    /// True while a client here waits for `sandbox` to start.
    pub(crate) fn is_waiting(&self, sandbox: &SandboxId) -> bool {
        self.slots.view(sandbox, |slot| slot.waiting.is_some())
    }

    /// True when the periodic checkpoint of a held, checkpointable sandbox
    /// is due.
    pub(super) fn checkpoint_due(&self, sandbox: &SandboxId) -> bool {
        let Some(interval) = self.config.checkpoint_interval else {
            return false;
        };
        let now = self.clock.now();
        self.watch(sandbox).is_some_and(|watch| {
            watch.checkpointable && now >= watch.last_checkpoint + chrono_duration(interval)
        })
    }
}
