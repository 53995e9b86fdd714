//! The controller's domain events as this session's status frames: the
//! order the earlier server's clients expect (`DELETED` before
//! `CHECKPOINTED` and `KILLED`), the lock statuses of handoff sandboxes only,
//! and which events end the session (upstream-wire-contract §3.7–3.10).

use std::sync::Arc;

use controllers::api::DesiredState;
use controllers::sandboxes::SandboxEvent;
use tokio::sync::broadcast;

use crate::api::events;
use crate::api::protocol::Status;

use super::Session;
use super::out::{CLOSE_FATAL, CLOSE_NORMAL};

impl Session {
    /// Relays the controller's events until one ends the session.
    pub(super) async fn relay_events(
        self: Arc<Self>,
        mut events: broadcast::Receiver<SandboxEvent>,
    ) {
        loop {
            let end = match events.recv().await {
                Ok(event) => self.relay(event).await,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::warn!(sandbox = %self.id, missed, "session fell behind the controller's events");
                    false
                }
                Err(broadcast::error::RecvError::Closed) => true,
            };
            self.settled.notify_waiters();
            if end {
                return;
            }
        }
    }

    /// Turns a controller event into status frames. True when the session ends.
    async fn relay(&self, event: SandboxEvent) -> bool {
        let out = &self.out;
        let handoff = self.live.options().handoff;
        match event {
            SandboxEvent::LeaseAcquiring
            | SandboxEvent::LeaseAcquired
            | SandboxEvent::Restoring
            | SandboxEvent::Running { .. }
            | SandboxEvent::StartFailed { .. } => {}
            SandboxEvent::HandoffRequested => {
                out.status(Status::LockReleaseRequested).await;
            }
            // Lock statuses are shown to handoff sandboxes' clients only.
            SandboxEvent::LeaseReleasing if handoff => {
                out.status(Status::LockReleasing).await;
            }
            SandboxEvent::LeaseReleased if handoff => {
                out.status(Status::LockReleased).await;
            }
            SandboxEvent::LeaseReleasing | SandboxEvent::LeaseReleased => {}
            SandboxEvent::CheckpointStarted => {
                // Unless it is kept: it goes on after the restore.
                if let Some(execution) = self.live.execution()
                    && !self.live.options().keep_executions
                {
                    execution.expect_forced_kill(true);
                }
                // The session said CHECKPOINTING itself when its client asked.
                if !self.pending.checkpoint() {
                    out.status(Status::Checkpointing).await;
                }
            }
            SandboxEvent::Stopping => {
                out.status(Status::Deleting).await;
            }
            SandboxEvent::Deleted => {
                // Deleted by this client's kill, idle expiry or an operator:
                // nothing to attach to.
                self.say_deleted().await;
                out.close(CLOSE_NORMAL).await;
                return true;
            }
            SandboxEvent::Checkpointed { .. } => {
                // The clients expect the sandbox "deleted" first: DELETED is
                // what stops the Python client's reconnects.
                if !self.say_deleted().await {
                    out.status(Status::Checkpointed).await;
                }
                out.close(CLOSE_NORMAL).await;
                return true;
            }
            SandboxEvent::CheckpointWaitsForExecution => {
                if let Some(execution) = self.live.execution() {
                    execution.expect_forced_kill(false);
                }
                if self.pending.take_checkpoint() {
                    out.error(
                        Status::ExecutionInProgressError,
                        "Cannot checkpoint while an execution is in progress.",
                    )
                    .await;
                    self.cancel_checkpoint().await;
                }
            }
            SandboxEvent::CheckpointFailed(cause) => {
                let gone = cause.sandbox_lost();
                if gone && self.say_deleted().await {
                    out.close(CLOSE_NORMAL).await;
                    return true;
                }
                out.error(
                    Status::CheckpointError,
                    &events::checkpoint_failure(&self.id, &cause),
                )
                .await;
                let requested = self.pending.take_checkpoint();
                let gone = gone || !self.controller.is_held_here(&self.id);
                if requested && !gone {
                    self.cancel_checkpoint().await;
                }
                if requested || gone {
                    out.close(CLOSE_FATAL).await;
                    return true;
                }
            }
            SandboxEvent::DeleteFailed(detail) => {
                if self.pending.take_kill() {
                    out.error(Status::KillError, &detail).await;
                    out.close(CLOSE_NORMAL).await;
                    return true;
                }
                out.error(Status::Error, &detail).await;
            }
            SandboxEvent::Lost(cause) => {
                out.error(Status::Error, &events::loss(&self.id, &cause))
                    .await;
                out.close(CLOSE_FATAL).await;
                return true;
            }
        }
        false
    }

    /// The sandbox no longer runs here: `SANDBOX_DELETED`, then
    /// `SANDBOX_KILLED` if this session asked for its deletion (true then:
    /// nothing else is said, the caller closes).
    async fn say_deleted(&self) -> bool {
        self.out.status(Status::Deleted).await;
        if self.pending.kill() {
            self.out.status(Status::Killed).await;
            return true;
        }
        false
    }

    /// A refused checkpoint leaves the sandbox running: say so in the spec, or
    /// the controller would keep trying.
    async fn cancel_checkpoint(&self) {
        if let Err(err) = self
            .controller
            .request_state(&self.id, DesiredState::Running, None)
            .await
        {
            tracing::warn!(sandbox = %self.id, %err, "cannot withdraw the checkpoint request");
        }
    }
}
