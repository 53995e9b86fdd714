//! The reconciler's timing and policy, with the defaults priced in
//! `docs/decisions/0007-instance-leases-and-doorbells.md`.

use std::time::Duration;

/// What a holder does when another instance asks for a sandbox whose
/// execution is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandoffPolicy {
    /// Kill the execution and move the sandbox at once (the earlier server's
    /// behaviour): the new client gets its sandbox fast, the execution is lost.
    #[default]
    Force,
    /// Let the execution finish first; the attach waits (up to its timeout).
    Wait,
}

/// Timing and policy of the reconciler. The defaults (priced in
/// `docs/decisions/0007-instance-leases-and-doorbells.md`) keep an idle held
/// sandbox at two reads a minute (its resync) and no writes: its hold lives
/// on the instance lease, renewed once for every sandbox of the instance, and
/// the instance learns of intents from its doorbell, read every 400 ms.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// How often a held sandbox gets a full pass (re-reads metadata and lock:
    /// operators' raw edits take effect within this, rings or not).
    pub resync_interval: Duration,
    /// How often the instance lease is renewed while the instance holds
    /// sandboxes (one write for all of them).
    pub renew_interval: Duration,
    /// How often the instance reads its doorbell while it holds sandboxes.
    pub doorbell_poll: Duration,
    /// How often it reads it instead while a client attached here has sent
    /// something within `detached_window`: a client whose network drops
    /// mid-use reconnects through another instance within seconds, and this
    /// is when an instance serves requests anyway.
    pub doorbell_poll_active: Duration,
    /// How often the lock of a held sandbox whose client just left is read,
    /// to notice an attach on another instance quickly.
    pub detached_poll: Duration,
    /// For how long after the client left (or last sent a frame while
    /// attached) that fast polling lasts.
    pub detached_window: Duration,
    /// How often an instance waiting for another's lease looks again.
    pub acquire_poll: Duration,
    /// How often it looks while the handoff's image it watches for is not
    /// in the store yet: the holder is still checkpointing, and its
    /// transfer comes after the image; the image's landing wakes the
    /// waiter at once (decision 29).
    pub await_image_poll: Duration,
    /// How soon a checkpoint refused for a running execution is tried again.
    pub checkpoint_retry: Duration,
    pub handoff: HandoffPolicy,
    /// Superseded unnamed checkpoints kept per sandbox besides the latest;
    /// older ones are deleted.
    pub keep_checkpoints: usize,
    /// How long a deleted sandbox's tombstone stays before its objects
    /// (metadata, lock, checkpoints) are removed.
    pub tombstone_retention: Duration,
    /// Fault tests only: abort the process at this step of a handoff
    /// (`handoff:before-checkpoint`, `handoff:after-upload`,
    /// `handoff:after-record`), as a crash there would.
    pub failpoint: Option<String>,
    /// Checkpoint held checkpointable sandboxes this often (between
    /// executions), bounding what a crash of this instance can lose. Each
    /// costs a checkpoint and a restore (about a second of pause).
    pub checkpoint_interval: Option<Duration>,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            resync_interval: Duration::from_secs(60),
            renew_interval: Duration::from_secs(10),
            doorbell_poll: Duration::from_millis(400),
            doorbell_poll_active: Duration::from_millis(200),
            detached_poll: Duration::from_millis(125),
            detached_window: Duration::from_secs(60),
            acquire_poll: Duration::from_millis(25),
            await_image_poll: Duration::from_millis(150),
            checkpoint_retry: Duration::from_secs(2),
            handoff: HandoffPolicy::Force,
            keep_checkpoints: 2,
            tombstone_retention: Duration::from_secs(600),
            checkpoint_interval: None,
            failpoint: None,
        }
    }
}
