//! The controller's domain events as this session's status frames: the
//! order the earlier server's clients expect (`DELETED` before
//! `CHECKPOINTED` and `KILLED`), the lock statuses of handoff sandboxes only,
//! and which events end the session (`docs/wire-contract.md` §3.7–3.10).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use controllers::api::{DesiredState, SandboxId};
use controllers::sandboxes::SandboxEvent;
use tokio::sync::broadcast;

use crate::api::events;
use crate::api::protocol::{ServerFrame, Status};

use super::Session;
use super::out::{CLOSE_FATAL, CLOSE_NORMAL};
use super::pending::Pending;

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
                    // A CHECKPOINTING may be among them: hold no output back.
                    self.checkpoint_said.store(true, Ordering::Release);
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
        let reply = reply(
            &self.id,
            &event,
            self.live.options().handoff,
            &self.pending,
            || self.controller.is_held_here(&self.id),
        );
        for frame in reply.frames {
            if !self.out.send(frame).await {
                break;
            }
        }
        // Said: an execution the checkpoint kills may report it now.
        match &event {
            SandboxEvent::CheckpointStarted => self.checkpoint_said.store(true, Ordering::Release),
            SandboxEvent::CheckpointWaitsForExecution => {
                self.checkpoint_said.store(false, Ordering::Release);
            }
            _ => {}
        }
        if reply.cancel_checkpoint {
            self.cancel_checkpoint().await;
        }
        match reply.close {
            Some(code) => {
                self.out.close(code).await;
                true
            }
            None => false,
        }
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

/// What a session does for one controller event: the frames it sends, in
/// order, whether it withdraws its refused checkpoint request, and the close
/// that ends it (if any).
#[derive(Debug, Default, PartialEq, Eq)]
struct Reply {
    frames: Vec<ServerFrame>,
    cancel_checkpoint: bool,
    close: Option<u16>,
}

impl Reply {
    fn status(&mut self, status: Status) {
        self.frames.push(ServerFrame::status(status));
    }

    /// An error status with its message, then the `error` event.
    fn error(&mut self, status: Status, message: String) {
        self.frames
            .push(ServerFrame::status_with(status, message.clone()));
        self.frames.push(ServerFrame::Error(message));
    }

    /// `SANDBOX_DELETED`, then `SANDBOX_KILLED` and the close if the
    /// session asked for the deletion (true then: nothing else is said).
    fn deleted(&mut self, pending: &Pending) -> bool {
        self.status(Status::Deleted);
        if pending.kill() {
            self.status(Status::Killed);
            self.close = Some(CLOSE_NORMAL);
            return true;
        }
        false
    }
}

