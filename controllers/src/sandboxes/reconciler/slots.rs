//! Everything this instance keeps about a sandbox: a [`Slot`] each, behind one lock ([`Slots`]), so
//! one acquisition sees and changes all its local state at once. Empty slots are removed.
//!
//! The sandbox's phase is one [`LocalState`], each variant carrying what it needs: a sandbox cannot
//! be held and starting at once, nor watched unless held, nor lost while held. What is not a phase
//! (a client waiting, records in flight, commands) sits beside it.
//!
//! Only its own pass changes a sandbox's state; others put commands in its inbox (`commands.rs`),
//! read it, or bring news that decides nothing alone (a client attached or active, a progress
//! subscription). A task outliving its pass (a start's record, a spec write, an image wait) reports
//! its end as `Command::Ended`, taking back only its own mark (`Slots::on_drop`).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use chrono::{DateTime, Utc};
use tokio::sync::broadcast;

use crate::api::{RungIntent, SandboxId, SandboxMetadata};
use crate::hooks::HookBinding;
use crate::leasing::HeldLease;
use crate::leasing::RungIntents;
use crate::sandboxes::events::SandboxEvent;
use crate::store::{Generation, Versioned};

use super::local::Watch;

/// Slots beyond which their hints (known metadata, idle write turns) go.
const MAX_SLOTS: usize = 10_000;

/// How many events a slow subscriber may fall behind before it misses some.
const CHANNEL_CAPACITY: usize = 64;

/// What this instance knows only locally about one sandbox.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) state: LocalState,
    /// Since when a client here waits for it (an attach intent was written).
    pub(super) waiting: Option<DateTime<Utc>>,
    /// The epochs of holds whose RecordRunning runs in a task right now.
    pub(super) recording: BTreeSet<u64>,
    /// The next pass must be a full one (an intent was written).
    pub(super) full_pass_wanted: bool,
    /// The last `metadata.json` read or written here; writes start from it.
    pub(super) known: Option<Versioned>,
    pub(super) write_turn: Option<Arc<tokio::sync::Mutex<()>>>,
    /// Commands for the sandbox's next pass (`commands.rs`), in arrival order.
    pub(super) inbox: Vec<(super::commands::Command, Option<super::commands::Reply>)>,
    /// A spec change still being written after its pass (`commands.rs`).
    pub(super) spec_in_flight: Option<super::commands::SpecChange>,
    /// The phase [`Slots::in_transition`] set, for `sandboxd_sandboxes{phase}`.
    transition: Option<&'static str>,
    /// Its progress channel (`events.rs`), while sessions here subscribe.
    progress: Option<broadcast::Sender<SandboxEvent>>,
    /// The attach intent a ring carried (decision 27), heard or sent here;
    /// the leases count it in every lock they read (`Leases::with_heard`).
    rung: Option<RungIntent>,
}

impl Slot {
    pub(super) fn step<T>(&mut self, transition: impl FnOnce(LocalState) -> (LocalState, T)) -> T {
        let (next, outcome) = transition(std::mem::take(&mut self.state));
        self.state = next;
        outcome
    }

    fn is_empty(&self) -> bool {
        matches!(self.state, LocalState::Idle)
            && self.waiting.is_none()
            && self.recording.is_empty()
            && !self.full_pass_wanted
            && self.known.is_none()
            && self.write_turn.is_none()
            && self.inbox.is_empty()
            && self.spec_in_flight.is_none()
            && self.transition.is_none()
            && self.progress.is_none()
            && self.rung.is_none()
    }

    /// Drops hints ([`MAX_SLOTS`]); old losses go in `Reconciler::note_lost`.
    fn drop_hints(&mut self) {
        self.known = None;
        // Only turns nobody holds or waits for go.
        self.write_turn = self
            .write_turn
            .take()
            .filter(|turn| Arc::strong_count(turn) > 1);
    }
}

/// Where a sandbox is in its life here; each method below is a transition.
#[derive(Debug, Clone, Default)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per sandbox, moved only on a transition: a box would cost an allocation per start to save a few hundred bytes per idle slot"
)]
pub(super) enum LocalState {
    /// Nothing in flight here.
    #[default]
    Idle,
    /// Waiting to acquire the sandbox (LOCK_ACQUIRING was said): from its
    /// holder, by a [`Handoff`] (a free lock is taken within one pass).
    Acquiring(Handoff),
    /// A pass acquires and starts it now (its lock may name us, not yet held).
    Starting {
        /// The wait that led here, which a start ending unheld goes back to.
        handoff: Option<Handoff>,
    },
    /// Held and running here.
    Held {
        lease: HeldLease,
        watch: Watch,
        /// What its lifecycle hooks keep for it while it runs here.
        hooks: Option<HookBinding>,
    },
    /// Stopped as lost (taken over, renewal failed, metadata deleted) at `at`,
    /// kept `LOST_MEMORY` lest an execution's relay report an end it cut off.
    Lost {
        /// When the loss was seen.
        at: tokio::time::Instant,
    },
}

