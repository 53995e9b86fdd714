//! Lease operations over the Store: acquire, renew, release, detect loss, write the attach intent;
//! each a read-modify-write of `lock.json` under its generation, so two instances never both
//! believe their write won. [`Clock`]s may disagree: a lease expires for a taker `skew_tolerance`
//! after its holder's expiry, and for the holder that much *before* it.
//!
//! # Guarantees
//! - Acquisition increments `epoch`: a unique, increasing fencing token.
//! - Release writes `holder: null`, keeping epoch and intent; the lock is
//!   never deleted (the emulator ignores conditional deletes).
//! - A live `wanted_by` naming another instance blocks acquisition: the
//!   instance a client asked for gets the sandbox, not the first poller.
//! - A hold lives on its holder's [`InstanceLeases`] (idle holds cost no
//!   writes) and, for one lease duration, on the lock's own `renewed_at`
//!   (set at acquisition and re-verification); a taker needs both expired.
//!
//! # Errors
//! An unreadable `lock.json` (an operator's typo) is [`LeaseError::Invalid`] and never overwritten.

use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};

use crate::api::{
    AttachIntent, CheckpointManifest, CheckpointRef, DecodeError, ExtraFields, InstanceId, Lease,
    ReadGenerations, RungIntent, SandboxId, decode, encode,
};
use crate::clock::Clock;
use crate::layout::lock_key;
use crate::store::{
    Decision, Generation, PutMode, RmwError, Store, StoreError, Versioned, read_modify_write_from,
};

mod instance;

pub use instance::{InstanceLeases, NO_ERA, ring_doorbell};

/// Lease timing for one deployment.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// How long a lease lasts without renewal.
    pub duration: Duration,
    /// The largest clock disagreement between instances that is tolerated.
    pub skew_tolerance: Duration,
    /// How long an attach intent stays live.
    pub intent_ttl: Duration,
    /// Least time between this instance's writes to one doorbell (GCS allows
    /// ~1/s per object): rings meanwhile join the next; after a lull, at once.
    pub ring_spacing: std::time::Duration,
}

impl LeaseConfig {
    pub fn duration_secs(&self) -> u64 {
        u64::try_from(self.duration.num_seconds())
            .unwrap_or(1)
            .max(1)
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            duration: Duration::seconds(15),
            skew_tolerance: Duration::seconds(2),
            intent_ttl: Duration::seconds(60),
            ring_spacing: std::time::Duration::from_secs(1),
        }
    }
}

/// Proof that this instance held a sandbox's lease at `epoch`, as of `renewed_at`.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldLease {
    pub sandbox: SandboxId,
    pub epoch: u64,
    pub renewed_at: DateTime<Utc>,
    pub generation: Generation,
    /// The lease as this instance last wrote or read it at `generation`.
    pub lease: Lease,
    /// Era vouching for the hold: current at the lock's last write or read,
    /// if begun before the lock's own lease ran out; else [`NO_ERA`].
    pub era: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("sandbox {sandbox} is held by {holder} until {expires_at}")]
    HeldByOther {
        sandbox: SandboxId,
        holder: InstanceId,
        expires_at: DateTime<Utc>,
    },
    #[error("sandbox {sandbox} is wanted by instance {instance} until {expires_at}")]
    WantedByOther {
        sandbox: SandboxId,
        instance: InstanceId,
        expires_at: DateTime<Utc>,
    },
    #[error(
        "lease of sandbox {sandbox} at epoch {epoch} was lost (now holder {holder:?}, epoch {current_epoch})"
    )]
    Lost {
        sandbox: SandboxId,
        epoch: u64,
        holder: Option<InstanceId>,
        current_epoch: u64,
    },
    #[error("sandbox {sandbox} has no lock.json")]
    Missing { sandbox: SandboxId },
    /// A `lock.json`, instance lease or doorbell that does not decode.
    #[error("{key} is invalid: {source}")]
    Invalid { key: String, source: DecodeError },
    #[error("{key} kept changing under {attempts} attempts to write it")]
    Contended { key: String, attempts: usize },
    #[error("cannot ring {holder}'s doorbell: {detail}")]
    Ring { holder: InstanceId, detail: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A `lock.json` just read and its generation, for a write's precondition.
pub type ReadLease = (Lease, Generation);

/// `status`'s latest checkpoint as an acquiring caller read it (the acquisition reads the lock).
#[derive(Debug, Clone, Copy)]
pub enum Recorded<'a> {
    /// Not read (a tombstone's, which restores nothing): the hold names no checkpoint it took over.
    Unread,
    /// `status.latest_checkpoint` as read.
    Latest(Option<&'a CheckpointRef>),
}

/// What became of a hold given back after its checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandBack {
    /// Nobody wanted it elsewhere: `holder: null`.
    Released,
    /// Another instance's live intent: the hold is now theirs at `epoch`.
    TransferredTo { instance: InstanceId, epoch: u64 },
}

