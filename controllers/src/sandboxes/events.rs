//! What the reconciler tells the sessions waiting on a sandbox: what happened
//! to it, in order, with typed causes, on a per-sandbox broadcast channel.
//!
//! Domain events, not the wire: the API layer (`src/api`) decides the status frames and messages
//! the earlier server's clients get for each. It writes an intent, subscribes here (before writing,
//! so nothing is missed) and maps the events. Sessions not attached never subscribe, so a rejected
//! attach cannot steal the attached client's notifications (upstream bug B7).

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
    #[error("no checkpoint named {0:?}")]
    NoNamedCheckpoint(String),
    /// Not new, yet no checkpoint recorded: its instance stopped while it ran.
    #[error("it has no checkpoint to restore (its instance stopped while it ran)")]
    NoCheckpoint,
    /// No checkpoint; recorded failed (e.g. a checkpoint lost it): `last_error`.
    #[error("it failed on its last instance and has no checkpoint to restore: {0}")]
    FailedWithoutCheckpoint(String),
    /// A start step failed (recording, reading the manifest, the runtime).
    #[error("{0}")]
    Step(String),
    #[error("the cold start hook failed: {0}")]
    ColdStartHook(String),
    #[error("instance {0} asked for the sandbox meanwhile")]
    WantedElsewhere(InstanceId),
    #[error("the attach request expired before the sandbox could be started")]
    IntentExpired,
    /// This instance began shutting down before it could start it here.
    #[error("this instance is shutting down: attach again (another instance takes over)")]
    ShuttingDown,
    /// Checkpointed instead of handed over (operator, shutdown): attach again.
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
    /// The runtime failed and lost the sandbox: recorded failed, lease released.
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
    /// A lock (read or re-verified) or `status` shows another holder or epoch.
    #[error("the lease was taken over (holder now {})", .holder.as_ref().map_or_else(|| "nobody".to_owned(), ToString::to_string))]
    TakenOver { holder: Option<InstanceId> },
    /// The bucket could not be reached to re-verify a hold no longer vouched for.
    #[error("the lease could not be renewed: {0}")]
    RenewalFailed(String),
}

/// What happened to one sandbox, as the reconciler saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxEvent {
    /// Acquiring the lease started (once per acquisition, however many tries).
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
    /// A checkpoint started (handoff, client, idle timer, shutdown).
    CheckpointStarted,
    /// Stops running here: deleted, or removed by a checkpoint (taken or failed).
    Stopping,
    LeaseReleasing,
    LeaseReleased,
    /// Deleted: its tombstone is written (or it already was one).
    Deleted,
    /// The checkpoint (its image key) is safe, carried by the lock or recorded,
    /// and the hold ended: the sandbox runs nowhere until restored.
    Checkpointed {
        image: String,
    },
    /// A checkpoint waits for a running execution (the sandbox runs; retried).
    CheckpointWaitsForExecution,
    StartFailed {
        kind: StartKind,
        cause: StartFailure,
    },
    CheckpointFailed(CheckpointFailure),
    /// Destroying the sandbox failed (the runtime's error); it is tried again.
    DeleteFailed(String),
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