/// A handoff this instance waits to take, from its attach intent (sent with the first ring) until
/// the hold is taken up or the wait ends: the holder lands its image ([`HandoffImage`], staged by
/// the runtime), then names this instance in the lock, and the next pass adopts and starts
/// ([`LocalState::Starting`], which gives this back if the start fails).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Handoff {
    /// When this instance last rang the holder (`None`: not since the intent).
    pub(super) rung_at: Option<DateTime<Utc>>,
    /// Where the image the holder hands over with is.
    pub(super) image: HandoffImage,
}

/// The image a taker waits for, named by the epoch of the hold that hands
/// it over (a later hold hands over with another image; decision 29).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum HandoffImage {
    /// Not watched for (no live intent of ours in the lock, or no prefetch).
    #[default]
    Unwatched,
    /// The runtime watches for it; a task awaits its landing to wake the pass.
    Awaited { epoch: u64 },
    /// In the store (or the runtime's watch ended): the transfer is next.
    Landed { epoch: u64 },
}

impl Handoff {
    /// Whether a ring is due (every `every` from the first look); notes it.
    pub(super) fn ring_due(&mut self, now: DateTime<Utc>, every: chrono::Duration) -> bool {
        let last = self.rung_at.get_or_insert(now);
        if now >= *last + every {
            *last = now;
            true
        } else {
            false
        }
    }

    /// Awaits the hold at `epoch`'s image; true if new (one task per image).
    pub(super) fn await_image(&mut self, epoch: u64) -> bool {
        let fresh = self.image != HandoffImage::Awaited { epoch };
        self.image = HandoffImage::Awaited { epoch };
        fresh
    }

    /// The image of the hold at `epoch` landed (a late one leaves later waits).
    pub(super) fn image_landed(&mut self, epoch: u64) {
        if self.image == (HandoffImage::Awaited { epoch }) {
            self.image = HandoffImage::Landed { epoch };
        }
    }
}

impl LocalState {
    /// Waits to acquire (a held one stays held); true if new (LOCK_ACQUIRING).
    pub(super) fn wait_to_acquire(self) -> (Self, bool) {
        match self {
            Self::Idle | Self::Lost { .. } => (Self::Acquiring(Handoff::default()), true),
            Self::Starting { handoff: None } => (
                Self::Starting {
                    handoff: Some(Handoff::default()),
                },
                true,
            ),
            state => (state, false),
        }
    }

    /// The wait to acquire is over (the hold is taken, or will not be).
    pub(super) fn done_acquiring(self) -> Self {
        match self {
            Self::Acquiring(_) => Self::Idle,
            Self::Starting { .. } => Self::Starting { handoff: None },
            state => state,
        }
    }

    /// A pass begins a start; held stays held (the table never starts one).
    pub(super) fn begin_start(self) -> Self {
        match self {
            Self::Idle | Self::Lost { .. } => Self::Starting { handoff: None },
            Self::Acquiring(handoff) => Self::Starting {
                handoff: Some(handoff),
            },
            state => state,
        }
    }

    /// A start ended unheld (failed, gave way, cancelled): back to its wait.
    pub(super) fn start_ended(self) -> Self {
        match self {
            Self::Starting {
                handoff: Some(handoff),
            } => Self::Acquiring(handoff),
            Self::Starting { handoff: None } => Self::Idle,
            state => state,
        }
    }

    pub(super) fn hold(lease: HeldLease, watch: Watch, hooks: Option<HookBinding>) -> Self {
        Self::Held {
            lease,
            watch,
            hooks,
        }
    }

    /// Renewed: held under `lease` now; a sandbox stopped meanwhile stays so.
    pub(super) fn renewed(self, lease: HeldLease) -> Self {
        match self {
            Self::Held { watch, hooks, .. } => Self::Held {
                lease,
                watch,
                hooks,
            },
            state => state,
        }
    }

    /// The hold ended (released, handed over, died or deleted).
    pub(super) fn released(self) -> Self {
        match self {
            Self::Held { .. } => Self::Idle,
            state => state,
        }
    }