enum Step<T> {
    Write(Box<Lease>, T),
    Done(T),
}

/// Whether a lock lets this instance take its hold ([`grant`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Grant {
    /// The lock names this instance already: renewed, same epoch.
    Renew,
    /// Unheld, or the gone hold unchanged, its lock's lease out: next epoch.
    Take,
    /// Another holder: live, or not the hold that was found gone.
    HeldByOther,
    /// Free, but another instance's live attach intent reserves it.
    WantedByOther(AttachIntent),
}

/// The acquire write's guard on the lock each attempt finds: does it still allow what `decide`
/// (`sandboxes::decision`) chose on the pass's read? `gone`: holder and epoch found gone.
pub(crate) fn grant(
    lock: &Lease,
    me: &InstanceId,
    gone: Option<&(InstanceId, u64)>,
    now: DateTime<Utc>,
    skew_tolerance: Duration,
) -> Grant {
    if lock.is_held_by(me) {
        return Grant::Renew;
    }
    let taken_over = gone.is_some_and(|(holder, epoch)| {
        lock.holder.as_ref() == Some(holder) && lock.epoch == *epoch
    });
    if lock.holder.is_some() && !(taken_over && lock.is_free(now, skew_tolerance)) {
        return Grant::HeldByOther;
    }
    match lock.wanted_elsewhere(me, now) {
        Some(intent) => Grant::WantedByOther(intent.clone()),
        None => Grant::Take,
    }
}

#[derive(Debug, Clone)]
pub struct Leases {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    instance: InstanceId,
    config: LeaseConfig,
    instance_lease: InstanceLeases,
    /// Rung intents (decision 27): on a holder, those its doorbell brought; on a ringer, its own.
    /// Lock reads here count them ([`Lease::hear`]) so both see the lock's next `wanted_by`.
    heard: Option<Arc<dyn RungIntents>>,
}

/// Where rung intents are kept (decision 27), at most one per sandbox: the reconciler's slots.
pub trait RungIntents: Send + Sync + std::fmt::Debug {
    fn rung(&self, sandbox: &SandboxId) -> Option<RungIntent>;
    fn change_rung(
        &self,
        sandbox: &SandboxId,
        change: &mut dyn FnMut(Option<RungIntent>) -> Option<RungIntent>,
    );
    fn forget_expired(&self, now: DateTime<Utc>);
}

