//! What the reconciler tells the sessions waiting on a sandbox: what happened
//! to it, in the order it happened, with typed causes, on a per-sandbox
//! broadcast channel.
//!
//! These are domain events, not the wire: the API layer (`src/api`) decides
//! which status frames and messages the earlier server's clients get for each
//! (their order, their words, whether a sandbox's lock events are shown).
//! Nothing here knows those clients.
//!
//! The API layer writes an intent, subscribes here (before writing, so
//! nothing is missed) and maps the events. Sessions that are not attached to
//! the sandbox never subscribe, so a rejected attach cannot steal the
//! attached client's notifications (upstream bug B7).

use crate::api::InstanceId;

/// How a sandbox is started on this instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartKind {
    /// A new sandbox, from its image (and snapshot, if any).
    Create,
    /// From a recorded checkpoint (a move, a named restore, a fork).
    Restore,
}

impl std::fmt::Display for StartKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Create => "create",
            Self::Restore => "restore",
        })
    }
}

/// Why a sandbox did not start here (or will not).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartFailure {
    /// The restore asked for a checkpoint name the sandbox does not have.
    #[error("no checkpoint named {0:?}")]
    NoNamedCheckpoint(String),
    /// Not new, yet no checkpoint recorded: its instance stopped while it ran.
    #[error("it has no checkpoint to restore (its instance stopped while it ran)")]
    NoCheckpoint,
    /// No checkpoint recorded, and its holder recorded it failed (a
    /// checkpoint that lost it, say): that failure, from `last_error`.
    #[error("it failed on its last instance and has no checkpoint to restore: {0}")]
    FailedWithoutCheckpoint(String),
    /// A step of the start failed (recording it, reading the manifest, the
    /// runtime): that step's error.
    #[error("{0}")]
    Step(String),
    /// The cold start hook refused the sandbox.
    #[error("the cold start hook failed: {0}")]
    ColdStartHook(String),
    /// Another instance asked for the sandbox after this one.
    #[error("instance {0} asked for the sandbox meanwhile")]
    WantedElsewhere(InstanceId),
    /// This instance's attach intent expired before the start.
    #[error("the attach request expired before the sandbox could be started")]
    IntentExpired,
    /// The holder checkpointed it instead of handing it over (an operator,
    /// a shutdown): a new attach restores it.
    #[error("its holder checkpointed it before it could move here")]
    CheckpointedMeanwhile,
    /// `metadata.json` is not a valid document (an operator's typo).
    #[error("{0}")]
    InvalidMetadata(String),
}

/// Why a checkpoint was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointFailure {
    /// The sandbox was created without `enable_checkpoint`; it keeps running.
    #[error("the sandbox was created without enable_checkpoint")]
    NotConfigured,
    /// The runtime failed; the sandbox keeps running.
    #[error("{0}")]
    Runtime(String),
    /// The runtime failed and lost the sandbox: it no longer runs anywhere
    /// (recorded as failed, its lease released).
    #[error("{0}")]
    SandboxLost(String),
}

impl CheckpointFailure {
    /// The sandbox went with the failed checkpoint.
    pub fn sandbox_lost(&self) -> bool {
        matches!(self, Self::SandboxLost(_))
    }
}

/// Why a sandbox stopped on this instance without being asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossCause {
    /// The local sandbox died (its runtime lost it).
    #[error("the sandbox stopped unexpectedly on this instance")]
    Died,
    #[error("its metadata.json was deleted")]
    MetadataDeleted,
    /// A lock read (or a re-verification's write) showed another holder or
    /// epoch, or a newer holder's record in `status`.
    #[error("the lease was taken over (holder now {})", .holder.as_ref().map_or_else(|| "nobody".to_owned(), ToString::to_string))]
    TakenOver { holder: Option<InstanceId> },
    /// The bucket could not be reached to re-verify a hold no longer
    /// vouched for: past what this instance can vouch for.
    #[error("the lease could not be renewed: {0}")]
    RenewalFailed(String),
}

/// What happened to one sandbox, as the reconciler saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxEvent {
    /// This instance started acquiring the sandbox's lease (said once per
    /// acquisition, however many tries it takes).
    LeaseAcquiring,
    LeaseAcquired,
    /// A checkpoint is being restored here.
    Restoring,
    /// The sandbox runs on this instance under lease `epoch`.
    Running {
        epoch: u64,
    },
    /// Another instance asked for the sandbox: it is being handed over.
    HandoffRequested,
    /// A checkpoint started (for a handoff, a client, an idle timer, a
    /// shutdown).
    CheckpointStarted,
    /// The sandbox stops running here: it is being deleted, or the
    /// checkpoint just taken (or failed) removed it.
    Stopping,
    LeaseReleasing,
    LeaseReleased,
    /// The sandbox is deleted: its tombstone is written (or it already was
    /// one).
    Deleted,
    /// The checkpoint is recorded (its image key) and the lease released:
    /// the sandbox runs nowhere until it is restored.
    Checkpointed {
        image: String,
    },
    /// A checkpoint waits for the running execution; the sandbox keeps
    /// running and the checkpoint is tried again.
    CheckpointWaitsForExecution,
    StartFailed {
        kind: StartKind,
        cause: StartFailure,
    },
    CheckpointFailed(CheckpointFailure),
    /// Destroying the sandbox failed (the runtime's error); it is tried again.
    DeleteFailed(String),
    /// The sandbox stopped here without being asked.
    Lost(LossCause),
}

impl SandboxEvent {
    /// After this event the sandbox no longer runs on this instance.
    pub fn ends_hold(&self) -> bool {
        match self {
            Self::Deleted | Self::Checkpointed { .. } | Self::Lost(_) => true,
            Self::CheckpointFailed(cause) => cause.sandbox_lost(),
            _ => false,
        }
    }
}
