//! The decision table, row by row, on builder fixtures (`Case::held_here()`).

use DesiredState::{Checkpointed, Deleted};
use chrono::{Duration, TimeZone, Utc};

use super::*;
use crate::api::{AttachIntent, CheckpointRef, ExtraFields, SandboxId};
use crate::sandboxes::tests::{TOKEN_HASH, held_lease};

struct Case {
    me: InstanceId,
    now: DateTime<Utc>,
    metadata: Option<SandboxMetadata>,
    lock: Option<Lease>,
    held: Option<HeldLease>,
    vouched: bool,
    running_here: bool,
    starting_here: bool,
    holder_gone: bool,
    waiting_here: bool,
    checkpoint_due: bool,
    draining: bool,
    unreachable: Option<&'static str>,
}

fn instance(name: &str) -> InstanceId {
    InstanceId::parse(name).unwrap()
}

/// The table's `StopLost` naming `holder`.
fn lost_to(holder: &str) -> Step {
    Step::StopLost {
        holder: Some(instance(holder)),
    }
}

impl Case {
    /// Desired `running`, checkpointable, nobody holds it, no intent.
    fn new() -> Self {
        let now = Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, 0).unwrap();
        let mut metadata = SandboxMetadata::new(SandboxId::from_u128(1), now, TOKEN_HASH.into());
        metadata.spec.enable_checkpoint = true;
        Self {
            me: instance("a"),
            now,
            metadata: Some(metadata),
            lock: Some(Lease::unheld(15)),
            held: None,
            vouched: false,
            running_here: false,
            starting_here: false,
            holder_gone: true,
            waiting_here: false,
            checkpoint_due: false,
            draining: false,
            unreachable: None,
        }
    }

    /// Held and run here at epoch 3, vouched for.
    fn held_here() -> Self {
        let mut case = Self::new().held_by("a", 3);
        let lock = case.lock.as_mut().unwrap();
        lock.acquired_at = Some(case.now);
        case.held = Some(held_lease(lock.clone(), case.now));
        let status = &mut case.metadata.as_mut().unwrap().status;
        status.phase = Phase::Running;
        status.holder = Some(instance("a"));
        status.epoch = 3;
        case.vouched = true;
        case.running_here = true;
        case.holder_gone = false;
        case
    }

    fn held_by(mut self, holder: &str, epoch: u64) -> Self {
        let lock = self.lock.get_or_insert_with(|| Lease::unheld(15));
        lock.holder = Some(instance(holder));
        lock.epoch = epoch;
        lock.renewed_at = Some(self.now);
        self.holder_gone = false;
        self
    }

    fn wanted_by(self, who: &str) -> Self {
        self.wanted_by_for(who, Duration::seconds(60))
    }

    /// An intent of `who`'s that runs out `ttl` from now.
    fn wanted_by_for(mut self, who: &str, ttl: Duration) -> Self {
        let now = self.now;
        self.lock.get_or_insert_with(|| Lease::unheld(15)).wanted_by = Some(AttachIntent {
            instance: instance(who),
            requested_at: now,
            expires_at: now + ttl,
            extra: ExtraFields::new(),
        });
        self
    }

    /// `self` after `change`: one field set apart, in one expression.
    fn with(mut self, change: impl FnOnce(&mut Self)) -> Self {
        change(&mut self);
        self
    }

    /// `self` with `change` made to its metadata (every fixture has some).
    fn with_metadata(self, change: impl FnOnce(&mut SandboxMetadata)) -> Self {
        self.with(|case| change(case.metadata.as_mut().unwrap()))
    }

    fn desired(self, desired: DesiredState) -> Self {
        self.with_metadata(|metadata| metadata.spec.desired_state = desired)
    }

    /// Checks that the table decides `expected`; `why` names the row.
    #[track_caller]
    fn decides(&self, expected: Step, why: &str) {
        assert_eq!(self.decide(), expected, "{why}");
    }

    fn decide(&self) -> Step {
        decide(&Observed {
            me: &self.me,
            now: self.now,
            metadata: self.metadata.as_ref(),
            lock: self.lock.as_ref(),
            held: self.held.as_ref(),
            vouched: self.vouched,
            running_here: self.running_here,
            starting_here: self.starting_here,
            holder_gone: self.holder_gone,
            waiting_here: self.waiting_here,
            checkpoint_due: self.checkpoint_due,
            draining: self.draining,
            unreachable: self.unreachable,
        })
    }
}

