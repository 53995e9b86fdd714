//! The host's end of the agent channel: JSON lines over the init process's
//! stdin and stdout (see `sandbox_agent/__init__.py` for why stdio), each a
//! message of [`super::protocol`], some followed by raw bytes (an
//! agent of version 2 on; see [`AgentConnection::exchange`]).
//!
//! One writer task (commands, in the order queued; a terminal's size as it
//! is when its turn comes, [`LatestCommand`]) and one reader task that routes
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

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use controllers::runtime::ExecEvent;
use serde::de::DeserializeOwned;

use super::routes::{ExecEvents, ExecRoute, Reply, Routes, StdinWindow};

use super::lines::{
    AgentLine, MAX_AGENT_LINE_BYTES, MAX_AGENT_LINE_VALUES, MAX_AGENT_PAYLOAD_BYTES, Payload,
    json_values, named_id, next_line, payload_length, read_payload,
};
use super::protocol::{
    AGENT_PROTOCOL_VERSION, Command, Event, MalformedReply, OLDEST_AGENT_PROTOCOL_VERSION,
    RAW_BYTES_VERSION, Request,
};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

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
    #[error(
        "the sandbox agent speaks protocol version {agent}; this host speaks versions \
         {OLDEST_AGENT_PROTOCOL_VERSION} to {host}"
    )]
    Version { agent: u32, host: u32 },
}

/// Refuses an agent whose protocol version this host does not speak; the
/// version, if it does.
pub fn check_version(agent: u32) -> Result<u32, AgentError> {
    if (OLDEST_AGENT_PROTOCOL_VERSION..=AGENT_PROTOCOL_VERSION).contains(&agent) {
        Ok(agent)
    } else {
        Err(AgentError::Version {
            agent,
            host: AGENT_PROTOCOL_VERSION,
        })
    }
}

/// The most bytes of commands queued for the agent's pipe at once. A
/// sender past it waits for the writer (a client's stdin then holds its
/// socket back), so an agent that reads slowly, or not at all while it is
/// frozen, never makes the host hold what a client sends.
pub const MAX_QUEUED_COMMAND_BYTES: usize = 8 << 20;

/// The most bytes of control commands (a kill, a stdin close) queued at
/// once. They never wait behind a client's stdin, so a kill returns at once
/// even while the agent reads nothing; past this they are refused (a flood
/// of them while the agent is frozen holds nothing). A resize has no share
/// of it: it is a [`LatestCommand`].
pub const MAX_QUEUED_CONTROL_BYTES: usize = 64 << 10;

/// The most stdin this host sends ahead of what a program read: the agent's
/// own bound on input waiting for a program (`MAX_STDIN_PENDING`), so an
/// agent that grants the window never drops input.
pub const STDIN_WINDOW_BYTES: u64 = 8 << 20;

/// What the writer task takes in turn.
enum Framed {
    /// A command line and the raw bytes that follow it, with their share of
    /// [`MAX_QUEUED_COMMAND_BYTES`] or [`MAX_QUEUED_CONTROL_BYTES`] (none for
    /// a delivery's acknowledgement), given back once written.
    Line(Vec<u8>, Bytes, Option<OwnedSemaphorePermit>),
    /// The turn of a [`LatestCommand`]: its line as it is when written.
    Latest(Arc<LatestCommand>),
}

/// A command of which only the latest matters (a terminal's size). A newer
/// one replaces the one not yet written, in its place in the queue, so a
/// burst of them queues one line at a time, never refuses one, and the last
/// always reaches the agent.
#[derive(Debug, Default)]
pub struct LatestCommand(Mutex<Option<Vec<u8>>>);

impl LatestCommand {
    /// Puts `line` in; true if no earlier line was waiting (it needs a turn).
    fn replace(&self, line: Vec<u8>) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(line)
            .is_none()
    }

    fn take(&self) -> Option<Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// A connection to one sandbox's agent.
pub struct AgentConnection {
    /// Whole command lines for the writer task: queuing a line cannot be
    /// interrupted half-way, so a cancelled caller never corrupts the stream.
    lines: mpsc::UnboundedSender<Framed>,
    /// What is left of [`MAX_QUEUED_COMMAND_BYTES`].
    queued_bytes: Arc<Semaphore>,
    /// What is left of [`MAX_QUEUED_CONTROL_BYTES`].
    queued_control: Arc<Semaphore>,
    routes: Arc<Mutex<Routes>>,
    /// The agent's protocol version, once its `hello` or `pong` told it
    /// (0 until then: nothing version-2 is sent).
    version: std::sync::atomic::AtomicU32,
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
            queued_bytes: Arc::new(Semaphore::new(MAX_QUEUED_COMMAND_BYTES)),
            queued_control: Arc::new(Semaphore::new(MAX_QUEUED_CONTROL_BYTES)),
            routes,
            version: std::sync::atomic::AtomicU32::new(0),
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

