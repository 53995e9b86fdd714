//! The reconciler's decision table: a pure function from what a full pass
//! observed (the sandbox's `metadata.json` and `lock.json`, this instance's
//! hold and runtime) to the ONE next step toward the desired state
//! (`docs/architecture.md`, "The reconcile loop"). The reconciler reads, asks
//! [`decide`], and performs the step; nothing here does I/O, so each row is a
//! unit test below (kube-runtime's `watcher` keeps its `State` + `step()` the
//! same way).
//!
//! Rows are tried top to bottom; the first that matches wins.
//!
//! A held sandbox nothing happened to is not read in full on every pass:
//! [`decide_light`] says whether its pass may stay light (lease upkeep, and
//! in the departure watch one read of the lock), on the same conditions the
//! full table stops or hands over on ([`still_ours`], [`wanted_elsewhere`]).

use chrono::{DateTime, Utc};

use crate::api::{CheckpointRef, DesiredState, InstanceId, Lease, Phase, SandboxMetadata};
use crate::leasing::HeldLease;

/// What a full pass saw.
#[derive(Debug, Clone)]
pub(crate) struct Observed<'a> {
    /// This instance.
    pub me: &'a InstanceId,
    pub now: DateTime<Utc>,
    /// `None`: `metadata.json` does not exist (purged, or deleted by hand).
    pub metadata: Option<&'a SandboxMetadata>,
    /// `None`: no `lock.json`.
    pub lock: Option<&'a Lease>,
    /// This instance's hold, if it runs the sandbox.
    pub held: Option<&'a HeldLease>,
    /// This instance may act on `held` (its instance lease vouches for it).
    pub vouched: bool,
    /// The local runtime runs the sandbox.
    pub running_here: bool,
    /// A pass of this instance is acquiring and starting it right now.
    pub starting_here: bool,
    /// The lock's hold may be taken over: it names no holder, or its own
    /// lease (plus the skew) and its holder's instance lease have both run
    /// out (`Leases::holder_gone`).
    pub holder_gone: bool,
    /// A client here waits for the sandbox to start (it asked for it here).
    pub waiting_here: bool,
    /// A periodic checkpoint of the held sandbox is due.
    pub checkpoint_due: bool,
    /// Why the bucket could not be reached, if it could not: a read of
    /// either object, or a re-verification's write of the lock, failed in
    /// the store (not an operator's invalid document). `metadata` and
    /// `lock` then say nothing.
    pub unreachable: Option<&'a str>,
}

/// The one next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// The bucket cannot be reached and the hold here is no longer vouched
    /// for: it cannot be re-verified, and another instance may take it
    /// over meanwhile (two copies must never run). Stop, write nothing.
    CutOff { why: String },
    /// The bucket cannot be reached, and nothing held here is at risk: the
    /// pass fails and is retried.
    Retry { why: String },
    /// `metadata.json` is gone: stop what runs here, write nothing.
    StopVanished,
    /// Nothing here, nothing to do until something happens.
    Nothing,
    /// The lock names another holder or epoch, or `status` a newer
    /// holder's record: stop without writing.
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
    /// write to the lock before anything else is done to the sandbox. The
    /// table then decides again, on the renewed hold if the write landed,
    /// else on what it found (the lock naming another, or the bucket
    /// unreachable).
    Reverify,
    /// Keep running; look again at the resync (or sooner while watching).
    KeepRunning,
    /// Held and running here, but `status` does not say so yet (a start
    /// writes it after `SANDBOX_RUNNING`, or that write failed), or the lock
    /// carries a newer checkpoint than `status` records: record it.
    RecordRunning,
    /// The periodic checkpoint in place is due.
    PeriodicCheckpoint,
    /// The lock names this instance, which a client here asked for it on:
    /// a transfer from the previous holder, or a create or attach that took
    /// the hold in its own write. Take the hold up and start it.
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
    /// Desired `checkpointed`, not held here: a client here that asked for it
    /// (its `running` was overwritten, e.g. by its holder's shutdown) is told
    /// to attach again rather than left waiting.
    CheckpointedMeanwhile,
    /// Desired `running`, wanted here, and the hold free or its holder
    /// gone: acquire, then restore or create.
    Acquire,
    /// Desired `running`, wanted here, held by another live holder: it hands
    /// the sandbox over (in one write naming this instance); look again soon,
    /// ringing it again now and then in case a ring was lost.
    AwaitHandover { holder: InstanceId },
}