#[test]
fn metadata_gone_stops_what_runs_here_else_nothing() {
    let vanished = |case: Case| case.with(|case| case.metadata = None).decide();
    assert_eq!(vanished(Case::held_here()), Step::StopVanished);
    assert_eq!(vanished(Case::new()), Step::Nothing);
}

#[test]
fn a_lock_naming_another_holder_or_epoch_means_lost() {
    let case = Case::held_here().held_by("b", 4);
    case.decides(lost_to("b"), "another holder");
    let case = Case::held_here().held_by("a", 4);
    let lost = matches!(case.decide(), Step::StopLost { .. });
    assert!(lost, "a newer epoch of ours is not ours");
    let case = Case::held_here().with(|case| case.lock = None);
    assert_eq!(case.decide(), Step::StopLost { holder: None });
    // A newer record (epoch 4) fences the hold even if the lock predates it.
    let case = Case::held_here().with_metadata(|metadata| metadata.status.epoch = 4);
    case.decides(Step::StopLost { holder: None }, "a newer record in status");
}

#[test]
fn a_held_sandbox_that_died_is_marked_failed_else_converges_or_is_handed_over() {
    let case = Case::held_here().with(|case| case.running_here = false);
    assert_eq!(case.decide(), Step::MarkDied);
    let case = Case::held_here().desired(Deleted);
    case.decides(Step::Delete, "deleted");
    let case = Case::held_here().desired(Checkpointed);
    case.decides(Step::CheckpointAndRelease, "checkpointed");
    let case = case.with_metadata(|metadata| metadata.spec.enable_checkpoint = false);
    assert_eq!(case.decide(), Step::RefuseCheckpoint);
    // Another instance's live intent is a handover if checkpointable.
    assert_eq!(Case::held_here().wanted_by("b").decide(), Step::HandOver);
    let expired = Case::held_here().wanted_by_for("b", Duration::zero());
    expired.decides(Step::KeepRunning, "an expired intent is ignored");
    let case = Case::held_here().wanted_by("b");
    let case = case.with_metadata(|metadata| metadata.spec.enable_checkpoint = false);
    case.decides(Step::KeepRunning, "cannot move without checkpoints");
    assert_eq!(Case::held_here().wanted_by("a").decide(), Step::KeepRunning);
}

#[test]
fn a_lock_naming_this_instance_without_a_hold_is_an_orphan_unless_starting_or_adopted() {
    let case = Case::new().held_by("a", 7);
    assert_eq!(case.decide(), Step::ReleaseOrphan { epoch: 7 });
    let case = Case::new().held_by("a", 7).wanted_by("a");
    let case = case.with(|case| case.starting_here = true);
    case.decides(Step::Acquire, "its own start in flight is no orphan");
    // A client here waits for it: adopted.
    let waiting = Case::new().held_by("a", 4);
    let waiting = waiting.with(|case| case.waiting_here = true);
    waiting.decides(Step::Adopt, "a transfer or an own write");
    let case = waiting.desired(Checkpointed);
    case.decides(Step::ReleaseOrphan { epoch: 4 }, "no longer wanted running");
}

#[test]
fn a_draining_instance_starts_nothing_more_and_tells_its_waiting_client() {
    let draining = |case: Case| case.with(|case| case.draining = true);
    let waiting = |case: Case| case.with(|case| case.waiting_here = true);
    // A transfer (or a create's own hold) landing during the drain.
    let case = draining(waiting(Case::new().held_by("a", 4)));
    let release = Step::ShuttingDown { release: Some(4) };
    case.decides(release, "a hold transferred here is given back");
    let case = draining(Case::new().held_by("a", 4));
    case.decides(Step::ReleaseOrphan { epoch: 4 }, "nobody waits: an orphan");
    // Its own intent, free or held by a live holder: withdrawn, not pursued.
    let told = Step::ShuttingDown { release: None };
    for case in [
        Case::new().wanted_by("a"),
        Case::new().held_by("b", 2).wanted_by("a"),
    ] {
        draining(case).decides(told.clone(), "no acquisition while draining");
    }
    draining(waiting(Case::new())).decides(told, "its client is told");
    // A start already under way finishes (the drain then checkpoints it),
    // and what is held here is the drain's: decided as before.
    let case = draining(Case::new().held_by("a", 7).wanted_by("a"));
    let case = case.with(|case| case.starting_here = true);
    case.decides(Step::Acquire, "its own start in flight");
    assert_eq!(draining(Case::held_here()).decide(), Step::KeepRunning);
    assert_eq!(draining(Case::new()).decide(), Step::NotWantedHere);
}

