//! The host's end of the agent channel: JSON lines over the init process's
//! stdin and stdout (see `agent.py` for why stdio).
//!
//! One writer (commands, serialised by a mutex) and one reader task that routes
//! each event by its `id`: execution output to that execution's channel, replies
//! to the request waiting for them, archive chunks to their sink. When the agent
//! goes away (the sandbox stopped or was checkpointed) every waiter is told.
//!
//! The reader never waits on a consumer: every route is an unbounded channel
//! (or a oneshot), so a slow snapshot writer cannot hold up the reply to a
//! `kill` or a `ping`. Output the agent encoded badly is reported, never
//! turned into silence.
//!
//! Events of resumable executions carry the agent's sequence number, routed
//! with them; a suspended execution (checkpointed with its sandbox, to go on
//! elsewhere) is not ended when the agent goes away.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use controllers::runtime::ExecEvent;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the sandbox agent is gone")]
    Gone,
    #[error("the sandbox agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the sandbox agent refused: {0}")]
    Refused(String),
    #[error("cannot talk to the sandbox agent: {0}")]
    Io(#[from] std::io::Error),
}

/// An execution's event and the agent's number for it (0: not numbered,
/// the execution is not resumable).
pub type Sequenced = (u64, ExecEvent);

#[derive(Default)]
struct Routes {
    replies: HashMap<String, oneshot::Sender<Result<Value, String>>>,
    /// Unbounded on purpose: the reader must never wait on one slow consumer,
    /// or replies (kill, ping, checkpoint) would queue behind its output. The
    /// consumers (API sessions) bound what they keep.
    execs: HashMap<String, mpsc::UnboundedSender<Sequenced>>,
    /// Executions checkpointed with the sandbox: when the agent goes away
    /// their streams end without an exit (they go on elsewhere).
    suspended: HashSet<String>,
    /// Unbounded for the same reason; the consumer writes to local disk,
    /// which keeps up with what the agent can tar and encode.
    chunks: HashMap<String, mpsc::UnboundedSender<Bytes>>,
    gone: bool,
}

/// A connection to one sandbox's agent.
pub struct AgentConnection {
    /// Whole command lines for the writer task: queuing a line cannot be
    /// interrupted half-way, so a cancelled caller never corrupts the stream.
    lines: mpsc::UnboundedSender<Vec<u8>>,
    routes: Arc<Mutex<Routes>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Makes this connection's ids differ from those of earlier connections
    /// to the same agent (a restored agent may still journal `e1`).
    id_tag: String,
}

impl std::fmt::Debug for AgentConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConnection").finish_non_exhaustive()
    }
}

impl AgentConnection {
    /// Starts routing events read from `events`; commands go to `commands`.
    /// The returned receiver gets the agent's `hello` (sent once at boot).
    pub fn start(
        commands: pipe::Sender,
        events: pipe::Receiver,
    ) -> (Arc<Self>, oneshot::Receiver<Value>) {
        Self::start_tagged(commands, events, format!("{:08x}-", rand::random::<u32>()))
    }

    /// [`Self::start`] with the given id tag (the tests want plain ids).
    fn start_tagged(
        commands: pipe::Sender,
        events: pipe::Receiver,
        id_tag: String,
    ) -> (Arc<Self>, oneshot::Receiver<Value>) {
        let routes = Arc::new(Mutex::new(Routes::default()));
        let (hello_tx, hello_rx) = oneshot::channel();
        tokio::spawn(read_events(events, routes.clone(), hello_tx));
        let (lines, queued) = mpsc::unbounded_channel();
        tokio::spawn(write_commands(commands, queued, routes.clone()));
        let connection = Arc::new(Self {
            lines,
            routes,
            next_id: std::sync::atomic::AtomicU64::new(1),
            id_tag,
        });
        (connection, hello_rx)
    }

    /// A fresh request id.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{prefix}{}{n}", self.id_tag)
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn is_gone(&self) -> bool {
        self.routes().gone
    }

    /// Sends one command.
    pub async fn send(&self, command: &Value) -> Result<(), AgentError> {
        self.send_now(command)
    }

    /// Sends one command without waiting (the line is queued for the writer).
    pub fn send_now(&self, command: &Value) -> Result<(), AgentError> {
        if self.is_gone() {
            return Err(AgentError::Gone);
        }
        let mut line = serde_json::to_vec(command).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.lines.send(line).map_err(|_| AgentError::Gone)
    }

