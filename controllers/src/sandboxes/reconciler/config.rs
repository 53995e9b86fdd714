//! The reconciler's timing and policy; defaults priced in decision 7.

use std::time::Duration;

/// What a holder does when asked for a sandbox whose execution still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandoffPolicy {
    /// Kill the execution and move the sandbox: the new client gets it fast; the execution is lost.
    #[default]
    Force,
    /// Let the execution finish first; the attach waits (up to its timeout).
    Wait,
}

/// Timing and policy of the reconciler. The defaults keep an idle held sandbox at two reads a
/// minute (its resync) and no writes: its hold lives on the instance lease (one renewal for all),
/// and intents arrive by the doorbell, read every 400 ms.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// How often a held sandbox gets a full pass (re-reads metadata and lock:
    /// operators' raw edits take effect within this, rings or not).
    pub resync_interval: Duration,
    /// How often the instance lease is renewed while holding sandboxes.
    pub renew_interval: Duration,
    /// How often the instance reads its doorbell while it holds sandboxes.
    pub doorbell_poll: Duration,
    /// Doorbell poll while a client here sent something in `detached_window`:
    /// a dropped client reconnects elsewhere in seconds; it's busy then anyway.
    pub doorbell_poll_active: Duration,
    /// Lock poll of a held sandbox whose client left: spots attaches elsewhere.
    pub detached_poll: Duration,
    /// How long fast polling lasts after the client left or last sent a frame.
    pub detached_window: Duration,
    /// How often an instance waiting for another's lease looks again.
    pub acquire_poll: Duration,
    /// Acquire poll while the handoff's image is not stored yet (the transfer
    /// follows it; its landing wakes the waiter at once: decision 29).
    pub await_image_poll: Duration,
    /// How soon a checkpoint refused for a running execution is tried again.
    pub checkpoint_retry: Duration,
    pub handoff: HandoffPolicy,
    /// Superseded unnamed checkpoints kept per sandbox besides the latest.
    pub keep_checkpoints: usize,
    /// How long a tombstone stays before its metadata, lock and checkpoints go.
    pub tombstone_retention: Duration,
    /// Fault tests only: abort the process at this step of a handoff (`handoff:before-checkpoint`,
    /// `handoff:after-upload`, `handoff:after-record`), as a crash there would.
    pub failpoint: Option<String>,
    /// Checkpoint period for held checkpointable sandboxes between executions,
    /// bounding a crash's loss; each checkpoint + restore pauses ~1 s.
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
