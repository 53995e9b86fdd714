//! The host's end of the agent channel: JSON lines over the init process's
//! stdin and stdout (see `sandbox_agent/__init__.py` for why stdio), each a
//! message of [`super::agent_protocol`].
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use controllers::runtime::ExecEvent;
use serde::de::DeserializeOwned;

use super::agent_lines::{AgentLine, MAX_AGENT_LINE_BYTES, next_line};
use super::agent_protocol::{AGENT_PROTOCOL_VERSION, Command, Event, MalformedReply, Request};
use tokio::io::{AsyncWriteExt, BufReader};
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
    #[error(transparent)]
    Malformed(#[from] MalformedReply),
    #[error("the sandbox agent speaks protocol version {agent}; this host speaks version {host}")]
    Version { agent: u32, host: u32 },
}

/// Refuses an agent that speaks another protocol version than this host.
pub fn check_version(agent: u32) -> Result<(), AgentError> {
    if agent == AGENT_PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(AgentError::Version {
            agent,
            host: AGENT_PROTOCOL_VERSION,
        })
    }
}

/// What a waiter gets: the reply event, or the agent's error message.
type Reply = Result<Event, String>;

/// An execution's event and the agent's number for it (0: not numbered,
/// the execution is not resumable).
pub type Sequenced = (u64, ExecEvent);

/// Output bytes one execution may have waiting between the reader and its
/// consumer. Beyond it the reader (which never waits) drops output: the first
/// dropped event becomes a notice on stderr, the others empty events of the
/// same number, so a resumable execution's numbering holds (issue 25: a
/// consumer that stalled, such as a slow `/execute` client, let this grow
/// without bound).
pub const MAX_QUEUED_OUTPUT_BYTES: usize = 8 << 20;

/// One execution's route: its channel and the output bytes in it.
struct ExecRoute {
    sender: mpsc::UnboundedSender<Sequenced>,
    queued: Arc<AtomicUsize>,
    /// Output is being dropped (the notice was sent).
    dropping: bool,
}

impl ExecRoute {
    fn new() -> (Self, ExecEvents) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let events = ExecEvents {
            receiver,
            queued: Arc::clone(&queued),
        };
        (
            Self {
                sender,
                queued,
                dropping: false,
            },
            events,
        )
    }

    /// Queues output, or drops it past [`MAX_QUEUED_OUTPUT_BYTES`].
    fn output(&mut self, seq: u64, stderr: bool, data: Bytes) {
        let queued = self.queued.load(Ordering::Acquire);
        let data = if queued.saturating_add(data.len()) <= MAX_QUEUED_OUTPUT_BYTES {
            self.dropping = false;
            data
        } else if std::mem::replace(&mut self.dropping, true) {
            Bytes::new()
        } else {
            let notice = Bytes::from(format!(
                "\n[sandboxd] output dropped: more than {MAX_QUEUED_OUTPUT_BYTES} bytes were \
                 waiting for a reader that fell behind\n"
            ));
            let _ = self.sender.send((seq, ExecEvent::Stderr(notice.clone())));
            self.queued.fetch_add(notice.len(), Ordering::AcqRel);
            return;
        };
        self.queued.fetch_add(data.len(), Ordering::AcqRel);
        let event = if stderr {
            ExecEvent::Stderr(data)
        } else {
            ExecEvent::Stdout(data)
        };
        let _ = self.sender.send((seq, event));
    }
}

/// The event stream of one execution, as the agent's reader routes it.
#[derive(Debug)]
pub struct ExecEvents {
    receiver: mpsc::UnboundedReceiver<Sequenced>,
    queued: Arc<AtomicUsize>,
}

impl ExecEvents {
    /// The next event; `None` once the execution's route is gone.
    pub async fn recv(&mut self) -> Option<Sequenced> {
        let item = self.receiver.recv().await?;
        if let (_, ExecEvent::Stdout(data) | ExecEvent::Stderr(data)) = &item {
            self.queued.fetch_sub(data.len(), Ordering::AcqRel);
        }
        Some(item)
    }
}