    /// Sends a command with `id` and waits for the reply that carries it.
    pub async fn request(&self, command: Value, timeout: Duration) -> Result<Value, AgentError> {
        let id = self.new_id("r");
        self.request_with_id(&id, command, timeout).await
    }

    /// Like [`Self::request`], under an id the caller chose (and may have used
    /// for earlier commands of the same operation).
    pub async fn request_with_id(
        &self,
        id: &str,
        mut command: Value,
        timeout: Duration,
    ) -> Result<Value, AgentError> {
        command["id"] = json!(id);
        let reply = self.expect_reply(id)?;
        self.send(&command).await?;
        let outcome = wait_reply(reply, timeout).await;
        if matches!(outcome, Err(AgentError::Timeout(_))) {
            // A reply that never came must not keep its route forever.
            self.routes().replies.remove(id);
        }
        outcome
    }

    fn expect_reply(
        &self,
        id: &str,
    ) -> Result<oneshot::Receiver<Result<Value, String>>, AgentError> {
        let (tx, rx) = oneshot::channel();
        let mut routes = self.routes();
        if routes.gone {
            return Err(AgentError::Gone);
        }
        routes.replies.insert(id.to_owned(), tx);
        Ok(rx)
    }

    /// Starts an execution; returns its event stream once the agent started it.
    pub async fn start_exec(
        &self,
        id: &str,
        mut command: Value,
    ) -> Result<mpsc::UnboundedReceiver<Sequenced>, AgentError> {
        command["id"] = json!(id);
        let (tx, rx) = mpsc::unbounded_channel();
        let started = self.expect_reply(id)?;
        self.routes().execs.insert(id.to_owned(), tx);
        self.send(&command).await?;
        match wait_reply(started, Duration::from_secs(30)).await {
            Ok(_) => Ok(rx),
            Err(err) => {
                self.routes().execs.remove(id);
                Err(err)
            }
        }
    }

    /// Routes the events of an execution the agent already runs (one a
    /// restore brought back) to the returned stream.
    pub fn adopt_exec(&self, id: &str) -> Result<mpsc::UnboundedReceiver<Sequenced>, AgentError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut routes = self.routes();
        if routes.gone {
            return Err(AgentError::Gone);
        }
        routes.execs.insert(id.to_owned(), tx);
        Ok(rx)
    }

    /// Marks an execution as checkpointed with the sandbox (or, `false`,
    /// no longer): if the agent goes away its stream ends without an exit.
    pub fn suspend(&self, id: &str, suspended: bool) {
        let mut routes = self.routes();
        if suspended {
            routes.suspended.insert(id.to_owned());
        } else {
            routes.suspended.remove(id);
        }
    }

    /// Starts an archive; chunks arrive on the returned stream, then the final
    /// reply (`done` or `error`) on the oneshot.
    pub async fn start_archive(
        &self,
        mut command: Value,
    ) -> Result<
        (
            mpsc::UnboundedReceiver<Bytes>,
            oneshot::Receiver<Result<Value, String>>,
        ),
        AgentError,
    > {
        let id = self.new_id("a");
        command["id"] = json!(id);
        let (tx, rx) = mpsc::unbounded_channel();
        let done = self.expect_reply(&id)?;
        self.routes().chunks.insert(id.clone(), tx);
        self.send(&command).await?;
        Ok((rx, done))
    }
}

async fn wait_reply(
    reply: oneshot::Receiver<Result<Value, String>>,
    timeout: Duration,
) -> Result<Value, AgentError> {
    match tokio::time::timeout(timeout, reply).await {
        Ok(Ok(Ok(value))) => Ok(value),
        Ok(Ok(Err(message))) => Err(AgentError::Refused(message)),
        Ok(Err(_)) => Err(AgentError::Gone),
        Err(_) => Err(AgentError::Timeout(timeout)),
    }
}

