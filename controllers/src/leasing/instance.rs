//! This instance's own lease and doorbell, and ringing other instances'
//! doorbells (`docs/decisions/0007-instance-leases-and-doorbells.md`).
//!
//! # Guarantees
//! - A hold in a sandbox's `lock.json` is live for a taker until both the
//!   lock's own `renewed_at + lease_duration_s + skew` and the holder's
//!   instance lease ([`InstanceLease::is_live`]) have passed.
//! - The holder vouches for a hold until both the lock's own lease minus the
//!   skew and its instance lease (unlapsed since the hold was acquired)
//!   have passed. A renewal landing after the previous one's safe window
//!   starts a new *era*; older-era holds are vouched for only after a
//!   conditional write to their `lock.json` (`Leases::renew`), which fails a
//!   taker's concurrent one. A lock written before a lapse (answered after
//!   it, from a freeze) gets no era ([`InstanceLeases::era_for`]).
//!
//! # Caveats
//! A ring is a hint, maybe lost (ringer gave up under contention) or doubled;
//! the holder's periodic resync rereads all it holds, so loss costs only time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use chrono::{DateTime, Duration, Utc};

use super::{LeaseConfig, LeaseError};
use crate::api::{
    Doorbell, ExtraFields, InstanceId, InstanceLease, Ring, RungIntent, SandboxId, decode, encode,
};
use crate::clock::Clock;
use crate::layout::{doorbell_key, instance_lease_key};
use crate::store::{
    Decision, Generation, ObjectKey, PutMode, RmwError, Store, StoreError, Versioned,
    read_modify_write_from,
};

/// What this instance knows of its own lease.
#[derive(Debug, Default)]
struct OwnLease {
    renewed_at: Option<DateTime<Utc>>,
    started_at: Option<DateTime<Utc>>,
    /// Bumped when a renewal lands after the previous one's safe window.
    era: u64,
    /// When the current era's first renewal landed (no gap since then).
    era_began: Option<DateTime<Utc>>,
}

/// No era vouches for the hold; eras start at 1, with the first renewal.
pub const NO_ERA: u64 = 0;

/// Rings waiting to be written to one other instance's doorbell.
#[derive(Debug, Default)]
struct Outbox {
    /// Sandboxes rung since the last write began, with intents (decision 27).
    pending: Vec<(SandboxId, Option<RungIntent>)>,
    /// A ringer is writing (or waiting for the spacing): it takes `pending`.
    writing: bool,
    /// Batches taken for writing so far: a sandbox now added to `pending`
    /// goes into batch `taken + 1`, even while batch `taken` is in flight.
    taken: u64,
    /// Batches written so far: batch `n`'s ringers are done at `n`.
    written: u64,
    /// When the last batch was written (tokio time: spacing only).
    last_write: Option<tokio::time::Instant>,
    /// The outcome of the latest batch, for the ringers that joined it.
    last_error: Option<String>,
    /// The doorbell as last written here: a quiet spell's next batch writes
    /// on it unread (a failed precondition re-reads); a burst's reads first.
    doorbell: Option<Versioned>,
    /// Until when batches read first (a remembered doorbell proved stale).
    read_first_until: Option<tokio::time::Instant>,
}

/// How long batches read first after a stale remembered doorbell: two instances ringing one holder
/// in turn (mass reconnect) would otherwise each pay a refused write per stale copy.
const READ_FIRST_AFTER_STALE: std::time::Duration = std::time::Duration::from_secs(60);

/// This instance's lease and doorbell.
#[derive(Debug, Clone)]
pub struct InstanceLeases {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    instance: InstanceId,
    config: LeaseConfig,
    own: Arc<Mutex<OwnLease>>,
    /// Per other instance: rings not yet written, coalesced.
    outboxes: Arc<Mutex<HashMap<InstanceId, Outbox>>>,
    rings_written: Arc<tokio::sync::Notify>,
    /// Per other instance: its lease as last read live ([`Self::is_live`]).
    seen_live: Arc<Mutex<HashMap<InstanceId, SeenLive>>>,
    /// Held by the renewal [`Self::renew_if_needed`] has in flight.
    renewing: Arc<tokio::sync::Mutex<()>>,
    /// Told after every renewal that landed (holds may be vouched for again).
    renewed: Arc<tokio::sync::Notify>,
}

