//! `sandboxes/<id>/lock.json`: the lease that says which instance runs a
//! sandbox, the fencing epoch, and the attach intent.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

use super::{
    API_VERSION, ApiObject, CheckpointManifest, CheckpointRef, ExtraFields, InstanceId, RungIntent,
};

/// The lease document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    /// The instance that runs the sandbox, or `null` when nobody does.
    #[serde(default)]
    pub holder: Option<InstanceId>,
    /// Increments on every acquisition; the fencing token.
    #[serde(default)]
    pub epoch: u64,
    #[serde(default)]
    pub acquired_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub renewed_at: Option<DateTime<Utc>>,
    pub lease_duration_s: u64,
    /// The attach intent: which instance wants to run the sandbox next.
    #[serde(default)]
    pub wanted_by: Option<AttachIntent>,
    /// The checkpoint the last holder left the sandbox at, written in the
    /// same write that released or transferred the hold (decision 18): the
    /// next holder restores the newer of this and `metadata.json`'s
    /// `status.latest_checkpoint` without waiting for, or re-reading, the
    /// record in `metadata.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointRef>,
    /// That checkpoint's manifest, so the next holder restores without
    /// reading `manifest.json` first. Ignored unless it describes
    /// `checkpoint`'s image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_manifest: Option<Box<CheckpointManifest>>,
    /// The epoch of the hold that took `checkpoint` over as the sandbox's
    /// latest: its acquisition (or the transfer to it) wrote both, from what
    /// it read. While it is `epoch`, a `status.latest_checkpoint` of an
    /// earlier epoch that is not `checkpoint` landed after the hold began (a
    /// former holder frozen past its lease recorded it late) and does not
    /// count ([`Self::outdates`]). Absent, or of an earlier epoch (a lock an
    /// earlier release wrote, which keeps the field unread): the newer of the
    /// two counts, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_taken_over_at: Option<u64>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// "Instance X wants this sandbox", written by the API layer when a client
/// attaches on an instance that does not hold the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachIntent {
    pub instance: InstanceId,
    pub requested_at: DateTime<Utc>,
    /// After this instant the intent is stale and ignored.
    pub expires_at: DateTime<Utc>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// Highest fencing epoch a lock may carry: 2^53 - 1, the largest integer
/// every JSON reader keeps exact; an operator's `u64::MAX` would overflow
/// the next acquisition's `epoch + 1`.
pub const MAX_EPOCH: u64 = (1 << 53) - 1;

/// Longest lease an operator may configure.
pub const MAX_LEASE_DURATION_S: u64 = 3600;

impl Lease {
    /// A lease nobody holds yet.
    pub fn unheld(lease_duration_s: u64) -> Self {
        Self {
            api_version: API_VERSION.to_owned(),
            holder: None,
            epoch: 0,
            acquired_at: None,
            renewed_at: None,
            lease_duration_s,
            wanted_by: None,
            checkpoint: None,
            checkpoint_manifest: None,
            checkpoint_taken_over_at: None,
            extra: ExtraFields::new(),
        }
    }

    pub fn duration(&self) -> Duration {
        Duration::seconds(i64::try_from(self.lease_duration_s).unwrap_or(i64::MAX / 1000))
    }

    /// When the holder's lease runs out (`renewed_at + lease_duration_s`), by the
    /// writer's clock. `None` when nobody holds it.
    pub fn expires_at(&self) -> Option<DateTime<Utc>> {
        self.holder.as_ref()?;
        let renewed = self.renewed_at.or(self.acquired_at)?;
        renewed.checked_add_signed(self.duration())
    }

    /// True if another instance may take the lease at `now`: nobody holds it, or
    /// the holder has not renewed for the lease duration plus `skew_tolerance`
    /// (the clock disagreement between instances this deployment tolerates).
    pub fn is_free(&self, now: DateTime<Utc>, skew_tolerance: Duration) -> bool {
        match self.expires_at() {
            None => true,
            // Checked: a far-future `renewed_at` holds, it does not panic.
            Some(expires) => expires
                .checked_add_signed(skew_tolerance)
                .is_some_and(|free_at| free_at <= now),
        }
    }

    pub fn is_held_by(&self, instance: &InstanceId) -> bool {
        self.holder.as_ref() == Some(instance)
    }

    /// The live attach intent at `now`, if any.
    pub fn live_intent(&self, now: DateTime<Utc>) -> Option<&AttachIntent> {
        self.wanted_by
            .as_ref()
            .filter(|intent| intent.expires_at > now)
    }

    /// The live attach intent of an instance other than `me`: the one
    /// predicate for "wanted elsewhere".
    pub fn wanted_elsewhere(&self, me: &InstanceId, now: DateTime<Utc>) -> Option<&AttachIntent> {
        self.live_intent(now)
            .filter(|intent| &intent.instance != me)
    }

    /// True if `me`'s attach intent is the live one.
    pub fn wanted_by_me(&self, me: &InstanceId, now: DateTime<Utc>) -> bool {
        self.live_intent(now)
            .is_some_and(|intent| &intent.instance == me)
    }

    /// Counts `rung` (an attach intent a ring carried, decision 27) as
    /// this lock's `wanted_by` when it is about this very hold (its epoch),
    /// live at `now`, not from the holder itself, and newer than the intent
    /// the lock records. In memory until this instance next writes the
    /// lock (the holder's transfer, or a renewal of its hold), which then
    /// carries it for everybody.
    pub fn hear(&mut self, rung: &RungIntent, now: DateTime<Utc>) {
        let intent = &rung.intent;
        if rung.epoch == self.epoch
            && intent.expires_at > now
            && self.holder.as_ref() != Some(&intent.instance)
            && self
                .wanted_by
                .as_ref()
                .is_none_or(|recorded| recorded.requested_at < intent.requested_at)
        {
            self.wanted_by = Some(intent.clone());
        }
    }

    /// True if `recorded` (a `status.latest_checkpoint`) was recorded after
    /// this lock's hold took its `checkpoint` over, by an earlier hold: a
    /// late record that must not count (see `checkpoint_taken_over_at`).
    pub fn outdates(&self, recorded: &CheckpointRef) -> bool {
        self.checkpoint_taken_over_at == Some(self.epoch)
            && recorded.epoch < self.epoch
            && self
                .checkpoint
                .as_ref()
                .is_some_and(|carried| carried.path != recorded.path)
    }

    /// The manifest carried with `checkpoint`, if it describes that image.
    pub fn carried_manifest(&self) -> Option<&CheckpointManifest> {
        let reference = self.checkpoint.as_ref()?;
        self.checkpoint_manifest.as_deref().filter(|manifest| {
            manifest.image.key == reference.path
                && manifest.image.sha256 == reference.sha256
                && manifest.image.size == reference.size
        })
    }
}

impl ApiObject for Lease {
    const KIND: &'static str = "lock.json";

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
        if self.holder.is_some() && self.renewed_at.is_none() && self.acquired_at.is_none() {
            return Err((
                "renewed_at".to_owned(),
                "a held lease needs renewed_at or acquired_at".to_owned(),
            ));
        }
        if let Some(intent) = &self.wanted_by
            && intent.expires_at < intent.requested_at
        {
            return Err((
                "wanted_by.expires_at".to_owned(),
                "is before wanted_by.requested_at".to_owned(),
            ));
        }
        if self.epoch > MAX_EPOCH {
            return Err((
                "epoch".to_owned(),
                format!("must be at most {MAX_EPOCH} (the next acquisition adds one)"),
            ));
        }
        Ok(())
    }
}
