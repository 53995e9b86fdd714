//! `instances/<id>/lease.json` and `instances/<id>/doorbell.json`: the two
//! objects each instance has of its own (`docs/principles.md`,
//! `docs/decisions/0007-instance-leases-and-doorbells.md`).
//!
//! - The **instance lease** is Kubernetes' node lease: the instance rewrites it
//!   every few seconds while it holds sandboxes, and a sandbox's `lock.json`
//!   hold is live while its holder's instance lease is. One write per instance,
//!   however many sandboxes it holds.
//! - The **doorbell** is written by everybody else: whoever writes an intent
//!   into a sandbox's `lock.json` or `metadata.json` appends a ring naming the
//!   sandbox, and the holder, which reads its doorbell at a short interval,
//!   reconciles the sandboxes named there. The JSON objects stay the truth; a
//!   ring only says "look now", except that an attach ring may carry its
//!   intent instead of writing it into a held `lock.json` (decision 27): the
//!   holder's transfer, the one fenced write, is then the lock's next write.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

use super::lease::MAX_LEASE_DURATION_S;
use super::{API_VERSION, ApiObject, AttachIntent, ExtraFields, InstanceId, SandboxId};

/// Rings kept in a doorbell; older ones are dropped by the next ringer.
pub const MAX_RINGS: usize = 64;

/// How long a ring stays in the doorbell before the next ringer drops it.
pub fn ring_retention() -> Duration {
    Duration::minutes(2)
}

/// `instances/<id>/lease.json`: "this instance is alive until
/// `renewed_at + lease_duration_s`".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceLease {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    pub instance: InstanceId,
    /// When this incarnation of the instance first wrote its lease.
    pub started_at: DateTime<Utc>,
    pub renewed_at: DateTime<Utc>,
    pub lease_duration_s: u64,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

impl InstanceLease {
    pub fn new(instance: InstanceId, now: DateTime<Utc>, lease_duration_s: u64) -> Self {
        Self {
            api_version: API_VERSION.to_owned(),
            instance,
            started_at: now,
            renewed_at: now,
            lease_duration_s,
            extra: ExtraFields::new(),
        }
    }

    /// When the lease runs out, by the writer's clock.
    pub fn expires_at(&self) -> DateTime<Utc> {
        let duration =
            Duration::seconds(i64::try_from(self.lease_duration_s).unwrap_or(i64::MAX / 1000));
        self.renewed_at
            .checked_add_signed(duration)
            .unwrap_or(self.renewed_at)
    }

    /// True while another instance must treat this one as alive at `now`
    /// (expiry plus the tolerated clock disagreement).
    pub fn is_live(&self, now: DateTime<Utc>, skew_tolerance: Duration) -> bool {
        // Checked: an operator's far-future `renewed_at` means live, not a panic.
        self.expires_at()
            .checked_add_signed(skew_tolerance)
            .is_none_or(|until| now < until)
    }
}

impl ApiObject for InstanceLease {
    const KIND: &'static str = "instance lease.json";

    fn api_version(&self) -> &str {
        &self.api_version
    }

    fn validate(&self) -> Result<(), (String, String)> {
        if self.lease_duration_s == 0 || self.lease_duration_s > MAX_LEASE_DURATION_S {
            return Err((
                "lease_duration_s".to_owned(),
                format!("must be between 1 and {MAX_LEASE_DURATION_S} seconds"),
            ));
        }
        if self.renewed_at < self.started_at {
            return Err(("renewed_at".to_owned(), "is before started_at".to_owned()));
        }
        Ok(())
    }
}

/// One ring: "look at `sandbox` now", written by `by`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ring {
    pub sandbox: SandboxId,
    pub rung_at: DateTime<Utc>,
    /// Who rang (an instance id, `sandboxctl`): for people reading the bucket.
    #[serde(default)]
    pub by: String,
    /// The attach intent this ring carries instead of `lock.json`
    /// (decision 27), if it is an attach ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent: Option<RungIntent>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// An attach intent carried by a ring: `intent.instance` wants the sandbox