/// The decision table.
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
    // A tombstone is final, whatever its spec says now (an operator's
    // edit): it is never started again (decision 28).
    let tombstone = metadata.status.phase == Phase::Deleted;
    if let Some(held) = seen.held {
        if !still_ours(seen.me, seen.lock, held) || metadata.status.epoch > held.epoch {
            // Another holder or epoch in the lock, or a newer holder's
            // record in `status` (its fence: it took the sandbox after this
            // hold, whatever lock this pass read).
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
            // Another instance may take the hold over from now on, and the
            // steps below stop or kill what runs here before their fenced
            // write could fail: the hold is renewed first (a hand-over
            // taken from a stale view once killed an execution and
            // reported its end on an instance that had lost the sandbox).
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
        return if metadata.spec.desired_state == DesiredState::Running
            && seen.waiting_here
            && !tombstone
        {
            Step::Adopt
        } else {
            Step::ReleaseOrphan { epoch: lock.epoch }
        };
    }
    if tombstone {
        // Its spec set back by hand: neither started nor purged here (an
        // operator's edit of `status` must not cost a sandbox its data);
        // `sandboxctl delete` or `gc` finish it.
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

/// True while `lock` still names this instance's hold at its epoch (else
/// the hold was lost: [`Step::StopLost`]).
pub(crate) fn still_ours(me: &InstanceId, lock: Option<&Lease>, held: &HeldLease) -> bool {
    lock.is_some_and(|lock| lock.is_held_by(me) && lock.epoch == held.epoch)
}

/// True when `lock` carries another instance's live intent (a holder hands
/// the sandbox over: [`Step::HandOver`]).
pub(crate) fn wanted_elsewhere(me: &InstanceId, lock: Option<&Lease>, now: DateTime<Utc>) -> bool {
    lock.is_some_and(|lock| lock.wanted_elsewhere(me, now).is_some())
}

/// What a sandbox held here asks for at shutdown (the drain): `None` when
/// its pass finishes what is under way by itself (being deleted already,
/// decision 28; or wanted by a client elsewhere, which a hand-over serves:
/// overwriting that attach's `running` with `checkpointed` would leave it
/// waiting for a start that never comes); else a checkpoint, or a deletion
/// for a sandbox that cannot be checkpointed (or whose metadata is gone).
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

/// What a pass of a sandbox knows before it reads both objects.
#[derive(Debug, Clone)]
pub(crate) struct Quiet<'a> {
    pub me: &'a InstanceId,
    pub now: DateTime<Utc>,
    /// Something asked for a full pass (an intent was written, a step
    /// wants to decide again).
    pub full_pass_wanted: bool,
    /// This instance's hold, if it runs the sandbox.
    pub held: Option<&'a HeldLease>,
    /// The resync is due (the last full pass was a resync interval ago).
    pub resync_due: bool,
    /// A periodic checkpoint of the held sandbox is due.
    pub checkpoint_due: bool,
    /// The local runtime runs the sandbox.
    pub running_here: bool,
    /// Its client left within the detached window: the departure watch
    /// reads the lock on each pass (decision 7).
    pub watching: bool,
    /// The departure watch's read of the lock, once made (`Some(None)`: no
    /// lock).
    pub lock_read: Option<Option<&'a Lease>>,
    /// This instance may act on `held` (its instance lease vouches for it).
    pub vouched: bool,
}

/// What a quiet pass does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LightStep {
    /// Read both objects and ask [`decide`].
    Full,
    /// The departure watch: read both objects at once, then ask again with
    /// the lock read.
    ReadBoth,
    /// The departure watch's read shows the hold lost or wanted elsewhere:
    /// a full pass decides on those reads (not on a second round trip).
    Changed,
    /// Nothing changed: lease upkeep only, look again at the resync (or at
    /// the watch's next poll).
    Upkeep,
}

/// The light pass's table: a held sandbox nothing happened to stays light
/// until its resync; anything the full table would act on (another holder
/// or epoch, another instance's intent, a lapsed instance lease, a death,
/// a due checkpoint) takes a full pass.
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

/// True when `status` does not yet record what runs here: this holder's
/// epoch, phase `Running` with this instance as holder, and the newest
/// checkpoint (the lock may carry one newer than `status` records).
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
        || lock
            .and_then(|lock| lock.checkpoint.as_ref())
            .is_some_and(|carried| is_newer(carried, status.latest_checkpoint.as_ref()))
}

/// True when `checkpoint` is newer than `than` (by epoch, then time taken).
pub(crate) fn is_newer(checkpoint: &CheckpointRef, than: Option<&CheckpointRef>) -> bool {
    than.is_none_or(|than| {
        (checkpoint.epoch, checkpoint.created_at) > (than.epoch, than.created_at)
            && checkpoint.path != than.path
    })
}

#[cfg(test)]
mod tests;