/// Another instance's lease as read live, and when (this instance's clock).
type SeenLive = (DateTime<Utc>, InstanceLease);

/// How long a lease read live answers "live" without a read: a taker waiting out a quiet hold
/// (lock's own lease out, instance lease live) asks each poll, else paying a second round trip.
/// "Gone" is always read, so this can delay a takeover by at most this long, never allow one.
const LIVE_READ_REUSE: std::time::Duration = std::time::Duration::from_secs(1);

impl InstanceLeases {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        instance: InstanceId,
        config: LeaseConfig,
    ) -> Self {
        Self {
            store,
            clock,
            instance,
            config,
            own: Arc::new(Mutex::new(OwnLease::default())),
            outboxes: Arc::default(),
            rings_written: Arc::default(),
            seen_live: Arc::default(),
            renewing: Arc::default(),
            renewed: Arc::default(),
        }
    }

    pub fn renewed(&self) -> tokio::sync::futures::Notified<'_> {
        self.renewed.notified()
    }

    fn own(&self) -> MutexGuard<'_, OwnLease> {
        locked(&self.own)
    }

    pub fn era(&self) -> u64 {
        self.own().era
    }

    /// The era vouching for a hold whose lock was last written with `renewed_at`: the current one
    /// if it began while the lock's own lease still held, else [`NO_ERA`]. A write answered after a
    /// lapse (a freeze) must not borrow the later era: the gap may have seen a takeover.
    pub fn era_for(&self, renewed_at: DateTime<Utc>) -> u64 {
        let own = self.own();
        let covered = own.era_began.is_some_and(|began| {
            began <= renewed_at + self.config.duration - self.config.skew_tolerance
        });
        if covered { own.era } else { NO_ERA }
    }

    /// True while the instance lease lets this instance act on holds of `era`.
    pub fn vouches_for(&self, era: u64) -> bool {
        let own = self.own();
        own.era == era
            && own.renewed_at.is_some_and(|renewed| {
                self.clock.now() < renewed + self.config.duration - self.config.skew_tolerance
            })
    }

    /// True when the last renewal is older than `every` (or there is none).
    pub fn renewal_due(&self, every: Duration) -> bool {
        self.own()
            .renewed_at
            .is_none_or(|renewed| self.clock.now() >= renewed + every)
    }

    /// Renews while `needed`, one at a time (a caller finding one in flight
    /// waits, then re-checks), so an attach burst writes once (GCS would 429).
    pub async fn renew_if_needed(&self, needed: impl Fn() -> bool) -> Result<(), LeaseError> {
        if !needed() {
            return Ok(());
        }
        let _turn = self.renewing.lock().await;
        if !needed() {
            return Ok(());
        }
        self.renew().await.map(|_| ())
    }

    /// Renews this instance's lease: ONE unconditional write (only it writes it). Returns its era.
    pub async fn renew(&self) -> Result<u64, LeaseError> {
        let now = self.clock.now();
        let (previous, started_at) = {
            let own = self.own();
            (own.renewed_at, own.started_at.unwrap_or(now))
        };
        let mut lease = InstanceLease::new(
            self.instance.clone(),
            started_at,
            self.config.duration_secs(),
        );
        lease.renewed_at = now;
        self.store
            .put(
                &instance_lease_key(&self.instance),
                encode(&lease),
                PutMode::Overwrite,
            )
            .await?;
        let landed = self.clock.now();
        let mut own = self.own();
        let lapsed = previous.is_none_or(|previous| {
            landed >= previous + self.config.duration - self.config.skew_tolerance
        });
        if lapsed {
            own.era += 1;
            own.era_began = Some(landed);
        }
        own.started_at = Some(started_at);
        // Another renewal may have landed meanwhile; keep the newest.
        own.renewed_at = Some(own.renewed_at.map_or(now, |r| r.max(now)));
        let era = own.era;
        drop(own);
        self.renewed.notify_waiters();
        Ok(era)
    }

    /// True while `instance` must count as alive; see [`LIVE_READ_REUSE`].
    pub async fn is_live(&self, instance: &InstanceId) -> Result<bool, LeaseError> {
        let now = self.clock.now();
        let reuse = Duration::from_std(LIVE_READ_REUSE).unwrap_or_else(|_| Duration::zero());
        let remembered = {
            let mut seen = locked(&self.seen_live);
            seen.retain(|_, (read_at, _)| now < *read_at + reuse && *read_at <= now);
            seen.get(instance)
                .is_some_and(|(_, lease)| lease.is_live(now, self.config.skew_tolerance))
        };
        if remembered {
            return Ok(true);
        }
        // No lease: it never held under instance leases, or was cleaned up.
        let live = read_object::<InstanceLease>(self.store.as_ref(), &instance_lease_key(instance))
            .await?
            .map(|(lease, _)| lease)
            .filter(|lease| lease.is_live(now, self.config.skew_tolerance));
        let is_live = live.is_some();
        let mut seen = locked(&self.seen_live);
        match live {
            Some(lease) => seen.insert(instance.clone(), (now, lease)),
            None => seen.remove(instance),
        };
        Ok(is_live)
    }

    /// Reads this instance's doorbell: `None` when nobody ever rang.
    pub async fn read_doorbell(&self) -> Result<Option<(Doorbell, Generation)>, LeaseError> {
        read_object(self.store.as_ref(), &doorbell_key(&self.instance)).await
    }

    /// Rings `holder`'s doorbell for `sandbox`; returns once a write including it landed (or
    /// failed). Rings to one holder coalesce: while a write is in flight or within `ring_spacing`
    /// of the last, they join the next, so a burst never outpaces GCS's object write rate. `intent`
    /// (decision 27), if any, replaces one an earlier ring of `sandbox` put in the batch.
    pub async fn ring(
        &self,
        holder: &InstanceId,
        sandbox: &SandboxId,
        intent: Option<RungIntent>,
    ) -> Result<(), LeaseError> {
        let (batch, writer) = {
            let mut outboxes = locked(&self.outboxes);
            let outbox = outboxes.entry(holder.clone()).or_default();
            match outbox.pending.iter_mut().find(|(rung, _)| rung == sandbox) {
                Some(queued) => {
                    if intent.is_some() {
                        queued.1 = intent;
                    }
                }
                None => outbox.pending.push((sandbox.clone(), intent)),
            }
            let writer = !outbox.writing;
            outbox.writing = true;
            // Not `written + 1`: that would return when an in-flight batch without this ring lands.
            (outbox.taken + 1, writer)
        };
        if writer {
            // Own task: a cancelled ringer must not strand the others.
            let (leases, holder) = (self.clone(), holder.clone());
            tokio::spawn(async move { leases.write_rings(&holder).await });
        }
        loop {
            let notified = self.rings_written.notified();
            {
                let outboxes = locked(&self.outboxes);
                match outboxes.get(holder) {
                    Some(outbox) if outbox.written >= batch => {
                        return match &outbox.last_error {
                            None => Ok(()),
                            Some(err) => Err(LeaseError::Ring {
                                holder: holder.clone(),
                                detail: err.clone(),
                            }),
                        };
                    }
                    Some(_) => {}
                    None => return Ok(()),
                }
            }
            notified.await;
        }
    }

    /// Writer loop: waits out the spacing, writes all pending, repeats if more.
    async fn write_rings(&self, holder: &InstanceId) {
        loop {
            let last_write = locked(&self.outboxes)
                .get(holder)
                .and_then(|outbox| outbox.last_write);
            // A batch that waited for the spacing is a burst: others may ring this holder too, and
            // a write from a copy they staled is refused yet costs scarce rate. Read first.
            let burst = last_write
                .is_some_and(|last| self.clock.instant() < last + self.config.ring_spacing);
            if let Some(last) = last_write {
                tokio::time::sleep_until(last + self.config.ring_spacing).await;
            }
            let (pending, known) = {
                let mut outboxes = locked(&self.outboxes);
                let outbox = outboxes.entry(holder.clone()).or_default();
                let read_first = burst
                    || outbox
                        .read_first_until
                        .is_some_and(|until| self.clock.instant() < until);
                let known = outbox.doorbell.take().filter(|_| !read_first);
                outbox.taken += 1;
                (std::mem::take(&mut outbox.pending), known)
            };
            let started_from_known = known.is_some();
            let outcome = ring_doorbell_many(
                self.store.as_ref(),
                self.clock.now(),
                holder,
                &pending,
                self.instance.as_str(),
                known,
            )
            .await;
            let more = {
                let mut outboxes = locked(&self.outboxes);
                let outbox = outboxes.entry(holder.clone()).or_default();
                outbox.written += 1;
                outbox.last_write = Some(self.clock.instant());
                let (written, error) = match outcome {
                    Ok(rung) => {
                        if started_from_known && rung.attempts > 1 {
                            outbox.read_first_until =
                                Some(self.clock.instant() + READ_FIRST_AFTER_STALE);
                        }
                        (rung.written, None)
                    }
                    Err(err) => (None, Some(err.to_string())),
                };
                outbox.doorbell = written;
                outbox.last_error = error;
                outbox.writing = !outbox.pending.is_empty();
                outbox.writing
            };
            self.rings_written.notify_waiters();
            if !more {
                return;
            }
        }
    }
}