/// from the hold at `epoch` (the lock as the ringer read it). It counts only
/// against that hold: once the epoch moves on (a transfer, a takeover) it is
/// spent, whoever got the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RungIntent {
    pub epoch: u64,
    #[serde(flatten)]
    pub intent: AttachIntent,
    /// The generations of both objects as the ringer read them, if it
    /// writes neither: a holder that knows them at least that new decides
    /// its hand-over on what it knows, as fresh as the ringer's read,
    /// rather than read both again (decision 27). Every write
    /// that decision leads to stays conditional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read: Option<ReadGenerations>,
}

/// `lock.json`'s and `metadata.json`'s generations, as read together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadGenerations {
    pub lock: i64,
    pub metadata: i64,
}

/// `instances/<id>/doorbell.json`: recent rings, newest last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Doorbell {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    #[serde(default)]
    pub rings: Vec<Ring>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

impl Default for Doorbell {
    fn default() -> Self {
        Self {
            api_version: API_VERSION.to_owned(),
            rings: Vec::new(),
            extra: ExtraFields::new(),
        }
    }
}

impl Doorbell {
    /// Appends a ring, dropping rings older than [`ring_retention`] and the
    /// oldest beyond [`MAX_RINGS`].
    pub fn ring(&mut self, ring: Ring) {
        let cutoff = ring
            .rung_at
            .checked_sub_signed(ring_retention())
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        self.rings.retain(|old| old.rung_at >= cutoff);
        self.rings.push(ring);
        let excess = self.rings.len().saturating_sub(MAX_RINGS);
        self.rings.drain(..excess);
    }
}

impl ApiObject for Doorbell {
    const KIND: &'static str = "doorbell.json";

    fn api_version(&self) -> &str {
        &self.api_version
    }

    fn validate(&self) -> Result<(), (String, String)> {
        if self.rings.len() > MAX_RINGS * 4 {
            return Err((
                "rings".to_owned(),
                format!(
                    "holds {} rings; at most {} are kept",
                    self.rings.len(),
                    MAX_RINGS
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{decode, encode};

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(1_700_000_000 + seconds)
    }

    #[test]
    fn an_instance_lease_is_live_until_expiry_plus_skew() {
        let lease = InstanceLease::new(InstanceId::parse("a").unwrap(), at(0), 15);
        let skew = Duration::seconds(2);
        assert!(lease.is_live(at(16), skew));
        assert!(!lease.is_live(at(17), skew));
        let decoded: InstanceLease = decode(&encode(&lease)).unwrap();
        assert_eq!(decoded, lease);
    }

    #[test]
    fn a_doorbell_keeps_recent_rings_only() {
        let mut bell = Doorbell::default();
        let ring = |n: u128, t: i64| Ring {
            intent: None,
            sandbox: SandboxId::from_u128(n),
            rung_at: at(t),
            by: "b".into(),
            extra: ExtraFields::new(),
        };
        bell.ring(ring(1, 0));
        bell.ring(ring(2, 200));
        assert_eq!(
            bell.rings.len(),
            1,
            "the ring older than two minutes is dropped"
        );
        for n in 0..100 {
            bell.ring(ring(n, 300));
        }
        assert_eq!(bell.rings.len(), MAX_RINGS);
        assert_eq!(bell.rings.last().unwrap().sandbox, SandboxId::from_u128(99));
    }

    #[test]
    fn invalid_instance_leases_name_the_field() {
        let mut lease = InstanceLease::new(InstanceId::parse("a").unwrap(), at(0), 15);
        lease.lease_duration_s = 0;
        let err = decode::<InstanceLease>(&encode(&lease)).unwrap_err();
        assert_eq!(err.field(), Some("lease_duration_s"));
    }
}
