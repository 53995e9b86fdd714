//! Everything this instance keeps about one sandbox, in one place: a
//! [`Slot`] per sandbox, all of them behind one lock ([`Slots`]).
//!
//! A sandbox's life on this instance (a client waiting, the lease being
//! acquired, the start, the hold, its checkpoints, its loss) and what the
//! intent writers here left for its next pass used to be membership in a
//! dozen maps and sets, each behind its own lock: nothing tied one
//! sandbox's entries together, and a reader could see one map changed and
//! the next not yet. One slot per sandbox gathers them, so one lock
//! acquisition sees (and changes) all of a sandbox's local state at once.
//! A slot exists only while something is in it; it is removed when its last
//! field empties.
//!
//! The map is shared behind an `Arc` so that tasks outliving a pass (a
//! start's record, a wake on an image's landing) reach their sandbox's slot.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use chrono::{DateTime, Utc};

use crate::api::SandboxId;
use crate::leasing::HeldLease;
use crate::store::Versioned;

use super::local::Watch;
use super::primed::{IntentCount, Primed, SpecChange};

/// The most sandboxes with a slot before the hints in them (remembered
/// metadata, idle write turns, settled intent counts, old losses) are
/// dropped: they are only ever hints.
const MAX_SLOTS: usize = 10_000;

/// What this instance knows only locally about one sandbox.
#[derive(Default)]
pub(super) struct Slot {
    /// The lease this instance holds on the sandbox, while it runs here.
    pub(super) held: Option<HeldLease>,
    /// How closely the held sandbox is watched (see [`Watch`]).
    pub(super) watch: Option<Watch>,
    /// Since when a client here waits for the sandbox (an attach intent was
    /// written).
    pub(super) waiting: Option<DateTime<Utc>>,
    /// This instance is waiting to acquire the sandbox (LOCK_ACQUIRING was
    /// said).
    pub(super) acquiring: bool,
    /// Being acquired and started by a pass right now: its lock may name
    /// this instance before it is held.
    pub(super) starting: bool,
    /// When this instance last rang the holder of the sandbox it waits for.
    pub(super) rung: Option<DateTime<Utc>>,
    /// The epochs of holds whose RecordRunning runs in a task right now.
    pub(super) recording: BTreeSet<u64>,
    /// When this instance's doorbell was last rung for the sandbox it holds:
    /// for a moment after, a pass that finds no intent looks again (the
    /// ringer writes the intent and rings at the same time).
    pub(super) rung_here: Option<DateTime<Utc>>,
    /// When this instance last stopped the sandbox as lost to another (kept
    /// `LOST_MEMORY`): an execution's relay must not report an end the loss
    /// cut off.
    pub(super) lost: Option<std::time::Instant>,
    /// The next pass must be a full one (an intent was written).
    pub(super) full_pass_wanted: bool,
    /// The last `metadata.json` this instance read or wrote, with its
    /// generation: the first read of its next read-modify-write (a change
    /// in between fails the precondition and is read afresh).
    pub(super) known: Option<Versioned>,
    /// The turn of this instance's writes of the sandbox's metadata.
    pub(super) write_turn: Option<Arc<tokio::sync::Mutex<()>>>,
    /// What an intent writer here just wrote or read (metadata and lock,
    /// with generations): the next full pass decides on it instead of
    /// reading both again.
    pub(super) primed: Option<Primed>,
    /// The spec change an intent writer here is still writing, with the
    /// ticket of its write.
    pub(super) pending_spec: Option<(u64, SpecChange)>,
    /// The intent writers here at work on the sandbox (and how many ever
    /// started): a pass decides nothing until they are done, so it never
    /// acts on half of an intent (a spec not yet written beside a hold
    /// already taken).
    pub(super) intents: IntentCount,
    /// A wake is pending for the landing of the image a taker waits for
    /// (one at a time).
    pub(super) image_wait: bool,
}

impl Slot {
    /// Nothing left in it: the slot can go.
    fn is_empty(&self) -> bool {
        self.held.is_none()
            && self.watch.is_none()
            && self.waiting.is_none()
            && !self.acquiring
            && !self.starting
            && self.rung.is_none()
            && self.recording.is_empty()
            && self.rung_here.is_none()
            && self.lost.is_none()
            && !self.full_pass_wanted
            && self.known.is_none()
            && self.write_turn.is_none()
            && self.primed.is_none()
            && self.pending_spec.is_none()
            && self.intents.is_idle_and_unstarted()
            && !self.image_wait
    }

    /// Drops what is only a hint (see [`MAX_SLOTS`]).
    fn drop_hints(&mut self, now: std::time::Instant, lost_memory: std::time::Duration) {
        self.known = None;
        // Only turns nobody holds or waits for go.
        if self
            .write_turn
            .as_ref()
            .is_some_and(|turn| Arc::strong_count(turn) <= 1)
        {
            self.write_turn = None;
        }
        if self.intents.in_flight == 0 {
            self.intents = IntentCount::default();
        }
        self.forget_old_loss(now, lost_memory);
    }

    /// Forgets a loss older than `lost_memory`.
    pub(super) fn forget_old_loss(
        &mut self,
        now: std::time::Instant,
        lost_memory: std::time::Duration,
    ) {
        if self
            .lost
            .is_some_and(|at| now.duration_since(at) >= lost_memory)
        {
            self.lost = None;
        }
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("held", &self.held.as_ref().map(|held| held.epoch))
            .field("waiting", &self.waiting)
            .field("acquiring", &self.acquiring)
            .field("starting", &self.starting)
            .field("recording", &self.recording)
            .field("full_pass_wanted", &self.full_pass_wanted)
            .field("primed", &self.primed.is_some())
            .field("pending_spec", &self.pending_spec.is_some())
            .field("intents", &self.intents)
            .finish_non_exhaustive()
    }
}

/// The slots of every sandbox this instance knows locally, behind one lock.
/// Cheap to clone: clones share the slots.
#[derive(Debug, Default, Clone)]
pub(super) struct Slots(Arc<Mutex<HashMap<SandboxId, Slot>>>);

impl Slots {
    /// Every slot at once (for what looks across sandboxes).
    pub(super) fn all(&self) -> MutexGuard<'_, HashMap<SandboxId, Slot>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads `sandbox`'s slot (an empty one if it has none).
    pub(super) fn view<T>(&self, sandbox: &SandboxId, read: impl FnOnce(&Slot) -> T) -> T {
        let slots = self.all();
        match slots.get(sandbox) {
            Some(slot) => read(slot),
            None => read(&Slot::default()),
        }
    }

    /// Changes `sandbox`'s slot (made if it has none, removed if left
    /// empty). `change` must not reach the slots again: the lock is held.
    pub(super) fn update<T>(&self, sandbox: &SandboxId, change: impl FnOnce(&mut Slot) -> T) -> T {
        let mut slots = self.all();
        if !slots.contains_key(sandbox) && slots.len() >= MAX_SLOTS {
            let now = std::time::Instant::now();
            for slot in slots.values_mut() {
                slot.drop_hints(now, super::local::LOST_MEMORY);
            }
            slots.retain(|_, slot| !slot.is_empty());
        }
        let slot = slots.entry(sandbox.clone()).or_default();
        let outcome = change(slot);
        if slot.is_empty() {
            slots.remove(sandbox);
        }
        outcome
    }
}
