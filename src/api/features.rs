//! What this server can do ([`Features`]), as the init message's checks and
//! the sessions see it: below the handlers' state, which carries it.

use super::snapshot_quota::SnapshotQuota;

/// Default of `--max-named-checkpoints`.
pub const DEFAULT_MAX_NAMED_CHECKPOINTS: usize = 32;

/// What this server can do, as the init message's checks see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    pub checkpoint: bool,
    pub snapshot: bool,
    /// Creates may ask for `"network": "egress"` (the runtime has networking).
    pub network_egress: bool,
    /// Snapshot names are deployment-wide and need no owner's proof
    /// (`SANDBOXD_SHARED_SNAPSHOTS`, for a single team; docs/security.md).
    pub shared_snapshots: bool,
    /// Named checkpoints one sandbox may keep (`--max-named-checkpoints`).
    pub max_named_checkpoints: usize,
    /// Filesystem snapshots one owner may keep.
    pub snapshot_quota: SnapshotQuota,
}

impl Default for Features {
    /// Checkpoints and snapshots; no egress (a runtime with networking turns
    /// it on).
    fn default() -> Self {
        Self {
            checkpoint: true,
            snapshot: true,
            network_egress: false,
            shared_snapshots: false,
            max_named_checkpoints: DEFAULT_MAX_NAMED_CHECKPOINTS,
            snapshot_quota: SnapshotQuota::default(),
        }
    }
}
