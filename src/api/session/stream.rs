//! Streaming an execution's output to the socket: one streamer per session,
//! replaced by a `reconnect` (which first replays what was not delivered);
//! a frame leaves the execution's log only once the socket's writer has it.

use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::Ordering;

use crate::api::output::ExecutionState;
use crate::api::protocol::{ServerFrame, Status};

use super::Session;

/// How often a streamer held back by a checkpoint that keeps the execution
/// looks again (the checkpoint may fail and delivery go on here).
const FROZEN_POLL: Duration = Duration::from_millis(100);

/// How long a forced kill's FORCE_KILLED waits for the relay's
/// CHECKPOINTING at most (it was emitted before the kill: only a relay far
/// behind takes this long).
const CHECKPOINT_SAID_WAIT: Duration = Duration::from_secs(5);

/// A frame between `begin_delivery` and `end_delivery`: a streamer aborted
/// while it waits for the socket's writer (a `reconnect` replaced it) ends
/// the delivery as not delivered (a cancelled queue send sends nothing).
struct Delivery<'a> {
    execution: &'a ExecutionState,
    event: u64,
    ended: bool,
}

impl Delivery<'_> {
    fn end(mut self, delivered: bool) {
        self.ended = true;
        self.execution.end_delivery(self.event, delivered);
    }
}

impl Drop for Delivery<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.execution.end_delivery(self.event, false);
        }
    }
}

impl Session {
    /// Stops the current streamer, if any (the session ends).
    pub(super) fn stop_streamer(&self) {
        let previous = self
            .streamer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(previous) = previous {
            previous.abort();
        }
    }

    /// Streams `execution`'s log to this socket until DONE. A frame leaves
    /// the log only once the socket's writer has it, so a streamer replaced
    /// by a `reconnect` (or stopped with the session) loses nothing.
    pub(super) fn stream(self: &Arc<Self>, execution: Arc<ExecutionState>) {
        let out = self.out.clone();
        let session = Arc::clone(self);
        let mut streamer = self
            .streamer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The client closed (a frame it sent before is handled after the
        // detach): nothing streams to a dead socket, where a frame the writer
        // queued would count as delivered; the output waits in the log for
        // the next attach's `reconnect`. Checked under the lock the session's
        // end takes to stop the streamer, so none outlives it.
        if self.ended.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let previous = streamer.take();
        let task = tokio::spawn(async move {
            // Two streamers never take from one log at once.
            if let Some(previous) = previous {
                previous.abort();
                let _ = previous.await;
            }
            while let Some((event, frame)) = execution.next_frame().await {
                // A resumable execution being moved with its sandbox: what
                // is left goes with it (or, if the checkpoint fails, here).
                while !execution.begin_delivery(event) {
                    if out.is_closing() {
                        return;
                    }
                    tokio::time::sleep(FROZEN_POLL).await;
                }
                if frame == ServerFrame::status(Status::ExecutionForceKilled)
                    && execution.killed_by_checkpoint()
                {
                    session.checkpoint_said().await;
                }
                let delivery = Delivery {
                    execution: &execution,
                    event,
                    ended: false,
                };
                let sent = out.send(frame).await;
                delivery.end(sent);
                if !sent {
                    return;
                }
                execution.sent();
            }
        });
        *streamer = Some(task);
    }

    /// Waits until the relay has said CHECKPOINTING for the checkpoint that
    /// killed the execution being streamed ([`Session::checkpoint_said`]),
    /// or [`CHECKPOINT_SAID_WAIT`] at most.
    async fn checkpoint_said(&self) {
        let said = async {
            loop {
                let settled = self.settled.notified();
                tokio::pin!(settled);
                settled.as_mut().enable();
                if self.checkpoint_said.load(Ordering::Acquire)
                    || self.ended.load(Ordering::Acquire)
                {
                    return;
                }
                settled.await;
            }
        };
        let _ = tokio::time::timeout(CHECKPOINT_SAID_WAIT, said).await;
    }

    /// Replays the current execution's undelivered output, then streams it live.
    /// With nothing to replay it sends nothing (upstream hung or closed, bug B5).
    pub(super) fn reconnect(self: &Arc<Self>) {
        let Some(execution) = self.live.execution() else {
            return;
        };
        if !execution.is_running() && !execution.has_undelivered() {
            return;
        }
        let session = Arc::clone(self);
        tokio::spawn(async move {
            session.out.status(Status::ExecutionRunning).await;
            session.stream(execution);
        });
    }
}