/// The wire's reading of `event` for a session of sandbox `id` (a handoff
/// sandbox's client sees lock statuses), given what the session asked for
/// (`pending`, updated here) and whether the sandbox still runs here.
fn reply(
    id: &SandboxId,
    event: &SandboxEvent,
    handoff: bool,
    pending: &Pending,
    held_here: impl FnOnce() -> bool,
) -> Reply {
    let mut reply = Reply::default();
    match event {
        SandboxEvent::LeaseAcquiring
        | SandboxEvent::LeaseAcquired
        | SandboxEvent::Restoring
        | SandboxEvent::Running { .. }
        | SandboxEvent::StartFailed { .. } => {}
        SandboxEvent::HandoffRequested => reply.status(Status::LockReleaseRequested),
        // Lock statuses are shown to handoff sandboxes' clients only.
        SandboxEvent::LeaseReleasing if handoff => reply.status(Status::LockReleasing),
        SandboxEvent::LeaseReleased if handoff => reply.status(Status::LockReleased),
        SandboxEvent::LeaseReleasing | SandboxEvent::LeaseReleased => {}
        SandboxEvent::CheckpointStarted => {
            // The session said CHECKPOINTING itself when its client asked.
            if !pending.checkpoint() {
                reply.status(Status::Checkpointing);
            }
        }
        SandboxEvent::Stopping => reply.status(Status::Deleting),
        SandboxEvent::Deleted => {
            // Deleted by this client's kill, idle expiry or an operator:
            // nothing to attach to.
            if !reply.deleted(pending) {
                reply.close = Some(CLOSE_NORMAL);
            }
        }
        SandboxEvent::Checkpointed { .. } => {
            // The clients expect the sandbox "deleted" first: DELETED is
            // what stops the Python client's reconnects.
            if !reply.deleted(pending) {
                reply.status(Status::Checkpointed);
                reply.close = Some(CLOSE_NORMAL);
            }
        }
        SandboxEvent::CheckpointWaitsForExecution => {
            if pending.take_checkpoint() {
                reply.error(
                    Status::ExecutionInProgressError,
                    "Cannot checkpoint while an execution is in progress.".to_owned(),
                );
                reply.cancel_checkpoint = true;
            }
        }
        SandboxEvent::CheckpointFailed(cause) => {
            let lost = cause.sandbox_lost();
            if lost && reply.deleted(pending) {
                return reply;
            }
            reply.error(
                Status::CheckpointError,
                events::checkpoint_failure(id, cause),
            );
            let requested = pending.take_checkpoint();
            let gone = lost || !held_here();
            reply.cancel_checkpoint = requested && !gone;
            if requested || gone {
                reply.close = Some(CLOSE_FATAL);
            }
        }
        SandboxEvent::DeleteFailed(detail) => {
            if pending.take_kill() {
                reply.error(Status::KillError, detail.clone());
                reply.close = Some(CLOSE_NORMAL);
            } else {
                reply.error(Status::Error, detail.clone());
            }
        }
        SandboxEvent::Lost(cause) => {
            reply.error(Status::Error, events::loss(id, cause));
            reply.close = Some(CLOSE_FATAL);
        }
    }
    reply
}

#[cfg(test)]
mod tests {
    use controllers::sandboxes::{CheckpointFailure, LossCause};

    use super::*;

