//! The reconciler's decision table: a pure function from what a full pass
//! observed (`metadata.json`, `lock.json`, this instance's hold and runtime)
//! to the ONE next step (`docs/architecture.md`, "The reconcile loop"). No
//! I/O here, so each row is a unit test (as kube-runtime's `watcher` keeps
//! `State` + `step()`). Rows are tried top to bottom; the first match wins.
//!
//! [`decide_light`] lets a quiet held sandbox skip the full read (upkeep
//! only; the departure watch reads both objects once) on the full table's
//! stop and hand-over conditions ([`still_ours`], [`wanted_elsewhere`]).

use chrono::{DateTime, Utc};

use crate::api::{DesiredState, InstanceId, Lease, Phase, SandboxMetadata};
use crate::leasing::HeldLease;

/// What a full pass saw.
#[derive(Debug, Clone)]
pub(crate) struct Observed<'a> {
    pub me: &'a InstanceId,
    pub now: DateTime<Utc>,
    /// `None`: `metadata.json` does not exist (purged, or deleted by hand).
    pub metadata: Option<&'a SandboxMetadata>,
    /// `None`: no `lock.json`.
    pub lock: Option<&'a Lease>,
    pub held: Option<&'a HeldLease>,
    /// This instance may act on `held` (its instance lease vouches for it).
    pub vouched: bool,
    pub running_here: bool,
    /// A pass of this instance is acquiring and starting it right now.
    pub starting_here: bool,
    /// The lock's hold may be taken over (`Leases::holder_gone`): no holder,
    /// or its own lease (plus skew) and its holder's instance lease ran out.
    pub holder_gone: bool,
    /// A client here waits for the sandbox to start (it asked for it here).
    pub waiting_here: bool,
    pub checkpoint_due: bool,
    /// This instance is shutting down: it starts nothing more.
    pub draining: bool,
    /// Why the bucket was unreachable, if so: a read of either object or a re-verifying lock write
    /// failed in the store (not an invalid document); `metadata` and `lock` then mean nothing.
    pub unreachable: Option<&'a str>,
}

/// The one next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Bucket unreachable, the hold here unvouched: it may be taken over
    /// meanwhile (two copies must never run). Stop, write nothing.
    CutOff { why: String },
    /// Bucket unreachable, nothing held here at risk: fail the pass, retry.
    Retry { why: String },
    /// `metadata.json` is gone: stop what runs here, write nothing.
    StopVanished,
    /// Nothing here, nothing to do until something happens.
    Nothing,
    /// Hold lost (lock: another holder/epoch; `status`: newer): stop, no write.
    StopLost { holder: Option<InstanceId> },
    /// The local sandbox died: record `Failed`, release.
    MarkDied,
    /// Desired `deleted`: destroy, tombstone, release.
    Delete,
    /// Desired `checkpointed` without `enable_checkpoint`: say so, keep running.
    RefuseCheckpoint,
    /// Desired `checkpointed`: checkpoint, record, release.
    CheckpointAndRelease,
    /// Another instance's live intent: checkpoint (forced per policy), release.
    HandOver,
    /// The instance lease lapsed since the hold was taken: one conditional
    /// lock write first, then decide again on what it renewed or found.
    Reverify,
    /// Keep running; look again at the resync (or sooner while watching).
    KeepRunning,
    /// Running here but `status` lags (its write after `SANDBOX_RUNNING` is
    /// pending or failed, or the lock has a newer checkpoint): record it.
    RecordRunning,
    /// The periodic checkpoint in place is due.
    PeriodicCheckpoint,
    /// The lock names this instance and a client here asked for it (a
    /// transfer, or a create or attach that took the hold): adopt and start.
    Adopt,
    /// The lock names this instance, which does not run the sandbox.
    ReleaseOrphan { epoch: u64 },
    /// A tombstone: remove the objects once the retention has passed.
    Purge,
    /// Desired `deleted`, held elsewhere by a live holder: it converges it.
    AwaitHolder,
    /// Desired `deleted`, nobody holds it: write the tombstone under a lease.
    Tombstone,
    /// Desired `running`, not wanted here: tell a waiting client, if any.
    NotWantedHere,
    /// Desired `checkpointed`, not held here: tell a client waiting here (its
    /// `running` overwritten, e.g. by the holder's shutdown) to attach again.
    CheckpointedMeanwhile,
    /// Desired `running`, wanted here, hold free or holder gone: acquire, then restore or create.
    Acquire,
    /// Desired `running`, wanted here, but this instance is shutting down: tell a client waiting
    /// here to attach again, withdraw the intent, release a hold transferred here at `release`.
    ShuttingDown { release: Option<u64> },
    /// Desired `running`, wanted here, another live holder: it hands over in
    /// one write naming this instance; poll soon, re-ring lest a ring was lost.
    AwaitHandover { holder: InstanceId },
}

