//! The wire's reading of the controller's domain events
//! ([`SandboxEvent`]): the messages the earlier server's clients get for each
//! typed cause, and the wait for a sandbox to start here (`/create`,
//! `/attach`), relaying its lock statuses. The controllers say what happened
//! and why; the words, their order and which statuses a client sees are
//! decided here and in the session (`docs/wire-contract.md` §3,
//! `docs/protocol.md`).

use std::time::Duration;

use controllers::api::SandboxId;
use controllers::sandboxes::{CheckpointFailure, LossCause, SandboxEvent, StartFailure, StartKind};
use tokio::sync::broadcast;

use super::protocol::Status;
use super::session::Out;

/// How long a create or restore may take before the client is told it failed.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The message of a start that failed (`SANDBOX_CREATION_ERROR` on
/// `/create`; inside `SANDBOX_RESTORE_ERROR`'s, see [`NotStarted::restore_message`]).
pub fn start_failure(id: &SandboxId, kind: StartKind, cause: &StartFailure) -> String {
    let in_step = |detail: &str| match kind {
        StartKind::Create => format!("Failed to create gVisor container {id}: {detail}"),
        StartKind::Restore => format!("Failed to restore sandbox {id}: {detail}"),
    };
    match cause {
        StartFailure::NoNamedCheckpoint(name) => in_step(&format!("no checkpoint named {name:?}")),
        StartFailure::NoCheckpoint | StartFailure::FailedWithoutCheckpoint(_) => {
            in_step(&cause.to_string())
        }
        StartFailure::Step(detail) => in_step(detail),
        StartFailure::ColdStartHook(detail) => {
            in_step(&format!("the cold start hook failed: {detail}"))
        }
        StartFailure::WantedElsewhere(instance) => {
            format!("instance {instance} asked for the sandbox meanwhile")
        }
        StartFailure::IntentExpired => {
            "the attach request expired before the sandbox could be started".to_owned()
        }
        StartFailure::ShuttingDown => cause.to_string(),
        StartFailure::CheckpointedMeanwhile => format!(
            "Sandbox {id} was checkpointed by its instance (shutting down, or an operator) \
             before it could move here; attach again to restore it"
        ),
        StartFailure::InvalidMetadata(detail) => detail.clone(),
    }
}

/// The message of `SANDBOX_CHECKPOINT_ERROR` for a checkpoint the
/// controller could not take.
pub fn checkpoint_failure(id: &SandboxId, cause: &CheckpointFailure) -> String {
    match cause {
        CheckpointFailure::NotConfigured => {
            format!("Sandbox {id} is not configured for checkpointing.")
        }
        CheckpointFailure::Runtime(detail) | CheckpointFailure::SandboxLost(detail) => {
            format!("Failed to checkpoint sandbox {id}: {detail}")
        }
    }
}

/// The message of the `SANDBOX_ERROR` that ends a session whose sandbox
/// stopped here without being asked.
pub fn loss(id: &SandboxId, cause: &LossCause) -> String {
    match cause {
        LossCause::Died => cause.to_string(),
        cause => format!("Sandbox {id} stopped on this instance: {cause}"),
    }
}

/// Why a sandbox a client waits for did not start here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotStarted {
    Failed {
        kind: StartKind,
        cause: StartFailure,
    },
    CheckpointFailed(CheckpointFailure),
    DeleteFailed(String),
    Lost(LossCause),
    /// Deleted (or checkpointed away) meanwhile.
    Deleted,
    ControllerStopped,
    TimedOut(Duration),
}

impl NotStarted {
    /// The message on `/create` (`SANDBOX_CREATION_ERROR`).
    pub fn message(&self, id: &SandboxId) -> String {
        match self {
            Self::Failed { kind, cause } => start_failure(id, *kind, cause),
            Self::CheckpointFailed(cause) => checkpoint_failure(id, cause),
            Self::DeleteFailed(detail) => detail.clone(),
            Self::Lost(cause) => loss(id, cause),
            Self::Deleted => "the sandbox was deleted".to_owned(),
            Self::ControllerStopped => "the controller stopped".to_owned(),
            Self::TimedOut(after) => format!("timed out after {} s", after.as_secs()),
        }
    }

