//! What this instance knows only locally about sandboxes it holds or waits
//! for: holds, last full pass and checkpoint, whether the client is attached
//! or active (how closely watched; doorbell pace), starts, waiting clients.
//! None of it is in the bucket; it is rebuilt from it after a restart.

use std::sync::PoisonError;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::api::SandboxId;
use crate::leasing::HeldLease;

use super::{Reconciler, chrono_duration};

/// How long a loss is remembered for the executions it cut off (their
/// relays look within a poll of the loss; the rest is margin).
pub(super) const LOST_MEMORY: std::time::Duration = std::time::Duration::from_secs(600);

/// Per held sandbox: when its last full pass was, and since when its client
/// is away (`None`: attached, or never told).
#[derive(Debug, Clone, Copy)]
pub(super) struct Watch {
    pub(super) last_full_pass: DateTime<Utc>,
    pub(super) detached_since: Option<DateTime<Utc>>,
    /// When its attached client last attached or sent a frame.
    pub(super) last_active: Option<DateTime<Utc>>,
    /// Created with `enable_checkpoint` (periodic checkpoints apply).
    pub(super) checkpointable: bool,
    /// When it was last checkpointed or started here.
    pub(super) last_checkpoint: DateTime<Utc>,
}

impl Reconciler {
    pub fn held(&self, sandbox: &SandboxId) -> Option<HeldLease> {
        self.slots.view(sandbox, |slot| slot.state.held().cloned())
    }

    /// The hooks' binding of a sandbox held here, if a hook keeps anything.
    pub fn hook_binding(&self, sandbox: &SandboxId) -> Option<crate::hooks::HookBinding> {
        self.slots.view(sandbox, |slot| slot.state.hooks().cloned())
    }

    /// Held sandboxes and transitions, for `sandboxd_sandboxes{phase}`.
    pub fn census(&self) -> crate::sandboxes::metrics::Census {
        self.slots.census()
    }