    /// Stopped here as lost at `at`: any hold, wait or start is over.
    pub(super) fn lost(self, at: tokio::time::Instant) -> Self {
        Self::Lost { at }
    }

    pub(super) fn lost_within(
        &self,
        now: tokio::time::Instant,
        memory: std::time::Duration,
    ) -> bool {
        matches!(self, Self::Lost { at } if now.duration_since(*at) < memory)
    }

    pub(super) fn hooks(&self) -> Option<&HookBinding> {
        match self {
            Self::Held { hooks, .. } => hooks.as_ref(),
            _ => None,
        }
    }

    pub(super) fn held(&self) -> Option<&HeldLease> {
        match self {
            Self::Held { lease, .. } => Some(lease),
            _ => None,
        }
    }

    pub(super) fn watch(&self) -> Option<&Watch> {
        match self {
            Self::Held { watch, .. } => Some(watch),
            _ => None,
        }
    }

    pub(super) fn watch_mut(&mut self) -> Option<&mut Watch> {
        match self {
            Self::Held { watch, .. } => Some(watch),
            _ => None,
        }
    }

    /// The handoff this instance waits for (or starts after).
    pub(super) fn handoff_mut(&mut self) -> Option<&mut Handoff> {
        match self {
            Self::Acquiring(handoff)
            | Self::Starting {
                handoff: Some(handoff),
            } => Some(handoff),
            _ => None,
        }
    }

    pub(super) fn is_starting(&self) -> bool {
        matches!(self, Self::Starting { .. })
    }

    /// Held or starting: the instance lease must be kept.
    pub(super) fn is_busy(&self) -> bool {
        matches!(self, Self::Held { .. } | Self::Starting { .. })
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("state", &self.state)
            .field("waiting", &self.waiting)
            .field("recording", &self.recording)
            .field("full_pass_wanted", &self.full_pass_wanted)
            .field("inbox", &self.inbox.len())
            .field("progress", &self.progress.is_some())
            .finish_non_exhaustive()
    }
}

type Undo = Box<dyn FnOnce(&mut Slot) + Send>;

/// A slot change made on drop: what a phase set (a start, a transition, a
/// record in flight) is undone however it ends, cancelled with its pass too.
#[must_use = "the change is undone when the guard drops"]
pub(super) struct OnDrop {
    slots: Slots,
    sandbox: SandboxId,
    undo: Option<Undo>,
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(undo) = self.undo.take() {
            self.slots.update(&self.sandbox, undo);
        }
    }
}

/// Every slot this instance knows, behind one lock (clones share them): the
/// controllers' one per-sandbox map (state, progress channels, commands).
#[derive(Debug, Default, Clone)]
pub(in crate::sandboxes) struct Slots {
    map: Arc<Mutex<HashMap<SandboxId, Slot>>>,
    /// Told after every slot change, so what waits for a sandbox's state
    /// (an execution's end, for its hold to be vouched for) needn't poll.
    changed: Arc<tokio::sync::Notify>,
}