#[test]
fn desired_deleted_and_not_held_purges_awaits_or_tombstones() {
    let case = Case::new().desired(Deleted);
    let case = case.with_metadata(|metadata| metadata.status.phase = Phase::Deleted);
    assert_eq!(case.decide(), Step::Purge);
    let case = Case::new().desired(Deleted).held_by("b", 2);
    assert_eq!(case.decide(), Step::AwaitHolder);
    let case = case.with(|case| case.holder_gone = true);
    assert_eq!(case.decide(), Step::Tombstone);
    let case = Case::new().desired(Deleted);
    case.decides(Step::Tombstone, "nobody holds it");
}

#[test]
fn a_tombstone_is_never_started_again_whatever_its_spec_says() {
    let tombstone = |case: Case| case.with_metadata(|m| m.status.phase = Phase::Deleted);
    // With its spec deleted it is purged (`desired_deleted_and_not_held_...`).
    for desired in [DesiredState::Running, Checkpointed] {
        // Its spec set back by hand: not started, not purged either.
        let case = tombstone(Case::new().desired(desired).wanted_by("a"));
        let case = case.with(|case| case.waiting_here = true);
        case.decides(Step::Nothing, &format!("{desired:?}"));
    }
    // A hold taken for it (an attach's own write) is released, not adopted.
    let case = tombstone(Case::new().held_by("a", 4).wanted_by("a"));
    let case = case.with(|case| case.waiting_here = true);
    assert_eq!(case.decide(), Step::ReleaseOrphan { epoch: 4 });
    // Tombstoned under a kept hold (release failed): deleted, not `Failed`.
    let case = tombstone(Case::held_here()).with(|case| case.running_here = false);
    assert_eq!(case.decide(), Step::Delete);
    // Running under a live hold, the phase is an edit: it is recorded again.
    assert_eq!(tombstone(Case::held_here()).decide(), Step::RecordRunning);
}

#[test]
fn desired_running_and_not_held_acquires_only_when_wanted_here() {
    assert_eq!(Case::new().wanted_by("a").decide(), Step::Acquire);
    assert_eq!(Case::new().wanted_by("b").decide(), Step::NotWantedHere);
    assert_eq!(Case::new().decide(), Step::NotWantedHere);
    let live_holder = Case::new().held_by("b", 2).wanted_by("a");
    let await_b = Step::AwaitHandover {
        holder: instance("b"),
    };
    live_holder.decides(await_b, "a live holder hands it over");
    // A holder whose lock and instance lease both ran out is taken over.
    let case = live_holder.with(|case| case.holder_gone = true);
    case.decides(Step::Acquire, "its holder gone");
    let case = Case::new().desired(Checkpointed);
    case.decides(Step::CheckpointedMeanwhile, "checkpointed meanwhile");
}

#[test]
fn a_held_sandbox_whose_status_lags_is_recorded_before_anything_else_routine() {
    let older = |case: Case| case.with_metadata(|metadata| metadata.status.epoch = 2);
    let case = older(Case::held_here());
    case.decides(Step::RecordRunning, "an older epoch");
    let case = Case::held_here().with_metadata(|m| m.status.phase = Phase::Restoring);
    case.decides(Step::RecordRunning, "not yet Running");
    let carried = Case::held_here().with(|case| {
        case.lock.as_mut().unwrap().checkpoint = Some(checkpoint(3, 10));
    });
    carried.decides(Step::RecordRunning, "the lock carries a newer checkpoint");
    let case = carried.with_metadata(|m| m.status.latest_checkpoint = Some(checkpoint(3, 10)));
    case.decides(Step::KeepRunning, "already recorded");
    let case = older(Case::held_here().wanted_by("b"));
    case.decides(Step::HandOver, "a handover comes first");
}

#[test]
fn a_due_periodic_checkpoint_is_taken_and_an_unvouched_hold_reverified_due_or_not() {
    let mut case = Case::held_here().with(|case| case.checkpoint_due = true);
    assert_eq!(case.decide(), Step::PeriodicCheckpoint);
    case.vouched = false;
    case.decides(Step::Reverify, "never on an unvouched hold");
    case.checkpoint_due = false;
    case.decides(Step::Reverify, "unvouched, nothing due");
}