    /// Records the agent's protocol version (checked by [`check_version`]).
    pub fn set_version(&self, version: u32) {
        self.version.store(version, Ordering::Release);
    }

    /// The agent's protocol version (0: not known yet).
    pub fn version(&self) -> u32 {
        self.version.load(Ordering::Acquire)
    }

    /// Whether messages may carry raw bytes to and from this agent.
    pub fn speaks_raw_bytes(&self) -> bool {
        self.version() >= RAW_BYTES_VERSION
    }

    /// Sends one command, once the queue for the agent has room for it.
    pub async fn send(&self, command: &Command) -> Result<(), AgentError> {
        self.send_framed(command, None).await
    }

    /// Sends a control command (a kill, a stdin close, a resize) without
    /// waiting: it has a budget of its own, [`MAX_QUEUED_CONTROL_BYTES`],
    /// and is refused past it.
    pub fn send_control(&self, command: &Command) -> Result<(), AgentError> {
        if self.is_gone() {
            return Err(AgentError::Gone);
        }
        let mut line = serde_json::to_vec(command).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let share = u32::try_from(line.len()).unwrap_or(u32::MAX);
        let Ok(room) = Arc::clone(&self.queued_control).try_acquire_many_owned(share) else {
            return Err(AgentError::Io(std::io::Error::other(format!(
                "the sandbox agent has not read the last {MAX_QUEUED_CONTROL_BYTES} bytes of control commands"
            ))));
        };
        self.lines
            .send(Framed::Line(line, Bytes::new(), Some(room)))
            .map_err(|_| AgentError::Gone)
    }

    /// Sends `command` through `slot`: it replaces the slot's command if
    /// that is not written yet, else it queues a turn for it. Never waits.
    pub fn send_latest(
        &self,
        slot: &Arc<LatestCommand>,
        command: &Command,
    ) -> Result<(), AgentError> {
        if self.is_gone() {
            return Err(AgentError::Gone);
        }
        let mut line = serde_json::to_vec(command).map_err(std::io::Error::other)?;
        line.push(b'\n');
        if !slot.replace(line) {
            return Ok(());
        }
        self.lines
            .send(Framed::Latest(Arc::clone(slot)))
            .map_err(|_| AgentError::Gone)
    }

    /// Sends bytes for execution `id`'s stdin: once its window (if the agent
    /// granted one) has room for them, then once the queue for the agent
    /// has. So a program that reads slowly holds its client back (through
    /// the session, then TCP) instead of losing input; one that has ended
    /// holds nobody (its window is closed).
    pub async fn send_stdin(&self, id: &str, data: &[u8]) -> Result<(), AgentError> {
        let window = self
            .routes()
            .execs
            .get(id)
            .and_then(|route| route.stdin_window.clone());
        if let Some(window) = window {
            let share = u32::try_from(data.len().min(window.size)).unwrap_or(u32::MAX);
            if let Ok(room) = window.room.acquire_many(share).await {
                // Given back by the agent's `stdin_taken`, not by a drop.
                room.forget();
            }
        }
        self.send(
            &Request::Stdin {
                data: BASE64.encode(data),
            }
            .with_id(id),
        )
        .await
    }

    /// Sends one small command without waiting for room (a delivery's
    /// acknowledgement, never a client's bytes).
    pub fn send_now(&self, command: &Command) -> Result<(), AgentError> {
        if self.is_gone() {
            return Err(AgentError::Gone);
        }
        let mut line = serde_json::to_vec(command).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.lines
            .send(Framed::Line(line, Bytes::new(), None))
            .map_err(|_| AgentError::Gone)
    }

    /// Queues a command and the raw bytes that follow it (announced in its
    /// line's `bytes`), for an agent that speaks them, once the queue has
    /// room for both.
    async fn send_framed(
        &self,
        command: &Command,
        payload: Option<Bytes>,
    ) -> Result<(), AgentError> {
        if self.is_gone() {
            return Err(AgentError::Gone);
        }
        let Some(payload) = payload else {
            let mut line = serde_json::to_vec(command).map_err(std::io::Error::other)?;
            line.push(b'\n');
            let room = self.room_for(line.len()).await;
            return self
                .lines
                .send(Framed::Line(line, Bytes::new(), room))
                .map_err(|_| AgentError::Gone);
        };
        let mut line = {
            if !self.speaks_raw_bytes() {
                return Err(AgentError::Io(std::io::Error::other(format!(
                    "the sandbox agent speaks protocol version {}, which carries no raw bytes",
                    self.version()
                ))));
            }
            serde_json::to_vec(&Command {
                bytes: Some(payload.len() as u64),
                ..command.clone()
            })
        }
        .map_err(std::io::Error::other)?;
        line.push(b'\n');
        let room = self.room_for(line.len() + payload.len()).await;
        self.lines
            .send(Framed::Line(line, payload, room))
            .map_err(|_| AgentError::Gone)
    }