impl Slots {
    /// Every slot at once (for what looks across sandboxes).
    pub(super) fn all(&self) -> MutexGuard<'_, HashMap<SandboxId, Slot>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    pub(super) fn on_drop(
        &self,
        sandbox: &SandboxId,
        undo: impl FnOnce(&mut Slot) + Send + 'static,
    ) -> OnDrop {
        OnDrop {
            slots: self.clone(),
            sandbox: sandbox.clone(),
            undo: Some(Box::new(undo)),
        }
    }

    pub(super) fn in_transition(&self, sandbox: &SandboxId, phase: &'static str) -> OnDrop {
        self.update(sandbox, |slot| slot.transition = Some(phase));
        self.on_drop(sandbox, |slot| slot.transition = None)
    }

    /// The sandboxes held here, and the transition of each sandbox in one.
    pub(super) fn census(&self) -> crate::sandboxes::metrics::Census {
        let slots = self.all();
        crate::sandboxes::metrics::Census {
            held: slots
                .values()
                .filter(|slot| slot.state.held().is_some())
                .count(),
            in_transition: slots.values().filter_map(|slot| slot.transition).collect(),
        }
    }

    /// How many sandboxes are held here or in a transition: a start, or a checkpoint or delete
    /// whose lock write has not landed (the local sandbox is gone before it).
    pub(super) fn unsettled(&self) -> usize {
        let slots = self.all();
        let unsettled = |slot: &&Slot| slot.state.held().is_some() || slot.transition.is_some();
        slots.values().filter(unsettled).count()
    }

    /// Reads `sandbox`'s slot (an empty one if it has none).
    pub(super) fn view<T>(&self, sandbox: &SandboxId, read: impl FnOnce(&Slot) -> T) -> T {
        read(self.all().get(sandbox).unwrap_or(&Slot::default()))
    }

    /// Changes `sandbox`'s slot (made if it has none, removed if left
    /// empty). `change` must not reach the slots again: the lock is held.
    pub(super) fn update<T>(&self, sandbox: &SandboxId, change: impl FnOnce(&mut Slot) -> T) -> T {
        let mut slots = self.all();
        if !slots.contains_key(sandbox) && slots.len() >= MAX_SLOTS {
            for slot in slots.values_mut() {
                slot.drop_hints();
            }
            slots.retain(|_, slot| !slot.is_empty());
        }
        let slot = slots.entry(sandbox.clone()).or_default();
        let outcome = change(slot);
        if slot.is_empty() {
            slots.remove(sandbox);
        }
        drop(slots);
        self.changed.notify_waiters();
        outcome
    }

    /// Forgets every loss seen `memory` or longer before `now`.
    pub(super) fn forget_losses(&self, now: tokio::time::Instant, memory: std::time::Duration) {
        let mut slots = self.all();
        for slot in slots.values_mut() {
            if matches!(slot.state, LocalState::Lost { .. }) && !slot.state.lost_within(now, memory)
            {
                slot.state = LocalState::Idle;
            }
        }
        slots.retain(|_, slot| !slot.is_empty());
    }

    /// Subscribes to `sandbox`'s progress channel (made if it has none).
    pub(in crate::sandboxes) fn subscribe(
        &self,
        sandbox: &SandboxId,
    ) -> broadcast::Receiver<SandboxEvent> {
        self.update(sandbox, |slot| {
            slot.progress
                .get_or_insert_with(|| broadcast::channel(CHANNEL_CAPACITY).0)
                .subscribe()
        })
    }

    /// Sends `event` on its progress channel, if any (dropped when unheard).
    pub(in crate::sandboxes) fn publish(&self, sandbox: &SandboxId, event: SandboxEvent) {
        let mut slots = self.all();
        let Some(slot) = slots.get_mut(sandbox) else {
            return;
        };
        if let Some(sender) = &slot.progress {
            if sender.receiver_count() == 0 {
                slot.progress = None;
            } else {
                let _ = sender.send(event);
            }
        }
        if slot.is_empty() {
            slots.remove(sandbox);
        }
    }
}

impl RungIntents for Slots {
    fn rung(&self, sandbox: &SandboxId) -> Option<RungIntent> {
        self.all().get(sandbox).and_then(|slot| slot.rung.clone())
    }

    fn change_rung(
        &self,
        sandbox: &SandboxId,
        change: &mut dyn FnMut(Option<RungIntent>) -> Option<RungIntent>,
    ) {
        self.update(sandbox, |slot| slot.rung = change(slot.rung.take()));
    }

    fn forget_expired(&self, now: DateTime<Utc>) {
        let mut slots = self.all();
        for slot in slots.values_mut() {
            slot.rung = slot.rung.take().filter(|rung| rung.intent.expires_at > now);
        }
        slots.retain(|_, slot| !slot.is_empty());
    }
}

pub type ReadMetadata = (SandboxMetadata, Generation);

/// What this instance knows of a sandbox's metadata, and whose turn to write.
impl Slots {
    /// Remembers `object` unless a newer generation is: a read answered after
    /// this instance's own write landed must not stand in for that write.
    pub(super) fn remember(&self, sandbox: &SandboxId, object: &Versioned) {
        self.update(sandbox, |slot| match &mut slot.known {
            Some(current) if current.generation > object.generation => {}
            known => *known = Some(object.clone()),
        });
    }

    pub(super) fn known(&self, sandbox: &SandboxId) -> Option<Versioned> {
        self.view(sandbox, |slot| slot.known.clone())
    }

    /// Waits for this instance's turn to write `sandbox`'s metadata, until the
    /// guard drops ([`Self::queue_for_write_turn`], then its wait).
    pub(super) async fn write_turn(&self, sandbox: &SandboxId) -> tokio::sync::OwnedMutexGuard<()> {
        self.queue_for_write_turn(sandbox).wait().await
    }