/// Reads the agent's events until it goes away, routing each.
async fn read_events(
    events: pipe::Receiver,
    routes: Arc<Mutex<Routes>>,
    hello: oneshot::Sender<Value>,
) {
    let mut hello = Some(hello);
    let mut lines = BufReader::with_capacity(256 * 1024, events).lines();
    loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(err) => {
                tracing::warn!(%err, "reading from the sandbox agent failed");
                break;
            }
        };
        let event: Value = match serde_json::from_str(&line) {
            Ok(event) => event,
            Err(err) => {
                tracing::warn!(%err, line = %line.chars().take(200).collect::<String>(), "unreadable agent event");
                continue;
            }
        };
        route(&routes, &mut hello, event);
    }
    // The agent is gone: release every waiter. Executions still running end
    // as killed (the sandbox stopped under them).
    let execs = {
        let mut routes = routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes.gone = true;
        routes.replies.clear();
        routes.chunks.clear();
        let suspended = std::mem::take(&mut routes.suspended);
        let mut execs = std::mem::take(&mut routes.execs);
        execs.retain(|id, _| !suspended.contains(id));
        execs
    };
    for (_, exec) in execs {
        let _ = exec.send((0, ExecEvent::Exited(137)));
    }
}

/// Writes queued command lines to the agent, in order, until it goes away.
async fn write_commands(
    mut commands: pipe::Sender,
    mut queued: mpsc::UnboundedReceiver<Vec<u8>>,
    routes: Arc<Mutex<Routes>>,
) {
    while let Some(line) = queued.recv().await {
        if let Err(err) = commands.write_all(&line).await {
            if err.kind() != std::io::ErrorKind::BrokenPipe {
                tracing::warn!(%err, "writing to the sandbox agent failed");
            }
            routes.lock().unwrap_or_else(PoisonError::into_inner).gone = true;
            return;
        }
    }
}

/// Routes one event. Never waits: the reader's only loop runs through here.
fn route(routes: &Mutex<Routes>, hello: &mut Option<oneshot::Sender<Value>>, event: Value) {
    let kind = event["ev"].as_str().unwrap_or_default().to_owned();
    let id = event["id"].as_str().unwrap_or_default().to_owned();
    let lock = || routes.lock().unwrap_or_else(PoisonError::into_inner);
    match kind.as_str() {
        "hello" => {
            if let Some(hello) = hello.take() {
                let _ = hello.send(event);
            }
        }
        "out" => {
            let sender = lock().execs.get(&id).cloned();
            if let Some(sender) = sender {
                let item = match decode(&event) {
                    Ok(data) if event["fd"] == 2 => ExecEvent::Stderr(data),
                    Ok(data) => ExecEvent::Stdout(data),
                    Err(err) => {
                        tracing::warn!(%err, execution = %id, "unreadable output from the sandbox agent");
                        ExecEvent::Stderr(Bytes::from(format!(
                            "[sandboxd] output lost: the sandbox agent sent it unreadable ({err})\n"
                        )))
                    }
                };
                let _ = sender.send((seq_of(&event), item));
            }
        }
        "exit" => {
            let sender = lock().execs.remove(&id);
            if let Some(sender) = sender {
                let code = event["code"]
                    .as_i64()
                    .and_then(|c| i32::try_from(c).ok())
                    .unwrap_or(-1);
                let _ = sender.send((seq_of(&event), ExecEvent::Exited(code)));
            }
        }
        "chunk" => match decode(&event) {
            Ok(data) => {
                let sender = lock().chunks.get(&id).cloned();
                if let Some(sender) = sender {
                    let _ = sender.send(data);
                }
            }
            Err(err) => {
                // A hole in an archive: fail it rather than store it.
                let mut routes = lock();
                routes.chunks.remove(&id);
                if let Some(reply) = routes.replies.remove(&id) {
                    let _ = reply.send(Err(format!(
                        "the sandbox agent sent an unreadable archive chunk ({err})"
                    )));
                }
            }
        },
        "error" => {
            let message = event["message"]
                .as_str()
                .unwrap_or("unknown error")
                .to_owned();
            let mut routes = lock();
            routes.execs.remove(&id);
            routes.chunks.remove(&id);
            match routes.replies.remove(&id) {
                Some(reply) => {
                    let _ = reply.send(Err(message));
                }
                None => tracing::warn!(%message, "sandbox agent error"),
            }
        }
        _ => {
            // started, pong, ready, done: the reply to a request.
            let mut routes = lock();
            if kind == "done" {
                routes.chunks.remove(&id);
            }
            if let Some(reply) = routes.replies.remove(&id) {
                let _ = reply.send(Ok(event));
            }
        }
    }
}

fn seq_of(event: &Value) -> u64 {
    event["seq"].as_u64().unwrap_or(0)
}

/// Why an event's `data` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("no `data` string")]
    Missing,
    #[error("invalid base64: {0}")]
    Base64(#[from] base64::DecodeError),
}