/// `mutex`'s guard, even if a holder panicked (its data stays consistent).
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) async fn read_object<T: crate::api::ApiObject>(
    store: &dyn Store,
    key: &ObjectKey,
) -> Result<Option<(T, Generation)>, LeaseError> {
    match store.get(key).await {
        Ok(current) => decode::<T>(&current.data)
            .map(|object| Some((object, current.generation)))
            .map_err(|source| LeaseError::Invalid {
                key: key.to_string(),
                source,
            }),
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

/// Appends a ring for `sandbox` to `holder`'s doorbell as `by` (a lost race
/// re-reads); an unreadable doorbell (a typo) is replaced: it holds only hints.
pub async fn ring_doorbell(
    store: &dyn Store,
    now: DateTime<Utc>,
    holder: &InstanceId,
    sandbox: &SandboxId,
    by: &str,
) -> Result<(), LeaseError> {
    ring_doorbell_many(store, now, holder, &[(sandbox.clone(), None)], by, None)
        .await
        .map(|_| ())
}

/// A ring as written, and its attempts (>1: a stale start or a lost race).
struct Rung {
    written: Option<Versioned>,
    attempts: u32,
}

/// [`ring_doorbell`] for several sandboxes in one write, from `known` if given.
async fn ring_doorbell_many(
    store: &dyn Store,
    now: DateTime<Utc>,
    holder: &InstanceId,
    sandboxes: &[(SandboxId, Option<RungIntent>)],
    by: &str,
    known: Option<Versioned>,
) -> Result<Rung, LeaseError> {
    let key = doorbell_key(holder);
    let mut attempts = 0;
    let outcome = read_modify_write_from(store, &key, known, |current| {
        attempts += 1;
        let mut bell = current
            .and_then(|object| decode::<Doorbell>(&object.data).ok())
            .unwrap_or_default();
        for (sandbox, intent) in sandboxes {
            bell.ring(Ring {
                sandbox: sandbox.clone(),
                rung_at: now,
                by: by.to_owned(),
                intent: intent.clone(),
                extra: ExtraFields::new(),
            });
        }
        let data = encode(&bell);
        Ok::<_, std::convert::Infallible>(Decision::Write(data.clone(), data))
    })
    .await;
    match outcome {
        Ok((data, generation)) => Ok(Rung {
            written: generation.map(|generation| Versioned { data, generation }),
            attempts,
        }),
        Err(RmwError::Store(err)) => Err(err.into()),
        Err(RmwError::Contended { key, attempts }) => Err(LeaseError::Contended { key, attempts }),
        Err(RmwError::Rejected(never)) => match never {},
    }
}