#[derive(Default)]
struct Routes {
    replies: HashMap<String, oneshot::Sender<Reply>>,
    /// Unbounded on purpose: the reader must never wait on one slow consumer,
    /// or replies (kill, ping, checkpoint) would queue behind its output. The
    /// consumers (API sessions) bound what they keep.
    execs: HashMap<String, ExecRoute>,
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
    /// The returned receiver gets the protocol version of the agent's `hello`
    /// (sent once at boot).
    pub fn start(
        commands: pipe::Sender,
        events: pipe::Receiver,
    ) -> (Arc<Self>, oneshot::Receiver<u32>) {
        Self::start_tagged(commands, events, format!("{:08x}-", rand::random::<u32>()))
    }

    /// [`Self::start`] with the given id tag (the tests want plain ids).
    fn start_tagged(
        commands: pipe::Sender,
        events: pipe::Receiver,
        id_tag: String,
    ) -> (Arc<Self>, oneshot::Receiver<u32>) {
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
    pub async fn send(&self, command: &Command) -> Result<(), AgentError> {
        self.send_now(command)
    }

    /// Sends one command without waiting (the line is queued for the writer).
    pub fn send_now(&self, command: &Command) -> Result<(), AgentError> {
        if self.is_gone() {
            return Err(AgentError::Gone);
        }
        let mut line = serde_json::to_vec(command).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.lines.send(line).map_err(|_| AgentError::Gone)
    }

    /// Sends a request under a fresh id and waits for the reply that carries it.
    pub async fn request(&self, request: Request, timeout: Duration) -> Result<Event, AgentError> {
        let id = self.new_id("r");
        self.request_with_id(&id, request, timeout).await
    }

    /// [`Self::request`], the reply read as `T` (the request's reply type in
    /// [`super::agent_protocol`]).
    pub async fn ask<T: DeserializeOwned>(
        &self,
        request: Request,
        timeout: Duration,
    ) -> Result<T, AgentError> {
        Ok(self.request(request, timeout).await?.reply()?)
    }

    /// Like [`Self::request`], under an id the caller chose (and may have used
    /// for earlier commands of the same operation).
    pub async fn request_with_id(
        &self,
        id: &str,
        request: Request,
        timeout: Duration,
    ) -> Result<Event, AgentError> {
        let reply = self.expect_reply(id)?;
        self.send(&request.with_id(id)).await?;
        let outcome = wait_reply(reply, timeout).await;
        if matches!(outcome, Err(AgentError::Timeout(_))) {
            // A reply that never came must not keep its route forever.
            self.routes().replies.remove(id);
        }
        outcome
    }

    fn expect_reply(&self, id: &str) -> Result<oneshot::Receiver<Reply>, AgentError> {
        let (tx, rx) = oneshot::channel();
        let mut routes = self.routes();
        if routes.gone {
            return Err(AgentError::Gone);
        }
        routes.replies.insert(id.to_owned(), tx);
        Ok(rx)
    }

    /// Starts an execution; returns its event stream once the agent started it.
    pub async fn start_exec(&self, id: &str, request: Request) -> Result<ExecEvents, AgentError> {
        let (route, rx) = ExecRoute::new();
        let started = self.expect_reply(id)?;
        self.routes().execs.insert(id.to_owned(), route);
        self.send(&request.with_id(id)).await?;
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
    pub fn adopt_exec(&self, id: &str) -> Result<ExecEvents, AgentError> {
        let (route, rx) = ExecRoute::new();
        let mut routes = self.routes();
        if routes.gone {
            return Err(AgentError::Gone);
        }
        routes.execs.insert(id.to_owned(), route);
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
        request: Request,
    ) -> Result<(mpsc::UnboundedReceiver<Bytes>, oneshot::Receiver<Reply>), AgentError> {
        let id = self.new_id("a");
        let (tx, rx) = mpsc::unbounded_channel();
        let done = self.expect_reply(&id)?;
        self.routes().chunks.insert(id.clone(), tx);
        self.send(&request.with_id(id)).await?;
        Ok((rx, done))
    }
}

async fn wait_reply(
    reply: oneshot::Receiver<Reply>,
    timeout: Duration,
) -> Result<Event, AgentError> {
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
    hello: oneshot::Sender<u32>,
) {
    let mut hello = Some(hello);
    let mut reader = BufReader::with_capacity(256 * 1024, events);
    let mut buffer = Vec::new();
    loop {
        let line = match next_line(&mut reader, &mut buffer, MAX_AGENT_LINE_BYTES).await {
            Ok(AgentLine::Line(line)) => line,
            Ok(AgentLine::End) => break,
            Ok(AgentLine::TooLong(bytes)) => {
                // Bounded memory whatever the sandbox writes (issue 25); the
                // request it answered, if any, times out.
                tracing::warn!(
                    bytes,
                    limit = MAX_AGENT_LINE_BYTES,
                    "skipped an over-long line from the sandbox agent"
                );
                continue;
            }
            Ok(AgentLine::NotUtf8(bytes)) => {
                tracing::warn!(
                    bytes,
                    "skipped a line from the sandbox agent that is not UTF-8"
                );
                continue;
            }
            Err(err) => {
                tracing::warn!(%err, "reading from the sandbox agent failed");
                break;
            }
        };
        match serde_json::from_str::<Event>(&line) {
            Ok(event) => route(&routes, &mut hello, event),
            Err(err) => unreadable(&routes, &line, &err),
        }
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
        let _ = exec.sender.send((0, ExecEvent::Exited(137)));
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

/// An event that is no message of the protocol: its request (if it names
/// one that waits) fails rather than waits for its timeout.
fn unreadable(routes: &Mutex<Routes>, line: &str, err: &serde_json::Error) {
    let id = serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|value| value.get("id")?.as_str().map(str::to_owned));
    let waiting = id.and_then(|id| {
        let mut routes = routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes.chunks.remove(&id);
        routes.replies.remove(&id)
    });
    match waiting {
        Some(reply) => {
            let _ = reply.send(Err(format!(
                "the sandbox agent sent a malformed reply ({err})"
            )));
        }
        None => {
            tracing::warn!(%err, line = %line.chars().take(200).collect::<String>(), "unreadable agent event");
        }
    }
}

/// Routes one event. Never waits: the reader's only loop runs through here.
fn route(routes: &Mutex<Routes>, hello: &mut Option<oneshot::Sender<u32>>, event: Event) {
    let lock = || routes.lock().unwrap_or_else(PoisonError::into_inner);
    match event {
        Event::Hello { version, .. } => {
            if let Some(hello) = hello.take() {
                let _ = hello.send(version);
            }
        }
        Event::Out { id, fd, data, seq } => {
            let (stderr, data) = match decode(data.as_deref()) {
                Ok(data) => (fd == 2, data),
                Err(err) => {
                    tracing::warn!(%err, execution = %id, "unreadable output from the sandbox agent");
                    let notice = format!(
                        "[sandboxd] output lost: the sandbox agent sent it unreadable ({err})\n"
                    );
                    (true, Bytes::from(notice))
                }
            };
            if let Some(route) = lock().execs.get_mut(&id) {
                route.output(seq.unwrap_or(0), stderr, data);
            }
        }
        Event::Exit { id, code, seq } => {
            let route = lock().execs.remove(&id);
            if let Some(route) = route {
                let code = i32::try_from(code).unwrap_or(-1);
                let _ = route
                    .sender
                    .send((seq.unwrap_or(0), ExecEvent::Exited(code)));
            }
        }
        Event::Chunk { id, data } => match decode(data.as_deref()) {
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
        Event::Error { id, message } => {
            let id = id.unwrap_or_default();
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
        reply => {
            // started, pong, ready, journals, resumed, done: the reply to a request.
            let id = reply.id().unwrap_or_default().to_owned();
            let mut routes = lock();
            if matches!(reply, Event::Done { .. }) {
                routes.chunks.remove(&id);
            }
            if let Some(waiter) = routes.replies.remove(&id) {
                let _ = waiter.send(Ok(reply));
            }
        }
    }
}

/// Why an event's `data` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("no `data` string")]
    Missing,
    #[error("invalid base64: {0}")]
    Base64(#[from] base64::DecodeError),
}

fn decode(data: Option<&str>) -> Result<Bytes, DataError> {
    let text = data.ok_or(DataError::Missing)?;
    Ok(Bytes::from(BASE64.decode(text)?))
}

#[cfg(test)]
#[path = "agent_tests.rs"]
mod tests;
