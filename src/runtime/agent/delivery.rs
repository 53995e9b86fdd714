//! The delivery gate of one resumable execution: which of its events reached a
//! client on this host, so a checkpoint that keeps the execution knows where
//! the next host must start (decision 0012).
//!
//! The API asks the gate before it hands a frame to a socket
//! (`begin_delivery`) and tells it after (`end_delivery`). The gate turns the
//! host's event count into the agent's sequence numbers (a restored execution
//! starts at `base`, the last event an earlier host delivered) and
//! acknowledges delivered events to the agent now and then, so the agent's
//! journal stays short. [`DeliveryGate::freeze`] stops all delivery here, waits
//! for a frame on its way to the socket, and returns the last event
//! delivered: the agent drops the journal up to it and keeps the rest, in the
//! image.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use super::connection::AgentConnection;
use super::protocol::Request;

/// Acknowledge to the agent after this many delivered events.
const ACK_EVERY: u64 = 16;
/// How long a freeze waits for a frame on its way to a slow socket.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
struct GateState {
    frozen: bool,
    in_flight: bool,
    /// The agent's number of the last event delivered to a client.
    delivered: u64,
    /// The last number acknowledged to the agent.
    acked: u64,
}

/// One resumable execution's delivery gate.
#[derive(Debug)]
pub struct DeliveryGate {
    exec: String,
    /// The agent's number of the event before this host's first one.
    base: u64,
    agent: Arc<AgentConnection>,
    state: Mutex<GateState>,
    idle: Notify,
}

impl DeliveryGate {
    /// A gate for execution `exec`, whose events on this host start after the
    /// agent's event `base` (0 for a new execution).
    pub fn new(exec: String, base: u64, agent: Arc<AgentConnection>) -> Arc<Self> {
        Arc::new(Self {
            exec,
            base,
            agent,
            state: Mutex::new(GateState {
                delivered: base,
                acked: base,
                ..GateState::default()
            }),
            idle: Notify::new(),
        })
    }

    pub fn exec(&self) -> &str {
        &self.exec
    }

    /// The agent's number for this host's `event`-th event.
    pub fn seq(&self, event: u64) -> u64 {
        self.base + event
    }

    fn state(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// See `ExecControl::begin_delivery`.
    pub fn begin(&self) -> bool {
        let mut state = self.state();
        if state.frozen {
            return false;
        }
        state.in_flight = true;
        true
    }

    /// See `ExecControl::end_delivery`.
    pub fn end(&self, event: u64, delivered: bool) {
        let ack = {
            let mut state = self.state();
            let was_in_flight = std::mem::take(&mut state.in_flight);
            // Once frozen only the frame that was on its way still counts.
            if delivered && event > 0 && (!state.frozen || was_in_flight) {
                state.delivered = state.delivered.max(self.seq(event));
            }
            Self::ack_due(&mut state)
        };
        self.idle.notify_waiters();
        self.send_ack(ack);
    }

    /// See `ExecControl::dropped`: counts as delivered (never to be sent).
    pub fn dropped(&self, event: u64) {
        let ack = {
            let mut state = self.state();
            if !state.frozen && event > 0 {
                state.delivered = state.delivered.max(self.seq(event));
            }
            Self::ack_due(&mut state)
        };
        self.send_ack(ack);
    }

    /// The number to acknowledge now, if enough was delivered since the last.
    fn ack_due(state: &mut GateState) -> Option<u64> {
        let due = !state.frozen && state.delivered >= state.acked + ACK_EVERY;
        if due {
            state.acked = state.delivered;
        }
        due.then_some(state.delivered)
    }

    fn send_ack(&self, ack: Option<u64>) {
        if let Some(seq) = ack {
            // Best effort: a lost ack only keeps the journal longer.
            let _ = self.agent.send_now(
                &Request::Ack {
                    exec: self.exec.clone(),
                    seq,
                }
                .without_id(),
            );
        }
    }

    /// Stops delivery here and returns the agent's number of the last event
    /// a client got.
    pub async fn freeze(&self) -> u64 {
        self.state().frozen = true;
        #[allow(
            clippy::disallowed_methods,
            reason = "waits on runsc and the store on this host for a bounded time (tokio's clock, which a paused runtime moves); no simulation runs the gVisor runtime"
        )]
        let deadline = tokio::time::Instant::now() + IN_FLIGHT_WAIT;
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            {
                let state = self.state();
                if !state.in_flight {
                    return state.delivered;
                }
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                let state = self.state();
                tracing::warn!(execution = %self.exec, "a frame was still on its way to a slow client when the execution was checkpointed; it may be delivered twice");
                return state.delivered;
            }
        }
    }

    /// Delivery goes on here (the checkpoint failed).
    pub fn thaw(&self) {
        self.state().frozen = false;
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;

    use tokio::net::unix::pipe;

    use super::*;

    fn gate(base: u64) -> (Arc<DeliveryGate>, std::io::PipeReader, std::io::PipeWriter) {
        let (command_reader, command_writer) = std::io::pipe().unwrap();
        let (event_reader, event_writer) = std::io::pipe().unwrap();
        let commands = pipe::Sender::from_owned_fd(OwnedFd::from(command_writer)).unwrap();
        let events = pipe::Receiver::from_owned_fd(OwnedFd::from(event_reader)).unwrap();
        let (agent, _hello) = AgentConnection::start(commands, events);
        (
            DeliveryGate::new("e1".to_owned(), base, agent),
            command_reader,
            event_writer,
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_freeze_returns_the_last_delivered_event_and_stops_delivery() {
        let (gate, _commands, _events) = gate(40);
        for event in 1..=3 {
            assert!(gate.begin());
            gate.end(event, true);
        }
        // Event 4 was dropped before delivery: it does not count as delivered
        // once frozen, but an in-flight one does.
        assert!(gate.begin());
        let freezing = {
            let gate = Arc::clone(&gate);
            tokio::spawn(async move { gate.freeze().await })
        };
        // Once the freeze has begun (the gate is frozen), a freeze that did
        // not wait would end within these 50 ms.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !gate.state().frozen && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(gate.state().frozen, "the freeze never began");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !freezing.is_finished(),
            "the freeze did not wait for the frame in flight"
        );
        gate.end(4, true);
        assert_eq!(freezing.await.unwrap(), 44);
        assert!(!gate.begin(), "a frozen gate let a frame through");
        gate.end(5, true);
        assert_eq!(gate.freeze().await, 44, "a frame after the freeze counted");
        gate.thaw();
        assert!(gate.begin());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delivered_events_are_acknowledged_to_the_agent() {
        use std::io::Read as _;
        let (gate, mut commands, _events) = gate(0);
        for event in 1..=ACK_EVERY {
            assert!(gate.begin());
            gate.end(event, true);
        }
        let mut line = [0u8; 256];
        let read = tokio::task::spawn_blocking(move || {
            let n = commands.read(&mut line).unwrap();
            String::from_utf8_lossy(&line[..n]).into_owned()
        })
        .await
        .unwrap();
        let ack: serde_json::Value = serde_json::from_str(read.trim()).unwrap();
        assert_eq!(
            ack,
            serde_json::json!({"op": "ack", "exec": "e1", "seq": ACK_EVERY})
        );
    }
}