fn decode(event: &Value) -> Result<Bytes, DataError> {
    let text = event["data"].as_str().ok_or(DataError::Missing)?;
    Ok(Bytes::from(BASE64.decode(text)?))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::os::fd::OwnedFd;

    use super::*;

    /// A connection whose agent end the test plays: it writes events to the
    /// returned file and may read commands from the returned pipe.
    fn connect() -> (Arc<AgentConnection>, std::fs::File, std::io::PipeReader) {
        let (command_reader, command_writer) = std::io::pipe().unwrap();
        let (event_reader, event_writer) = std::io::pipe().unwrap();
        let commands = pipe::Sender::from_owned_fd(OwnedFd::from(command_writer)).unwrap();
        let events = pipe::Receiver::from_owned_fd(OwnedFd::from(event_reader)).unwrap();
        let (connection, _hello) = AgentConnection::start_tagged(commands, events, String::new());
        (
            connection,
            std::fs::File::from(OwnedFd::from(event_writer)),
            command_reader,
        )
    }

    fn emit(agent: &mut std::fs::File, event: &Value) {
        let mut line = serde_json::to_vec(event).unwrap();
        line.push(b'\n');
        agent.write_all(&line).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_archive_consumer_does_not_stall_replies() {
        let (connection, mut agent, _commands) = connect();
        // Nobody reads the archive's chunks (a slow snapshot writer).
        let (_chunks, _done) = connection
            .start_archive(json!({"op": "archive"}))
            .await
            .unwrap();
        for _ in 0..500 {
            emit(
                &mut agent,
                &json!({"ev": "chunk", "id": "a1", "data": "eA=="}),
            );
        }
        emit(&mut agent, &json!({"ev": "pong", "id": "r2"}));
        let reply = connection
            .request(json!({"op": "ping"}), Duration::from_secs(5))
            .await;
        assert!(
            reply.is_ok(),
            "the ping's reply queued behind unread archive chunks: {reply:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_base64_output_is_reported_not_silently_empty() {
        let (connection, mut agent, _commands) = connect();
        emit(&mut agent, &json!({"ev": "started", "id": "e1"}));
        let mut events = connection
            .start_exec("e1", json!({"op": "exec"}))
            .await
            .unwrap();
        emit(
            &mut agent,
            &json!({"ev": "out", "id": "e1", "fd": 1, "data": "not base64!"}),
        );
        emit(&mut agent, &json!({"ev": "exit", "id": "e1", "code": 0}));
        let (_, first) = events.recv().await.unwrap();
        let ExecEvent::Stderr(notice) = first else {
            panic!("bad output became {first:?}, not a reported loss");
        };
        let notice = String::from_utf8_lossy(&notice).into_owned();
        assert!(notice.contains("output lost"), "{notice}");
        assert!(matches!(
            events.recv().await,
            Some((0, ExecEvent::Exited(0)))
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_suspended_execution_is_not_ended_when_the_agent_goes_away() {
        let (connection, mut agent, _commands) = connect();
        let mut kept = connection.adopt_exec("kept").unwrap();
        let mut other = connection.adopt_exec("other").unwrap();
        emit(
            &mut agent,
            &json!({"ev": "out", "id": "kept", "fd": 1, "data": "eA==", "seq": 7}),
        );
        assert_eq!(
            kept.recv().await,
            Some((7, ExecEvent::Stdout(Bytes::from_static(b"x")))),
            "the agent's sequence number travels with the event"
        );
        connection.suspend("kept", true);
        drop(agent); // the sandbox was checkpointed: the agent's stdout ends
        assert_eq!(
            kept.recv().await,
            None,
            "a kept execution must end without an exit here"
        );
        assert_eq!(other.recv().await, Some((0, ExecEvent::Exited(137))));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_archive_chunk_fails_the_archive() {
        let (connection, mut agent, _commands) = connect();
        let (_chunks, done) = connection
            .start_archive(json!({"op": "archive"}))
            .await
            .unwrap();
        emit(
            &mut agent,
            &json!({"ev": "chunk", "id": "a1", "data": "%%%"}),
        );
        emit(&mut agent, &json!({"ev": "done", "id": "a1"}));
        let outcome = done.await.unwrap();
        assert!(
            outcome.as_ref().is_err_and(|m| m.contains("unreadable")),
            "{outcome:?}"
        );
    }
}