    /// Takes a place in the queue for this instance's turn to write `sandbox`'s metadata, now:
    /// turns come in the order they were asked for (tokio's mutex is fair), so a spec write issued
    /// after another, in a task of its own, still lands after it (an attach's `running` after the
    /// checkpoint intent before it). A lost turn otherwise costs only a refused write.
    pub(super) fn queue_for_write_turn(&self, sandbox: &SandboxId) -> WriteTurn {
        let turn = self.update(sandbox, |slot| {
            Arc::clone(slot.write_turn.get_or_insert_with(Arc::default))
        });
        let mut queued = Box::pin(turn.lock_owned());
        let mut now = std::task::Context::from_waker(std::task::Waker::noop());
        match queued.as_mut().poll(&mut now) {
            std::task::Poll::Ready(guard) => WriteTurn::Taken(guard),
            std::task::Poll::Pending => WriteTurn::Queued(queued),
        }
    }
}

/// A place in the queue for a sandbox's write turn ([`Slots::queue_for_write_turn`]).
pub(super) enum WriteTurn {
    Taken(tokio::sync::OwnedMutexGuard<()>),
    Queued(std::pin::Pin<Box<dyn Future<Output = tokio::sync::OwnedMutexGuard<()>> + Send>>),
}

impl WriteTurn {
    /// The turn, once the writes queued before it are done.
    pub(super) async fn wait(self) -> tokio::sync::OwnedMutexGuard<()> {
        match self {
            Self::Taken(guard) => guard,
            Self::Queued(queued) => queued.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::api::Lease;
    use crate::sandboxes::tests::held_lease;

    fn at(seconds: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + seconds, 0).unwrap()
    }

    fn held(epoch: u64) -> HeldLease {
        let mut lease = Lease::unheld(15);
        lease.epoch = epoch;
        held_lease(lease, at(0))
    }

    fn watch() -> Watch {
        Watch {
            last_full_pass: at(0),
            detached_since: None,
            last_active: None,
            checkpointable: true,
            last_checkpoint: at(0),
        }
    }

    #[test]
    fn a_start_that_takes_the_hold_up_leaves_it_held_not_starting() {
        let (state, said) = LocalState::Idle.wait_to_acquire();
        assert!(said, "the client is told LOCK_ACQUIRING the first time");
        let state = state.begin_start().done_acquiring();
        assert!(state.is_starting() && state.is_busy());
        // The start's guard ends after the hold is taken up: it stays held.
        let state = LocalState::hold(held(3), watch(), None).start_ended();
        assert!(!state.is_starting());
        assert_eq!(state.held().map(|held| held.epoch), Some(3));
        assert!(state.watch().is_some());
    }

    #[test]
    fn a_start_that_gives_way_goes_back_to_its_wait_with_its_rings() {
        let mut state = LocalState::Idle.wait_to_acquire().0;
        let every = chrono::Duration::seconds(5);
        let handoff = state.handoff_mut().unwrap();
        let due = handoff.ring_due(at(0), every);
        assert!(!due, "the first ring came with the intent");
        assert!(!handoff.ring_due(at(4), every));
        let mut state = state.begin_start().start_ended();
        assert!(
            matches!(state, LocalState::Acquiring(Handoff { rung_at: Some(t), .. }) if t == at(0))
        );
        assert!(state.handoff_mut().unwrap().ring_due(at(5), every));
        let (state, said) = state.wait_to_acquire();
        assert!(!said, "LOCK_ACQUIRING is said once per wait");
        assert!(!state.is_busy());
    }

    #[test]
    fn a_handoff_awaits_each_image_once_and_a_late_landing_leaves_a_later_wait() {
        let mut handoff = Handoff::default();
        assert!(handoff.await_image(3), "the first wait for epoch 3's image");
        assert!(!handoff.await_image(3), "one task per image");
        handoff.image_landed(2);
        assert_eq!(handoff.image, HandoffImage::Awaited { epoch: 3 });
        handoff.image_landed(3);
        assert_eq!(handoff.image, HandoffImage::Landed { epoch: 3 });
        assert!(handoff.await_image(4), "a later hold's image is awaited");
        // The phases travel with the wait through a start that gives way.
        let state = LocalState::Acquiring(handoff).begin_start().start_ended();
        assert!(
            matches!(state, LocalState::Acquiring(h) if h.image == HandoffImage::Awaited { epoch: 4 })
        );
    }

    #[test]
    fn a_start_that_fails_after_its_wait_ended_leaves_nothing() {
        let state = LocalState::Idle.wait_to_acquire().0.begin_start();
        let state = state.done_acquiring().start_ended();
        assert!(matches!(state, LocalState::Idle));
        let state = LocalState::Idle.begin_start().start_ended();
        assert!(matches!(state, LocalState::Idle));
    }

    #[test]
    fn a_hold_is_never_started_again_nor_renewed_back_after_it_ended() {
        let state = LocalState::hold(held(3), watch(), None).begin_start();
        assert!(!state.is_starting(), "a held sandbox is not started");
        let state = state.renewed(held(4));
        assert_eq!(state.held().map(|held| held.epoch), Some(4));
        let state = state.released().renewed(held(5));
        let idle = matches!(state, LocalState::Idle);
        assert!(idle, "a renewal after a stop holds nothing");
    }

    #[test]
    fn a_loss_ends_the_hold_and_is_remembered_until_a_new_wait_or_its_memory_ends() {
        let memory = std::time::Duration::from_secs(600);
        let t0 = tokio::time::Instant::now();
        let state = LocalState::hold(held(3), watch(), None).lost(t0);
        assert!(state.held().is_none() && state.watch().is_none() && !state.is_busy());
        assert!(state.lost_within(t0 + memory / 2, memory));
        assert!(!state.lost_within(t0 + memory, memory));
        // A renewal or a release that comes after the loss holds nothing.
        let state = state.renewed(held(4)).released();
        assert!(state.lost_within(t0, memory));
        let (state, said) = state.wait_to_acquire();
        let ended = said && !state.lost_within(t0, memory);
        assert!(ended, "a new wait ends the loss");
        assert!(matches!(
            state.lost(t0).begin_start(),
            LocalState::Starting { handoff: None }
        ));

        let slots = Slots::default();
        let (old, new) = (SandboxId::from_u128(1), SandboxId::from_u128(2));
        slots.update(&old, |slot| slot.step(|state| (state.lost(t0), ())));
        slots.forget_losses(t0 + memory / 2, memory);
        assert_eq!(slots.all().len(), 1, "a recent loss is kept");
        let later = t0 + memory;
        slots.update(&new, |slot| slot.step(|state| (state.lost(later), ())));
        slots.forget_losses(later, memory);
        assert!(slots.view(&new, |slot| slot.state.lost_within(later, memory)));
        let kept = slots.all().contains_key(&old);
        assert!(!kept, "an old loss goes with its slot");
    }

    #[test]
    fn a_slot_goes_when_its_last_field_empties() {
        let (slots, id) = (Slots::default(), SandboxId::from_u128(7));
        slots.update(&id, |slot| slot.step(|state| (state.begin_start(), ())));
        assert_eq!(slots.all().len(), 1);
        slots.update(&id, |slot| slot.waiting = Some(at(0)));
        slots.update(&id, |slot| slot.step(|state| (state.start_ended(), ())));
        assert_eq!(slots.all().len(), 1, "a client still waits");
        slots.update(&id, |slot| slot.waiting = None);
        assert!(slots.all().is_empty());
    }

    /// Turns come in the order they were asked for, not the order their tasks run: an attach's spec
    /// write issued after a checkpoint intent's lands after it, even when its task runs first.
    /// Another sandbox's writes never wait for this one's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn write_turns_come_in_the_order_they_were_asked_for_and_per_sandbox() {
        let (known, one, other) = (Slots::default(), SandboxId::random(), SandboxId::random());
        let held = known.write_turn(&one).await;
        let (first, second) = (
            known.queue_for_write_turn(&one),
            known.queue_for_write_turn(&one),
        );
        let queued = matches!(
            (&first, &second),
            (WriteTurn::Queued(_), WriteTurn::Queued(_))
        );
        assert!(queued, "both wait while the turn is held");
        let free = matches!(known.queue_for_write_turn(&other), WriteTurn::Taken(_));
        assert!(free, "another sandbox's turn is free");
        let (order, order_rx) = tokio::sync::mpsc::unbounded_channel();
        let run = |turn: WriteTurn, name: &'static str| {
            let order = order.clone();
            async move {
                let _turn = turn.wait().await;
                order.send(name).unwrap();
            }
        };
        let second = tokio::spawn(run(second, "second"));
        tokio::task::yield_now().await;
        let first = tokio::spawn(run(first, "first"));
        drop(held);
        first.await.unwrap();
        second.await.unwrap();
        drop(order);
        let mut order_rx = order_rx;
        let (a, b) = (order_rx.recv().await, order_rx.recv().await);
        assert_eq!((a, b), (Some("first"), Some("second")));
    }
}