    /// Waits until `bytes` more may be queued (a command larger than the
    /// whole budget waits for all of it); the share is given back once
    /// the writer wrote them. The semaphore is never closed.
    async fn room_for(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let share = u32::try_from(bytes.min(MAX_QUEUED_COMMAND_BYTES)).unwrap_or(u32::MAX);
        Arc::clone(&self.queued_bytes)
            .acquire_many_owned(share)
            .await
            .ok()
    }

    /// Sends a request under a fresh id and waits for the reply that carries it.
    pub async fn request(&self, request: Request, timeout: Duration) -> Result<Event, AgentError> {
        let id = self.new_id("r");
        self.request_with_id(&id, request, timeout).await
    }

    /// [`Self::request`], the reply read as `T` (the request's reply type in
    /// [`super::protocol`]).
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
        self.exchange_with_id(id, request, None, timeout)
            .await
            .map(|(event, _)| event)
    }

    /// Sends a request, followed by `payload` (raw bytes, announced in its
    /// line) if given, and waits for its reply and the raw bytes after it
    /// (empty if none). Raw bytes go only to an agent of version 2 on.
    pub async fn exchange(
        &self,
        request: Request,
        payload: Option<Bytes>,
        timeout: Duration,
    ) -> Result<(Event, Bytes), AgentError> {
        let id = self.new_id("r");
        self.exchange_with_id(&id, request, payload, timeout).await
    }

    async fn exchange_with_id(
        &self,
        id: &str,
        request: Request,
        payload: Option<Bytes>,
        timeout: Duration,
    ) -> Result<(Event, Bytes), AgentError> {
        let reply = self.expect_reply(id)?;
        let command = request.with_id(id);
        // The wait for room in the queue counts in the timeout too.
        let outcome = self
            .sent_then_answered(self.send_framed(&command, payload), reply, timeout)
            .await;
        if outcome.is_err() {
            // A reply that never came must not keep its route forever.
            self.routes().replies.remove(id);
        }
        outcome
    }

    /// `send`, then the reply to it, within `timeout` for both.
    async fn sent_then_answered(
        &self,
        send: impl std::future::Future<Output = Result<(), AgentError>>,
        reply: oneshot::Receiver<Reply>,
        timeout: Duration,
    ) -> Result<(Event, Bytes), AgentError> {
        let answered = async {
            send.await?;
            match reply.await {
                Ok(Ok(value)) => Ok(value),
                Ok(Err(message)) => Err(AgentError::Refused(message)),
                Err(_) => Err(AgentError::Gone),
            }
        };
        tokio::time::timeout(timeout, answered)
            .await
            .unwrap_or(Err(AgentError::Timeout(timeout)))
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
        const START_TIMEOUT: Duration = Duration::from_secs(30);
        let (route, rx) = ExecRoute::new();
        let started = self.expect_reply(id)?;
        self.routes().execs.insert(id.to_owned(), route);
        let asked = match &request {
            Request::Exec { stdin_window, .. } => stdin_window.unwrap_or(0),
            _ => 0,
        };
        let command = request.with_id(id);
        let outcome = self
            .sent_then_answered(self.send(&command), started, START_TIMEOUT)
            .await;
        match outcome {
            Ok((Event::Started { stdin_window, .. }, _)) => {
                // A window the agent granted, never larger than asked for.
                if let Some(granted) = stdin_window
                    && let Some(route) = self.routes().execs.get_mut(id)
                {
                    let size = granted.min(asked);
                    route.stdin_window = Some(StdinWindow::with_room(size, size));
                }
                Ok(rx)
            }
            Ok(_) => Ok(rx),
            Err(err) => {
                let mut routes = self.routes();
                routes.execs.remove(id);
                routes.replies.remove(id);
                Err(err)
            }
        }
    }

    /// Routes the events of an execution the agent already runs (one a
    /// restore brought back) to the returned stream; with the stdin window
    /// it had (its size and the room left in it, as the agent's journal
    /// says), at most the window this host asks for.
    pub fn adopt_exec(
        &self,
        id: &str,
        stdin_window: Option<(u64, u64)>,
    ) -> Result<ExecEvents, AgentError> {
        let (mut route, rx) = ExecRoute::new();
        route.stdin_window = stdin_window
            .map(|(size, room)| StdinWindow::with_room(size.min(STDIN_WINDOW_BYTES), room));
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
                // Bounded memory whatever the sandbox writes (docs/security.md); the
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
        let payload = match payload_length(&line) {
            None => Bytes::new(),
            Some(length) => {
                match read_payload(&mut reader, length, MAX_AGENT_PAYLOAD_BYTES).await {
                    Ok(Payload::Bytes(payload)) => payload,
                    Ok(Payload::TooLong(bytes)) => {
                        tracing::warn!(
                            bytes,
                            limit = MAX_AGENT_PAYLOAD_BYTES,
                            "skipped over-long raw bytes from the sandbox agent"
                        );
                        fail_request(&routes, &line, "more raw bytes than a reply may carry");
                        continue;
                    }
                    Err(err) => {
                        tracing::warn!(%err, "reading from the sandbox agent failed");
                        break;
                    }
                }
            }
        };
        // What parsing it would cost the host, not its bytes, is the bound
        // here (docs/security.md). A line holds fewer values than bytes, so
        // the lines of every day (output chunks) are not scanned.
        if line.len() > MAX_AGENT_LINE_VALUES
            && let values = json_values(&line)
            && values > MAX_AGENT_LINE_VALUES
        {
            tracing::warn!(
                values,
                limit = MAX_AGENT_LINE_VALUES,
                "skipped a line from the sandbox agent holding too many values"
            );
            fail_request(
                &routes,
                &line,
                "the sandbox agent sent a reply of too many values",
            );
            continue;
        }
        match serde_json::from_str::<Event>(&line) {
            Ok(event) => route(&routes, &mut hello, event, payload),
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
    mut queued: mpsc::UnboundedReceiver<Framed>,
    routes: Arc<Mutex<Routes>>,
) {
    while let Some(framed) = queued.recv().await {
        let (line, payload, room) = match framed {
            Framed::Line(line, payload, room) => (line, payload, room),
            Framed::Latest(slot) => match slot.take() {
                Some(line) => (line, Bytes::new(), None),
                None => continue,
            },
        };
        let mut written = commands.write_all(&line).await;
        if written.is_ok() && !payload.is_empty() {
            written = commands.write_all(&payload).await;
        }
        drop(room);
        if let Err(err) = written {
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
    let problem = format!("the sandbox agent sent a malformed reply ({err})");
    if !fail_request(routes, line, &problem) {
        tracing::warn!(%err, line = %line.chars().take(200).collect::<String>(), "unreadable agent event");
    }
}

/// Fails the request the event `line` names (if one waits) with `problem`;
/// whether one did.
fn fail_request(routes: &Mutex<Routes>, line: &str, problem: &str) -> bool {
    let waiting = named_id(line).and_then(|id| {
        let mut routes = routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes.chunks.remove(&id);
        routes.replies.remove(&id)
    });
    match waiting {
        Some(reply) => {
            let _ = reply.send(Err(problem.to_owned()));
            true
        }
        None => false,
    }
}

/// Routes one event. Never waits: the reader's only loop runs through here.
fn route(
    routes: &Mutex<Routes>,
    hello: &mut Option<oneshot::Sender<u32>>,
    event: Event,
    payload: Bytes,
) {
    let lock = || routes.lock().unwrap_or_else(PoisonError::into_inner);
    match event {
        Event::Hello { version, .. } => {
            if let Some(hello) = hello.take() {
                let _ = hello.send(version);
            }
        }
        Event::Out { id, fd, data, seq } => {
            let (fd, data) = match decode(data.as_deref()) {
                Ok(data) => (fd, data),
                Err(err) => {
                    tracing::warn!(%err, execution = %id, "unreadable output from the sandbox agent");
                    let notice = format!(
                        "[sandboxd] output lost: the sandbox agent sent it unreadable ({err})\n"
                    );
                    (2, Bytes::from(notice))
                }
            };
            if let Some(route) = lock().execs.get_mut(&id) {
                route.output(seq.unwrap_or(0), fd, data);
            }
        }
        Event::StdinTaken { id, count } => {
            if let Some(window) = lock()
                .execs
                .get(&id)
                .and_then(|route| route.stdin_window.as_ref())
            {
                window.taken(count);
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
                let _ = waiter.send(Ok((reply, payload)));
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
#[path = "connection_tests.rs"]
mod tests;