    fn statuses(reply: &Reply) -> Vec<&'static str> {
        reply
            .frames
            .iter()
            .filter_map(|frame| match frame {
                ServerFrame::Status { status, .. } => Some(status.as_str()),
                _ => None,
            })
            .collect()
    }

    /// The statuses and close a session gives for `events` in turn.
    fn run(
        events: &[SandboxEvent],
        handoff: bool,
        pending: &Pending,
    ) -> (Vec<&'static str>, Option<u16>) {
        let id = SandboxId::random();
        let mut said = Vec::new();
        for event in events {
            let reply = reply(&id, event, handoff, pending, || true);
            said.extend(statuses(&reply));
            if reply.close.is_some() {
                return (said, reply.close);
            }
        }
        (said, None)
    }

    fn checkpoint_events() -> Vec<SandboxEvent> {
        vec![
            SandboxEvent::CheckpointStarted,
            SandboxEvent::Stopping,
            SandboxEvent::LeaseReleasing,
            SandboxEvent::LeaseReleased,
            SandboxEvent::Checkpointed {
                image: "checkpoints/x/checkpoint.img".to_owned(),
            },
        ]
    }

    #[test]
    fn a_checkpoint_reads_deleted_before_checkpointed_with_lock_statuses_for_handoff_only() {
        let (said, close) = run(&checkpoint_events(), false, &Pending::default());
        assert_eq!(
            said,
            [
                "SANDBOX_CHECKPOINTING",
                "SANDBOX_DELETING",
                "SANDBOX_DELETED",
                "SANDBOX_CHECKPOINTED"
            ]
        );
        assert_eq!(close, Some(CLOSE_NORMAL));
        let (said, _) = run(&checkpoint_events(), true, &Pending::default());
        assert_eq!(
            said,
            [
                "SANDBOX_CHECKPOINTING",
                "SANDBOX_DELETING",
                "SANDBOX_LOCK_RELEASING",
                "SANDBOX_LOCK_RELEASED",
                "SANDBOX_DELETED",
                "SANDBOX_CHECKPOINTED"
            ]
        );
    }

    #[test]
    fn a_kill_during_a_checkpoint_ends_with_killed_not_checkpointed() {
        let pending = Pending::default();
        pending.set_checkpoint(true);
        pending.set_kill(true);
        let (said, close) = run(&checkpoint_events(), false, &pending);
        assert_eq!(
            said,
            ["SANDBOX_DELETING", "SANDBOX_DELETED", "SANDBOX_KILLED"]
        );
        assert_eq!(close, Some(CLOSE_NORMAL));
    }

    #[test]
    fn a_deletion_closes_the_session_killed_only_if_it_asked() {
        let deletion = [
            SandboxEvent::Stopping,
            SandboxEvent::LeaseReleasing,
            SandboxEvent::LeaseReleased,
            SandboxEvent::Deleted,
        ];
        let (said, close) = run(&deletion, false, &Pending::default());
        assert_eq!(said, ["SANDBOX_DELETING", "SANDBOX_DELETED"]);
        assert_eq!(close, Some(CLOSE_NORMAL));
        let asked = Pending::default();
        asked.set_kill(true);
        let (said, _) = run(&deletion, false, &asked);
        assert_eq!(
            said,
            ["SANDBOX_DELETING", "SANDBOX_DELETED", "SANDBOX_KILLED"]
        );
    }

    #[test]
    fn a_checkpoint_that_lost_the_sandbox_says_deleted_then_the_error_and_closes_4000() {
        let id = SandboxId::random();
        let lost =
            SandboxEvent::CheckpointFailed(CheckpointFailure::SandboxLost("runsc died".into()));
        let reply = reply(&id, &lost, false, &Pending::default(), || true);
        let message = format!("Failed to checkpoint sandbox {id}: runsc died");
        assert_eq!(
            reply,
            Reply {
                frames: vec![
                    ServerFrame::status(Status::Deleted),
                    ServerFrame::status_with(Status::CheckpointError, message.clone()),
                    ServerFrame::Error(message),
                ],
                cancel_checkpoint: false,
                close: Some(CLOSE_FATAL),
            }
        );
    }

    #[test]
    fn a_refused_checkpoint_is_an_error_only_for_the_session_that_asked() {
        let id = SandboxId::random();
        let waits = SandboxEvent::CheckpointWaitsForExecution;
        assert_eq!(
            reply(&id, &waits, false, &Pending::default(), || true),
            Reply::default()
        );
        let asked = Pending::default();
        asked.set_checkpoint(true);
        let answer = reply(&id, &waits, false, &asked, || true);
        assert_eq!(statuses(&answer), ["SANDBOX_EXECUTION_IN_PROGRESS_ERROR"]);
        assert!(answer.cancel_checkpoint);
        assert_eq!(answer.close, None);
        assert!(!asked.checkpoint(), "no longer pending");

        let failed = SandboxEvent::CheckpointFailed(CheckpointFailure::Runtime("disk full".into()));
        asked.set_checkpoint(true);
        let answer = reply(&id, &failed, false, &asked, || true);
        assert!(answer.cancel_checkpoint);
        assert_eq!(answer.close, Some(CLOSE_FATAL));
        // Nobody here asked and the sandbox still runs: said, session kept.
        let answer = reply(&id, &failed, false, &Pending::default(), || true);
        assert_eq!(statuses(&answer), ["SANDBOX_CHECKPOINT_ERROR"]);
        assert_eq!(answer.close, None);
    }

    #[test]
    fn a_loss_is_an_error_and_a_fatal_close() {
        let id = SandboxId::random();
        let reply = reply(
            &id,
            &SandboxEvent::Lost(LossCause::TakenOver { holder: None }),
            false,
            &Pending::default(),
            || false,
        );
        let message = format!(
            "Sandbox {id} stopped on this instance: the lease was taken over (holder now nobody)"
        );
        assert_eq!(reply.frames[1], ServerFrame::Error(message));
        assert_eq!(reply.close, Some(CLOSE_FATAL));
    }
}