impl Leases {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        instance: InstanceId,
        config: LeaseConfig,
    ) -> Self {
        let instance_lease = InstanceLeases::new(
            store.clone(),
            clock.clone(),
            instance.clone(),
            config.clone(),
        );
        Self {
            store,
            clock,
            instance,
            config,
            instance_lease,
            heard: None,
        }
    }

    /// Keeps rung intents in `intents` (the reconciler's slots) from now on.
    /// Call before any is heard, on the copy every user shares.
    pub fn keep_rung_in(&mut self, intents: Arc<dyn RungIntents>) {
        self.heard = Some(intents);
    }

    /// Remembers an intent a ring carried for `sandbox`: the newest per
    /// sandbox (of two as new, the later heard); expired ones are dropped.
    pub fn hear(&self, sandbox: &SandboxId, rung: RungIntent) {
        let Some(heard) = &self.heard else { return };
        heard.forget_expired(self.clock.now());
        heard.change_rung(sandbox, &mut |old| match old {
            Some(old) if old.intent.requested_at > rung.intent.requested_at => Some(old),
            _ => Some(rung.clone()),
        });
    }

    fn forget_own_intent(&self, sandbox: &SandboxId) {
        let Some(heard) = &self.heard else { return };
        heard.change_rung(sandbox, &mut |rung| {
            rung.filter(|rung| rung.intent.instance != self.instance)
        });
    }

    /// True if this instance's own intent for `sandbox` went by ring for a
    /// hold older than `lease`'s: another instance got the sandbox since.
    pub fn own_intent_spent(&self, sandbox: &SandboxId, lease: &Lease) -> bool {
        self.rung(sandbox).is_some_and(|rung| {
            rung.intent.instance == self.instance
                && rung.epoch < lease.epoch
                && lease.holder.as_ref() != Some(&self.instance)
        })
    }

    /// `lease` with the intent a ring carried for it, if any ([`Lease::hear`]).
    pub fn with_heard(&self, sandbox: &SandboxId, mut lease: Lease) -> Lease {
        if let Some(rung) = self.rung(sandbox) {
            lease.hear(&rung, self.clock.now());
        }
        lease
    }

    fn decode_heard(&self, sandbox: &SandboxId, data: &[u8]) -> Result<Lease, LeaseError> {
        let lease = decode::<Lease>(data).map_err(|source| LeaseError::Invalid {
            key: lock_key(sandbox).to_string(),
            source,
        })?;
        Ok(self.with_heard(sandbox, lease))
    }

    fn rung(&self, sandbox: &SandboxId) -> Option<RungIntent> {
        self.heard.as_ref().and_then(|heard| heard.rung(sandbox))
    }

    pub fn instance(&self) -> &InstanceId {
        &self.instance
    }

    pub fn instance_lease(&self) -> &InstanceLeases {
        &self.instance_lease
    }

    /// Makes the instance lease vouch for holds acquired now (one shared
    /// renewal, skipped if this era's last is under a third of a lease old).
    pub async fn ensure_instance_lease(&self) -> Result<(), LeaseError> {
        let lease = &self.instance_lease;
        lease
            .renew_if_needed(|| {
                !lease.vouches_for(lease.era()) || lease.renewal_due(self.config.duration / 3)
            })
            .await
    }

    /// True if `lease`'s hold may be taken over now: no holder, or the lock's
    /// own lease and then the holder's instance lease (read only then) expired.
    pub(crate) async fn holder_gone(&self, lease: &Lease) -> Result<bool, LeaseError> {
        let now = self.clock.now();
        match &lease.holder {
            None => Ok(true),
            Some(holder) if holder == &self.instance => Ok(false),
            Some(holder) => {
                if !lease.is_free(now, self.config.skew_tolerance) {
                    return Ok(false);
                }
                Ok(!self.instance_lease.is_live(holder).await?)
            }
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Reads the lock, if any, as this instance sees it ([`Self::with_heard`]).
    pub async fn read(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<(Lease, Generation)>, LeaseError> {
        let read = instance::read_object(self.store.as_ref(), &lock_key(sandbox)).await?;
        Ok(read.map(|(lease, generation)| (self.with_heard(sandbox, lease), generation)))
    }

    /// Takes the lease at `epoch + 1`, creating it or taking it over if free or expired (held here:
    /// renewed, same epoch). Clears `wanted_by` naming this instance (fulfilled) or expired.
    pub(crate) async fn acquire(&self, sandbox: &SandboxId) -> Result<HeldLease, LeaseError> {
        let read = self.read(sandbox).await?;
        self.acquire_from(sandbox, read, Recorded::Unread).await
    }

    /// [`Self::acquire`] from the lock as just read (`None`: absent), making the instance lease
    /// vouch meanwhile (the lock's own covers until then). A take-over names the newer of
    /// `recorded` and the lock's checkpoint as the one it took over
    /// (`Lease::checkpoint_taken_over_at`): a former holder's late record never counts after.
    pub(crate) async fn acquire_from(
        &self,
        sandbox: &SandboxId,
        read: Option<ReadLease>,
        recorded: Recorded<'_>,
    ) -> Result<HeldLease, LeaseError> {
        // Take over only a hold whose lock and instance lease both expired as
        // read; the write re-decides if it changed since (its precondition).
        let gone = match &read {
            Some((lease, _)) if self.holder_gone(lease).await? => {
                lease.holder.clone().map(|holder| (holder, lease.epoch))
            }
            _ => None,
        };
        let (ensured, acquired) = tokio::join!(
            self.ensure_instance_lease(),
            self.acquire_write(sandbox, read, gone, recorded)
        );
        ensured?;
        let (epoch, lease, generation) = acquired?;
        self.held(sandbox, epoch, &lease, generation)
    }

    async fn acquire_write(
        &self,
        sandbox: &SandboxId,
        read: Option<ReadLease>,
        gone: Option<(InstanceId, u64)>,
        recorded: Recorded<'_>,
    ) -> Result<(u64, Lease, Generation), LeaseError> {
        let skew = self.config.skew_tolerance;
        self.modify_from(sandbox, read, |existing, now| {
            let mut lease = existing.unwrap_or_else(|| self.fresh_lease());
            match grant(&lease, &self.instance, gone.as_ref(), now, skew) {
                Grant::Renew => {
                    // Already ours: renew rather than trust a possibly expired lease.
                    lease.renewed_at = Some(now);
                }
                Grant::HeldByOther => {
                    return Err(LeaseError::HeldByOther {
                        sandbox: sandbox.clone(),
                        holder: lease
                            .holder
                            .clone()
                            .unwrap_or_else(|| self.instance.clone()),
                        expires_at: lease.expires_at().unwrap_or(now),
                    });
                }
                Grant::WantedByOther(intent) => {
                    return Err(LeaseError::WantedByOther {
                        sandbox: sandbox.clone(),
                        instance: intent.instance,
                        expires_at: intent.expires_at,
                    });
                }
                Grant::Take => {
                    if lease.wanted_by.as_ref().is_some_and(|intent| {
                        intent.instance == self.instance || intent.expires_at <= now
                    }) {
                        lease.wanted_by = None;
                    }
                    // As the lock's readers see it: the last hold's late record does not count.
                    let newer = match recorded {
                        Recorded::Latest(latest) => latest.filter(|latest| {
                            !lease.outdates(latest)
                                && latest.is_newer_than(lease.checkpoint.as_ref())
                        }),
                        Recorded::Unread => None,
                    };
                    self.take_hold(&mut lease, self.instance.clone(), now);
                    if let Some(newer) = newer {
                        lease.checkpoint = Some(newer.clone());
                        lease.checkpoint_manifest = None;
                    }
                    // Unread, what it took over is unknown: the old epoch's field stops counting.
                    if let Recorded::Latest(_) = recorded {
                        lease.checkpoint_taken_over_at = Some(lease.epoch);
                    }
                }
            }
            let epoch = lease.epoch;
            Ok(Step::Write(Box::new(lease), epoch))
        })
        .await
    }

    /// Creates a new sandbox's lock held here at epoch 1 (a create is its own acquisition) while
    /// making the instance lease vouch; `None` if a lock exists (the caller then writes an intent).
    pub(crate) async fn create_held(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<HeldLease>, LeaseError> {
        let now = self.clock.now();
        let mut lease = self.fresh_lease();
        self.take_hold(&mut lease, self.instance.clone(), now);
        let key = lock_key(sandbox);
        let (ensured, written) = tokio::join!(
            self.ensure_instance_lease(),
            self.store.put(&key, encode(&lease), PutMode::Create)
        );
        let generation = match written {
            Ok(generation) => generation,
            Err(StoreError::PreconditionFailed { .. }) => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        ensured?;
        self.held(sandbox, 1, &lease, generation).map(Some)
    }

    /// Takes up a hold naming this instance (a transfer, create or attach).
    pub(crate) async fn adopt(
        &self,
        sandbox: &SandboxId,
        lease: &Lease,
        generation: Generation,
    ) -> Result<HeldLease, LeaseError> {
        if !lease.is_held_by(&self.instance) {
            return Err(LeaseError::Lost {
                sandbox: sandbox.clone(),
                epoch: lease.epoch,
                holder: lease.holder.clone(),
                current_epoch: lease.epoch,
            });
        }
        self.ensure_instance_lease().await?;
        self.held(sandbox, lease.epoch, lease, generation)
    }

    /// Gives a hold back after its checkpoint, recorded in the lock, to the instance whose live
    /// intent names it (a transfer at `epoch + 1` in one write) or to nobody; from `read` if given.
    pub(crate) async fn hand_back(
        &self,
        held: &HeldLease,
        read: Option<ReadLease>,
        checkpoint: &CheckpointRef,
        manifest: &CheckpointManifest,
    ) -> Result<HandBack, LeaseError> {
        self.modify_from(&held.sandbox, read, |existing, now| {
            let mut lease = self.still_mine(held, existing)?;
            lease.checkpoint = Some(checkpoint.clone());
            lease.checkpoint_manifest = Some(Box::new(manifest.clone()));
            let outcome = match lease.wanted_elsewhere(&self.instance, now).cloned() {
                Some(intent) => {
                    self.take_hold(&mut lease, intent.instance.clone(), now);
                    lease.checkpoint_taken_over_at = Some(lease.epoch);
                    lease.wanted_by = None;
                    HandBack::TransferredTo {
                        instance: intent.instance,
                        epoch: lease.epoch,
                    }
                }
                None => {
                    lease.holder = None;
                    HandBack::Released
                }
            };
            Ok(Step::Write(Box::new(lease), outcome))
        })
        .await
        .map(|(outcome, _, _)| outcome)
    }

    /// Extends a hold: `Lost` if taken over or cleared by an operator.
    pub(crate) async fn renew(&self, held: &HeldLease) -> Result<HeldLease, LeaseError> {
        self.renew_or_found(held)
            .await?
            .map_err(|found| match found {
                Some(lease) => Self::lost(held, lease),
                None => LeaseError::Missing {
                    sandbox: held.sandbox.clone(),
                },
            })
    }

    /// [`Self::renew`], but a lock not naming the hold comes back as found.
    pub(crate) async fn renew_or_found(
        &self,
        held: &HeldLease,
    ) -> Result<Result<HeldLease, Option<Lease>>, LeaseError> {
        let (found, lease, generation) = self
            .modify_from(&held.sandbox, None, |existing, now| match existing {
                Some(mut lease)
                    if lease.is_held_by(&self.instance) && lease.epoch == held.epoch =>
                {
                    lease.renewed_at = Some(now);
                    Ok(Step::Write(Box::new(lease), None))
                }
                existing => Ok(Step::Done(Some(existing))),
            })
            .await?;
        Ok(match found {
            None => Ok(self.held(&held.sandbox, held.epoch, &lease, generation)?),
            Some(found) => Err(found),
        })
    }

    /// Sets `holder: null`, keeping epoch and intent; `Lost` if already lost.
    pub(crate) async fn release(&self, held: &HeldLease) -> Result<(), LeaseError> {
        self.modify_from(&held.sandbox, None, |existing, _now| {
            let mut lease = self.still_mine(held, existing)?;
            lease.holder = None;
            Ok(Step::Write(Box::new(lease), ()))
        })
        .await
        .map(|_| ())
    }

    /// Gives up a hold at `epoch` naming this instance, which does not run it (the reconciler's
    /// orphan row, or a start that failed), and withdraws this instance's intent (nobody here waits
    /// for it any more) in one write: GCS allows ~1 write/s per object. A lock that moved on loses
    /// only that intent, if it still has it; no write if neither is there.
    pub(crate) async fn release_and_withdraw(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
    ) -> Result<(), LeaseError> {
        self.forget_own_intent(sandbox);
        self.modify_from(sandbox, None, |existing, _now| {
            let Some(mut lease) = existing else {
                return Ok(Step::Done(()));
            };
            let released = lease.is_held_by(&self.instance) && lease.epoch == epoch;
            if released {
                lease.holder = None;
            }
            Ok(if self.clear_own_intent(&mut lease) || released {
                Step::Write(Box::new(lease), ())
            } else {
                Step::Done(())
            })
        })
        .await
        .map(|_| ())
    }

    /// True while this instance may act on `held`: its lock was renewed less
    /// than a lease minus skew ago, or the instance lease vouches for its era.
    pub fn is_safe(&self, held: &HeldLease) -> bool {
        self.clock.now() < held.renewed_at + self.config.duration - self.config.skew_tolerance
            || self.instance_lease.vouches_for(held.era)
    }

    /// Writes `wanted_by` = this instance for the intent TTL (creating an
    /// unheld lock if none) and rings the holder to hand over at once.
    pub(crate) async fn request_attach(
        &self,
        sandbox: &SandboxId,
    ) -> Result<AttachIntent, LeaseError> {
        Ok(self.request_attach_writing(sandbox, None, None).await?.0)
    }

    /// [`Self::request_attach`] from the lock as just read; returns the lock
    /// as written (`None`: the intent went by ring alone, lock as read).
    ///
    /// If `read` names another holder, the intent only rings it (decision 27): its transfer is the
    /// lock's next write, saving one at GCS's ~1/s per object. Own reads count it from now
    /// ([`Self::hear`]); a failed ring or unheld lock writes it instead. `metadata`: the
    /// `metadata.json` generation read with `read` if the caller won't write it, for the ring to
    /// tell the holder.
    pub(crate) async fn request_attach_writing(
        &self,
        sandbox: &SandboxId,
        read: Option<ReadLease>,
        metadata: Option<Generation>,
    ) -> Result<(AttachIntent, Option<ReadLease>), LeaseError> {
        if let Some((lease, generation)) = &read
            && let Some(holder) = lease.holder.as_ref().filter(|h| *h != &self.instance)
        {
            let read = metadata.map(|metadata| ReadGenerations {
                lock: generation.0,
                metadata: metadata.0,
            });
            match self.ring_intent(sandbox, holder, lease.epoch, read).await {
                Ok(intent) => return Ok((intent, None)),
                Err(err) => {
                    tracing::warn!(%sandbox, %holder, %err, "cannot ring the holder's doorbell; writing the intent into the lock");
                }
            }
        }
        let write = self.modify_from(sandbox, read, |existing, now| {
            let mut lease = existing.unwrap_or_else(|| self.fresh_lease());
            let intent = self.own_intent(now);
            lease.wanted_by = Some(intent.clone());
            Ok(Step::Write(Box::new(lease), intent))
        });
        let (intent, lease, generation) = write.await?;
        self.ring_holder(sandbox, &lease).await;
        Ok((intent, Some((lease, generation))))
    }

    /// Rings `holder` with this instance's intent; counts it here at once.
    async fn ring_intent(
        &self,
        sandbox: &SandboxId,
        holder: &InstanceId,
        epoch: u64,
        read: Option<ReadGenerations>,
    ) -> Result<AttachIntent, LeaseError> {
        let intent = self.own_intent(self.clock.now());
        let rung = RungIntent {
            epoch,
            intent: intent.clone(),
            read,
        };
        self.hear(sandbox, rung.clone());
        if let Err(err) = self.instance_lease.ring(holder, sandbox, Some(rung)).await {
            self.forget_own_intent(sandbox);
            return Err(err);
        }
        Ok(intent)
    }

    /// Rings `lease`'s holder if another instance (the one place an intent's
    /// writer rings), with this instance's live intent if any (a re-ring). A
    /// failure is logged: the holder's resync or a later re-ring catches up.
    pub async fn ring_holder(&self, sandbox: &SandboxId, lease: &Lease) {
        let Some(holder) = lease.holder.as_ref().filter(|h| *h != &self.instance) else {
            return;
        };
        let intent = lease
            .live_intent(self.clock.now())
            .filter(|intent| intent.instance == self.instance)
            .map(|intent| RungIntent {
                epoch: lease.epoch,
                intent: intent.clone(),
                read: None,
            });
        if let Err(err) = self.instance_lease.ring(holder, sandbox, intent).await {
            tracing::warn!(%sandbox, %holder, %err, "cannot ring the holder's doorbell");
        }
    }

    /// Withdraws this instance's attach intent, if it is still the current one.
    pub(crate) async fn withdraw_attach(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        self.forget_own_intent(sandbox);
        self.modify_from(sandbox, None, |mut existing, _now| {
            Ok(
                match existing.take_if(|lease| self.clear_own_intent(lease)) {
                    Some(lease) => Step::Write(Box::new(lease), ()),
                    None => Step::Done(()),
                },
            )
        })
        .await
        .map(|_| ())
    }

    /// Clears `lease`'s intent if it is this instance's; true if it was.
    fn clear_own_intent(&self, lease: &mut Lease) -> bool {
        let own = lease
            .wanted_by
            .as_ref()
            .is_some_and(|intent| intent.instance == self.instance);
        if own {
            lease.wanted_by = None;
        }
        own
    }

    fn own_intent(&self, now: DateTime<Utc>) -> AttachIntent {
        AttachIntent {
            instance: self.instance.clone(),
            requested_at: now,
            expires_at: now + self.config.intent_ttl,
            extra: ExtraFields::new(),
        }
    }

    fn take_hold(&self, lease: &mut Lease, instance: InstanceId, now: DateTime<Utc>) {
        lease.holder = Some(instance);
        lease.epoch += 1;
        lease.acquired_at = Some(now);
        lease.renewed_at = Some(now);
        lease.lease_duration_s = self.config.duration_secs();
    }

    fn fresh_lease(&self) -> Lease {
        Lease::unheld(self.config.duration_secs())
    }

    fn still_mine(&self, held: &HeldLease, existing: Option<Lease>) -> Result<Lease, LeaseError> {
        let Some(lease) = existing else {
            return Err(LeaseError::Missing {
                sandbox: held.sandbox.clone(),
            });
        };
        if lease.is_held_by(&self.instance) && lease.epoch == held.epoch {
            Ok(lease)
        } else {
            Err(Self::lost(held, lease))
        }
    }

    fn lost(held: &HeldLease, lease: Lease) -> LeaseError {
        LeaseError::Lost {
            sandbox: held.sandbox.clone(),
            epoch: held.epoch,
            holder: lease.holder,
            current_epoch: lease.epoch,
        }
    }

    fn held(
        &self,
        sandbox: &SandboxId,
        epoch: u64,
        lease: &Lease,
        generation: Generation,
    ) -> Result<HeldLease, LeaseError> {
        let renewed_at = lease
            .renewed_at
            .or(lease.acquired_at)
            .unwrap_or(chrono::DateTime::<Utc>::UNIX_EPOCH);
        Ok(HeldLease {
            sandbox: sandbox.clone(),
            epoch,
            renewed_at,
            generation,
            lease: lease.clone(),
            era: self.instance_lease.era_for(renewed_at),
        })
    }

    /// Read-modify-write of `lock.json` from `read` if given: `decide` gets
    /// the lease (or `None`) and time, returns the write; lost races re-read.
    async fn modify_from<T>(
        &self,
        sandbox: &SandboxId,
        read: Option<ReadLease>,
        mut decide: impl FnMut(Option<Lease>, DateTime<Utc>) -> Result<Step<T>, LeaseError>,
    ) -> Result<(T, Lease, Generation), LeaseError> {
        let key = lock_key(sandbox);
        let now = || self.clock.now();
        let known = read.map(|(lease, generation)| Versioned {
            data: encode(&lease),
            generation,
        });
        let outcome = read_modify_write_from(self.store.as_ref(), &key, known, |current| {
            let existing = current
                .map(|object| self.decode_heard(sandbox, &object.data))
                .transpose()?;
            let unchanged = existing.clone();
            Ok(match decide(existing, now())? {
                Step::Done(value) => {
                    Decision::Keep((value, unchanged.unwrap_or_else(|| self.fresh_lease())))
                }
                Step::Write(lease, value) => Decision::Write(encode(&*lease), (value, *lease)),
            })
        })
        .await;
        match outcome {
            Ok(((value, lease), generation)) => {
                Ok((value, lease, generation.unwrap_or(Generation(0))))
            }
            Err(RmwError::Rejected(err)) => Err(err),
            Err(RmwError::Store(err)) => Err(err.into()),
            Err(RmwError::Contended { key, attempts }) => {
                Err(LeaseError::Contended { key, attempts })
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