/// An unvouched hold may be taken over any moment, and a hand-over, checkpoint
/// or delete stops what runs before its fenced write: each waits for the
/// renewal. Only what the read shows (a loss, a death) is acted on at once.
#[test]
fn an_unvouched_hold_is_renewed_before_it_is_handed_over_checkpointed_or_deleted() {
    let unvouched = |case: Case| case.with(|case| case.vouched = false);
    let refused = Case::held_here().desired(Checkpointed);
    let refused = refused.with_metadata(|metadata| metadata.spec.enable_checkpoint = false);
    let cases = [
        (Case::held_here().wanted_by("b"), "wanted elsewhere"),
        (Case::held_here().desired(Checkpointed), "checkpointed"),
        (Case::held_here().desired(Deleted), "deleted"),
        (refused, "a checkpoint refused"),
    ];
    for (case, why) in cases {
        assert_ne!(case.decide(), Step::Reverify, "{why}, vouched");
        unvouched(case).decides(Step::Reverify, why);
    }
    let died = unvouched(Case::held_here().with(|case| case.running_here = false));
    died.decides(Step::MarkDied, "its record is fenced and kills nothing");
    let lost = unvouched(Case::held_here().held_by("b", 4));
    lost.decides(lost_to("b"), "lost");
}

#[test]
fn newer_checkpoints_order_by_epoch_then_time() {
    assert!(checkpoint(2, 0).is_newer_than(None));
    assert!(checkpoint(3, 0).is_newer_than(Some(&checkpoint(2, 9))));
    assert!(checkpoint(2, 5).is_newer_than(Some(&checkpoint(2, 4))));
    assert!(!checkpoint(2, 4).is_newer_than(Some(&checkpoint(2, 5))));
    assert!(!checkpoint(2, 4).is_newer_than(Some(&checkpoint(2, 4))));
}

/// The latest checkpoint every reader counts, `status`'s folded with the
/// lock's: the newer of the two, unless the lock's hold took its checkpoint
/// over (`checkpoint_taken_over_at` at its epoch) and `status`'s is a later
/// record of an earlier epoch. Locks an earlier release wrote (no field, or
/// the field kept from an earlier epoch) read as before.
#[test]
fn a_late_record_of_an_earlier_hold_does_not_count_against_the_lock() {
    let counted = |lock: &str, recorded: CheckpointRef| {
        let mut lock: Lease = crate::api::decode(lock.as_bytes()).unwrap();
        lock.checkpoint = Some(checkpoint(1, 5));
        let mut status = crate::api::SandboxStatus {
            latest_checkpoint: Some(recorded),
            ..Default::default()
        };
        crate::sandboxes::record_carried(&mut status, &lock, usize::MAX);
        status.latest_checkpoint.unwrap()
    };
    let lock = |epoch: u64, taken_over_at: Option<u64>| {
        let field = taken_over_at.map_or(String::new(), |at| {
            format!(r#", "checkpoint_taken_over_at": {at}"#)
        });
        format!(
            r#"{{"apiVersion": "sandboxd.dev/v1", "holder": "b", "epoch": {epoch},
                "acquired_at": "2026-11-22T12:00:00Z", "lease_duration_s": 30{field}}}"#
        )
    };
    // This release's take-over at epoch 2 of the checkpoint of second 5.
    let taken_over = lock(2, Some(2));
    assert_eq!(counted(&taken_over, checkpoint(1, 9)), checkpoint(1, 5));
    assert_eq!(counted(&taken_over, checkpoint(2, 1)), checkpoint(2, 1));
    // An earlier release's lock: no field, or one an earlier hold wrote.
    let (unmarked, marked_earlier) = (lock(2, None), lock(3, Some(2)));
    assert_eq!(counted(&unmarked, checkpoint(1, 9)), checkpoint(1, 9));
    assert_eq!(counted(&marked_earlier, checkpoint(1, 9)), checkpoint(1, 9));
    assert_eq!(counted(&unmarked, checkpoint(1, 1)), checkpoint(1, 5));
}

fn checkpoint(epoch: u64, second: u32) -> CheckpointRef {
    CheckpointRef {
        bucket: "b".into(),
        path: format!("sandbox_checkpoints/{epoch}-{second}/checkpoint.img"),
        epoch,
        sha256: "0".repeat(64),
        size: 1,
        created_at: Utc.with_ymd_and_hms(2026, 11, 22, 12, 0, second).unwrap(),
        name: None,
        extra: ExtraFields::new(),
    }
}

/// A quiet pass of `Case::held_here`: running, vouched, nothing due, attached.
fn quiet<'a>(case: &'a Case) -> Quiet<'a> {
    Quiet {
        me: &case.me,
        now: case.now,
        full_pass_wanted: false,
        held: case.held.as_ref(),
        resync_due: false,
        checkpoint_due: false,
        running_here: true,
        watching: false,
        lock_read: None,
        vouched: true,
    }
}