    /// The message on `/attach` (`SANDBOX_RESTORE_ERROR`): always
    /// "Failed to restore sandbox <id>: …", said once.
    pub fn restore_message(&self, id: &SandboxId) -> String {
        let says_restore = matches!(
            self,
            Self::Failed {
                kind: StartKind::Restore,
                cause: StartFailure::NoNamedCheckpoint(_)
                    | StartFailure::NoCheckpoint
                    | StartFailure::FailedWithoutCheckpoint(_)
                    | StartFailure::Step(_)
                    | StartFailure::ColdStartHook(_),
            }
        );
        if says_restore {
            self.message(id)
        } else {
            format!("Failed to restore sandbox {id}: {}", self.message(id))
        }
    }
}

/// Waits for the controller to start the sandbox here, relaying the lock
/// statuses to a handoff sandbox's client.
pub async fn await_running(
    out: &Out,
    events: &mut broadcast::Receiver<SandboxEvent>,
    handoff: bool,
) -> Result<(), NotStarted> {
    let wait = async {
        loop {
            match events.recv().await {
                Ok(SandboxEvent::Running { .. }) => return Ok(()),
                Ok(SandboxEvent::LeaseAcquiring) if handoff => {
                    out.status(Status::LockAcquiring).await;
                }
                Ok(SandboxEvent::LeaseAcquired) if handoff => {
                    out.status(Status::LockAcquired).await;
                }
                Ok(SandboxEvent::StartFailed { kind, cause }) => {
                    return Err(NotStarted::Failed { kind, cause });
                }
                Ok(SandboxEvent::Lost(cause)) => return Err(NotStarted::Lost(cause)),
                Ok(SandboxEvent::Deleted | SandboxEvent::Checkpointed { .. }) => {
                    return Err(NotStarted::Deleted);
                }
                Ok(SandboxEvent::CheckpointFailed(cause)) => {
                    return Err(if cause.sandbox_lost() {
                        NotStarted::Deleted
                    } else {
                        NotStarted::CheckpointFailed(cause)
                    });
                }
                Ok(SandboxEvent::DeleteFailed(detail)) => {
                    return Err(NotStarted::DeleteFailed(detail));
                }
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(NotStarted::ControllerStopped);
                }
            }
        }
    };
    tokio::time::timeout(START_TIMEOUT, wait)
        .await
        .unwrap_or(Err(NotStarted::TimedOut(START_TIMEOUT)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> SandboxId {
        SandboxId::random()
    }

    #[test]
    fn a_failed_restore_says_failed_to_restore_once() {
        let id = id();
        let step = NotStarted::Failed {
            kind: StartKind::Restore,
            cause: StartFailure::Step("corrupt".to_owned()),
        };
        assert_eq!(
            step.restore_message(&id),
            format!("Failed to restore sandbox {id}: corrupt")
        );
        let elsewhere = NotStarted::Failed {
            kind: StartKind::Restore,
            cause: StartFailure::IntentExpired,
        };
        assert_eq!(
            elsewhere.restore_message(&id),
            format!(
                "Failed to restore sandbox {id}: the attach request expired before the sandbox could be started"
            )
        );
        let create = NotStarted::Failed {
            kind: StartKind::Create,
            cause: StartFailure::Step("no image".to_owned()),
        };
        assert_eq!(
            create.restore_message(&id),
            format!(
                "Failed to restore sandbox {id}: Failed to create gVisor container {id}: no image"
            )
        );
        assert_eq!(
            create.message(&id),
            format!("Failed to create gVisor container {id}: no image")
        );
    }

    #[test]
    fn losses_and_checkpoint_failures_read_as_upstream_did() {
        let id = id();
        assert_eq!(
            loss(&id, &LossCause::TakenOver { holder: None }),
            format!(
                "Sandbox {id} stopped on this instance: the lease was taken over (holder now nobody)"
            )
        );
        assert_eq!(
            loss(&id, &LossCause::Died),
            "the sandbox stopped unexpectedly on this instance"
        );
        assert_eq!(
            checkpoint_failure(&id, &CheckpointFailure::NotConfigured),
            format!("Sandbox {id} is not configured for checkpointing.")
        );
    }
}