    pub fn state_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.slots.changed()
    }

    pub fn held_sandboxes(&self) -> Vec<SandboxId> {
        self.held_where(|_| true)
    }

    /// The sandboxes held here whose hold `keep` picks.
    fn held_where(&self, keep: impl Fn(&HeldLease) -> bool) -> Vec<SandboxId> {
        let slots = self.slots.all();
        let held = slots
            .iter()
            .filter(|(_, slot)| slot.state.held().is_some_and(&keep));
        held.map(|(id, _)| id.clone()).collect()
    }

    /// Sandboxes held here or in a transition whose lock write is still under way: what a drain
    /// waits for, lest the process exit before a checkpoint's hand-back lands.
    pub fn unsettled(&self) -> usize {
        self.slots.unsettled()
    }

    /// Renewed: held under `held` from now on (unless it stopped meanwhile).
    pub(super) fn renewed(&self, sandbox: &SandboxId, held: HeldLease) {
        self.slots
            .update(sandbox, |slot| slot.step(|state| (state.renewed(held), ())));
    }

    pub(crate) fn is_starting(&self, sandbox: &SandboxId) -> bool {
        self.slots.view(sandbox, |slot| slot.state.is_starting())
    }

    pub(super) fn watch(&self, sandbox: &SandboxId) -> Option<Watch> {
        self.slots.view(sandbox, |slot| slot.state.watch().copied())
    }

    pub(super) fn update_watch(&self, sandbox: &SandboxId, change: impl FnOnce(&mut Watch)) {
        self.slots.update(sandbox, |slot| {
            if let Some(watch) = slot.state.watch_mut() {
                change(watch);
            }
        });
    }

    /// Whether the instance lease must be kept: a hold or start here now or
    /// within a lease duration (a release in flight, a lock naming it).
    pub fn needs_instance_lease(&self) -> bool {
        let now = self.clock.now();
        let busy = self.slots.all().values().any(|slot| slot.state.is_busy());
        let mut last = self
            .last_busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if busy {
            *last = Some(now);
            return true;
        }
        last.is_some_and(|at| now < at + self.leases.config().duration)
    }

    /// Holds the instance lease no longer vouches for: re-verify or stop each.
    pub fn unvouched(&self) -> Vec<SandboxId> {
        let instance_lease = self.leases.instance_lease();
        self.held_where(|held| !instance_lease.vouches_for(held.era))
    }

    pub(super) fn forget(&self, sandbox: &SandboxId) {
        self.slots
            .update(sandbox, |slot| slot.step(|state| (state.released(), ())));
    }

    /// The next pass of `sandbox` reads everything (an intent was written).
    pub fn want_full_pass(&self, sandbox: &SandboxId) {
        self.slots
            .update(sandbox, |slot| slot.full_pass_wanted = true);
    }

    pub(super) fn take_full_pass_wanted(&self, sandbox: &SandboxId) -> bool {
        self.slots
            .update(sandbox, |slot| std::mem::take(&mut slot.full_pass_wanted))
    }

    /// A client here waits for `sandbox` to start (its intent was written).
    pub(super) fn mark_waiting(&self, sandbox: &SandboxId) {
        let now = self.clock.now();
        self.slots.update(sandbox, |slot| {
            slot.waiting.get_or_insert(now);
        });
    }

    /// Since when a client here waited for `sandbox`, if any; ends the wait.
    pub(crate) fn take_waiting(&self, sandbox: &SandboxId) -> Option<DateTime<Utc>> {
        self.slots.update(sandbox, |slot| slot.waiting.take())
    }

    pub(crate) fn is_waiting(&self, sandbox: &SandboxId) -> bool {
        self.slots.view(sandbox, |slot| slot.waiting.is_some())
    }

    /// Whether a held, checkpointable sandbox's periodic checkpoint is due.
    pub(super) fn checkpoint_due(&self, sandbox: &SandboxId) -> bool {
        let Some(interval) = self.config.checkpoint_interval else {
            return false;
        };
        let now = self.clock.now();
        self.watch(sandbox).is_some_and(|watch| {
            watch.checkpointable && now >= watch.last_checkpoint + chrono_duration(interval)
        })
    }

    /// Stopped as lost: remembered (`LocalState::Lost`), forgetting old losses.
    pub(super) fn note_lost(&self, sandbox: &SandboxId) {
        let now = self.clock.instant();
        self.slots.forget_losses(now, LOST_MEMORY);
        self.slots
            .update(sandbox, |slot| slot.step(|state| (state.lost(now), ())));
    }

    /// Lost here within [`LOST_MEMORY`], with no wait or start since.
    pub fn was_lost(&self, sandbox: &SandboxId) -> bool {
        let now = self.clock.instant();
        self.slots
            .view(sandbox, |slot| slot.state.lost_within(now, LOST_MEMORY))
    }

    /// API news: a client attached to (or left) a sandbox held here.
    pub fn client_attached(&self, sandbox: &SandboxId, attached: bool) {
        let now = self.clock.now();
        self.update_watch(sandbox, |watch| {
            watch.detached_since = if attached { None } else { Some(now) };
            if attached {
                watch.last_active = Some(now);
            }
        });
    }

    pub fn client_active(&self, sandbox: &SandboxId) {
        let now = self.clock.now();
        self.update_watch(sandbox, |watch| watch.last_active = Some(now));
    }

    /// The doorbell loop's sleep: the departure watch's interval while a client left a sandbox held
    /// here within the fast window (its next attach, likely elsewhere, rings its intent: decision
    /// 27), the active one while an attached client sent something within it, else idle.
    pub fn doorbell_interval(&self) -> Duration {
        let now = self.clock.now();
        let window = chrono_duration(self.config.detached_window);
        let (mut watching, mut active) = (false, false);
        let slots = self.slots.all();
        for watch in slots.values().filter_map(|slot| slot.state.watch()) {
            match watch.detached_since {
                Some(since) => watching |= now < since + window,
                None => active |= watch.last_active.is_some_and(|at| now < at + window),
            }
        }
        if watching {
            self.config
                .detached_poll
                .min(self.config.doorbell_poll_active)
        } else if active {
            self.config.doorbell_poll_active
        } else {
            self.config.doorbell_poll
        }
    }
}