/// One way a pass differs from a quiet one, for a table of them.
type QuietChange = fn(&mut Quiet<'_>);

/// A departure watch's pass of `case`, the lock as read (`None` before).
fn watching<'a>(case: &'a Case, lock_read: Option<Option<&'a Lease>>) -> Quiet<'a> {
    Quiet {
        watching: true,
        lock_read,
        ..quiet(case)
    }
}

#[test]
fn a_held_sandbox_stays_light_until_anything_the_full_table_acts_on_takes_a_full_pass() {
    let case = Case::held_here();
    assert_eq!(decide_light(&quiet(&case)), LightStep::Upkeep, "quiet");
    let changes: [(&str, QuietChange); 6] = [
        ("not held", |pass| pass.held = None),
        ("a full pass wanted", |pass| pass.full_pass_wanted = true),
        ("a resync due", |pass| pass.resync_due = true),
        ("a checkpoint due", |pass| pass.checkpoint_due = true),
        ("died", |pass| pass.running_here = false),
        // A lapsed instance lease: the full table re-verifies the hold.
        ("lapsed", |pass| pass.vouched = false),
    ];
    for (why, change) in changes {
        let mut pass = quiet(&case);
        change(&mut pass);
        assert_eq!(decide_light(&pass), LightStep::Full, "{why}");
    }
}

#[test]
fn the_departure_watch_reads_the_lock_and_goes_full_on_what_the_table_stops_or_hands_over_on() {
    let case = Case::held_here();
    assert_eq!(decide_light(&watching(&case, None)), LightStep::ReadBoth);
    // Nothing changed: upkeep, unless the lease lapsed during the read.
    let read = watching(&case, Some(case.lock.as_ref()));
    assert_eq!(decide_light(&read), LightStep::Upkeep);
    let mut lapsed = read.clone();
    lapsed.vouched = false;
    assert_eq!(decide_light(&lapsed), LightStep::Full);
    // Another holder or epoch: the table's StopLost.
    let lost = Case::held_here().held_by("b", 4);
    let seen = watching(&lost, Some(lost.lock.as_ref()));
    assert_eq!(decide_light(&seen), LightStep::Changed);
    assert!(matches!(lost.decide(), Step::StopLost { .. }));
    // No lock at all: lost too.
    let gone = watching(&case, Some(None));
    assert_eq!(decide_light(&gone), LightStep::Changed);
    // Another instance's live intent: the table's HandOver.
    let wanted = Case::held_here().wanted_by("b");
    let seen = watching(&wanted, Some(wanted.lock.as_ref()));
    assert_eq!(decide_light(&seen), LightStep::Changed);
    assert_eq!(wanted.decide(), Step::HandOver);
}

#[test]
fn the_drain_checkpoints_deletes_or_leaves_a_sandbox_to_its_pass() {
    let drain = |c: &Case| drain_to(&c.me, c.metadata.as_ref(), c.lock.as_ref(), c.now);
    assert_eq!(drain(&Case::held_here()), Some(Checkpointed));
    // Wanted elsewhere: the hand-over serves that client.
    assert_eq!(drain(&Case::held_here().wanted_by("b")), None);
    // Its own intent is no reason to leave it running.
    assert_eq!(drain(&Case::held_here().wanted_by("a")), Some(Checkpointed));
    // Not checkpointable (wanted elsewhere or not), or gone: deleted.
    let mut plain = Case::held_here().wanted_by("b");
    plain.metadata.as_mut().unwrap().spec.enable_checkpoint = false;
    assert_eq!(drain(&plain), Some(Deleted));
    let vanished = Case::held_here().with(|case| case.metadata = None);
    assert_eq!(drain(&vanished), Some(Deleted));
    // Being deleted already: its pass finishes that.
    let deleting = Case::held_here().desired(Deleted);
    assert_eq!(drain(&deleting), None);
}

#[test]
fn an_unreachable_bucket_stops_only_a_hold_no_longer_vouched_for() {
    let unreachable = |case: Case| case.with(|case| case.unreachable = Some("503"));
    let unvouched = |case: Case| case.with(|case| case.vouched = false);
    let cut_off = Step::CutOff { why: "503".into() };
    let retry = Step::Retry { why: "503".into() };
    let case = unreachable(unvouched(Case::held_here()));
    case.decides(cut_off, "unvouched: stopped as lost");
    let case = unreachable(Case::held_here());
    case.decides(retry.clone(), "vouched: the pass is retried");
    let case = unreachable(unvouched(Case::new()));
    case.decides(retry, "nothing held here: retried");
}