pub(crate) fn decide(seen: &Observed<'_>) -> Step {
    if let Some(why) = seen.unreachable {
        let why = why.to_owned();
        return if seen.held.is_some() && !seen.vouched {
            Step::CutOff { why }
        } else {
            Step::Retry { why }
        };
    }
    let Some(metadata) = seen.metadata else {
        return if seen.held.is_some() || seen.running_here {
            Step::StopVanished
        } else {
            Step::Nothing
        };
    };
    // A tombstone is final, even if its spec is edited (decision 28).
    let tombstone = metadata.status.phase == Phase::Deleted;
    if let Some(held) = seen.held {
        if !still_ours(seen.me, seen.lock, held) || metadata.status.epoch > held.epoch {
            // The lock names another holder or epoch, or `status` a newer
            // holder's record (its fence, whatever lock this pass read).
            return Step::StopLost {
                holder: seen
                    .lock
                    .and_then(|lock| lock.holder.clone())
                    .filter(|holder| holder != seen.me),
            };
        }
        if tombstone && !seen.running_here {
            // Tombstoned under this hold, its release still to land.
            return Step::Delete;
        }
        if !seen.running_here {
            return Step::MarkDied;
        }
        if !seen.vouched {
            // Another instance may take the hold from now on, and the steps below may stop or kill
            // the sandbox before a fenced write fails: renew first.
            return Step::Reverify;
        }
        return match metadata.spec.desired_state {
            DesiredState::Deleted => Step::Delete,
            DesiredState::Checkpointed if !metadata.spec.enable_checkpoint => {
                Step::RefuseCheckpoint
            }
            DesiredState::Checkpointed => Step::CheckpointAndRelease,
            DesiredState::Running => {
                if wanted_elsewhere(seen.me, seen.lock, seen.now) && metadata.spec.enable_checkpoint
                {
                    Step::HandOver
                } else if status_behind(seen.me, metadata, held, seen.lock) {
                    Step::RecordRunning
                } else if seen.checkpoint_due {
                    Step::PeriodicCheckpoint
                } else {
                    Step::KeepRunning
                }
            }
        };
    }
    if let Some(lock) = seen.lock.filter(|lock| lock.is_held_by(seen.me))
        && !seen.starting_here
    {
        let wanted =
            metadata.spec.desired_state == DesiredState::Running && seen.waiting_here && !tombstone;
        return match (wanted, seen.draining) {
            (true, false) => Step::Adopt,
            (true, true) => Step::ShuttingDown {
                release: Some(lock.epoch),
            },
            (false, _) => Step::ReleaseOrphan { epoch: lock.epoch },
        };
    }
    if tombstone {
        // Spec set back by hand: neither started nor purged here (an edit of
        // `status` must not cost data); `sandboxctl delete` or `gc` finish it.
        return if metadata.spec.desired_state == DesiredState::Deleted {
            Step::Purge
        } else {
            Step::Nothing
        };
    }
    match metadata.spec.desired_state {
        DesiredState::Deleted if seen.lock.is_some() && !seen.holder_gone => Step::AwaitHolder,
        DesiredState::Deleted => Step::Tombstone,
        DesiredState::Checkpointed => Step::CheckpointedMeanwhile,
        DesiredState::Running => match seen.lock {
            // A start already under way finishes; the drain checkpoints it.
            Some(lock)
                if seen.draining
                    && !seen.starting_here
                    && (seen.waiting_here || lock.wanted_by_me(seen.me, seen.now)) =>
            {
                Step::ShuttingDown { release: None }
            }
            Some(lock) if lock.wanted_by_me(seen.me, seen.now) => match &lock.holder {
                Some(holder) if holder != seen.me && !seen.holder_gone => Step::AwaitHandover {
                    holder: holder.clone(),
                },
                _ => Step::Acquire,
            },
            _ => Step::NotWantedHere,
        },
    }
}

/// `lock` still names this hold at its epoch (if not: [`Step::StopLost`]).
pub(crate) fn still_ours(me: &InstanceId, lock: Option<&Lease>, held: &HeldLease) -> bool {
    lock.is_some_and(|lock| lock.is_held_by(me) && lock.epoch == held.epoch)
}

/// `lock` carries another instance's live intent ([`Step::HandOver`]).
pub(crate) fn wanted_elsewhere(me: &InstanceId, lock: Option<&Lease>, now: DateTime<Utc>) -> bool {
    lock.is_some_and(|lock| lock.wanted_elsewhere(me, now).is_some())
}

/// What a sandbox held here asks for at the shutdown drain: `None` if its pass finishes by itself
/// (being deleted, decision 28; or wanted elsewhere: `checkpointed` over that attach's `running`
/// would strand it); else a checkpoint, or deletion if not checkpointable (or gone).
pub(crate) fn drain_to(
    me: &InstanceId,
    metadata: Option<&SandboxMetadata>,
    lock: Option<&Lease>,
    now: DateTime<Utc>,
) -> Option<DesiredState> {
    match metadata {
        Some(metadata) if metadata.is_deleted() => None,
        Some(metadata) if metadata.spec.enable_checkpoint => {
            (!wanted_elsewhere(me, lock, now)).then_some(DesiredState::Checkpointed)
        }
        _ => Some(DesiredState::Deleted),
    }
}

/// What a pass knows before it reads both objects; fields named as in [`Observed`] mean the same.
#[derive(Debug, Clone)]
pub(crate) struct Quiet<'a> {
    pub me: &'a InstanceId,
    pub now: DateTime<Utc>,
    /// Something asked for a full pass (an intent written, a step re-deciding).
    pub full_pass_wanted: bool,
    pub held: Option<&'a HeldLease>,
    /// The resync is due (the last full pass was a resync interval ago).
    pub resync_due: bool,
    pub checkpoint_due: bool,
    pub running_here: bool,
    /// Client left within the detached window: departure watch (decision 7).
    pub watching: bool,
    /// The departure watch's read of the lock, once made (`Some(None)`: none).
    pub lock_read: Option<Option<&'a Lease>>,
    pub vouched: bool,
}

/// What a quiet pass does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LightStep {
    /// Read both objects and ask [`decide`].
    Full,
    /// Departure watch: read both objects at once, then ask again with them.
    ReadBoth,
    /// The watch's read shows a lost hold or another's intent: full pass on it.
    Changed,
    /// Nothing changed: upkeep; look again at the resync or next watch poll.
    Upkeep,
}

/// The light pass's table: a held sandbox nothing happened to stays light
/// until its resync; what the full table acts on (a lost hold, another's
/// intent, a lapsed instance lease, a death, a due checkpoint) goes full.
pub(crate) fn decide_light(seen: &Quiet<'_>) -> LightStep {
    let Some(held) = seen.held else {
        return LightStep::Full;
    };
    if seen.full_pass_wanted || seen.resync_due || seen.checkpoint_due || !seen.running_here {
        return LightStep::Full;
    }
    if seen.watching {
        let Some(lock) = seen.lock_read else {
            return LightStep::ReadBoth;
        };
        if !still_ours(seen.me, lock, held) || wanted_elsewhere(seen.me, lock, seen.now) {
            return LightStep::Changed;
        }
    }
    if !seen.vouched {
        // The full table re-verifies the hold (or stops it).
        return LightStep::Full;
    }
    LightStep::Upkeep
}

/// True while `status` lacks what runs here: this epoch, `Running` under
/// this holder, the newest checkpoint (the lock may carry a newer one).
pub(crate) fn status_behind(
    me: &InstanceId,
    metadata: &SandboxMetadata,
    held: &HeldLease,
    lock: Option<&Lease>,
) -> bool {
    let status = &metadata.status;
    status.epoch < held.epoch
        || status.phase != Phase::Running
        || status.holder.as_ref() != Some(me)
        || lock.is_some_and(|lock| {
            let mut folded = status.clone();
            crate::sandboxes::record_carried(&mut folded, lock, usize::MAX);
            folded.latest_checkpoint != status.latest_checkpoint
        })
}

#[cfg(test)]
mod tests;
