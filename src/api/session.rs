//! An attached WebSocket session: reads client frames and answers them, and
//! relays what the controller does to the sandbox. Everything that changes the
//! sandbox's lifecycle (checkpoint, kill, idle expiry) is written as an intent;
//! the controller's progress events then become the status frames the clients
//! expect.
//!
//! Frames take effect in the order they arrived: one worker per socket handles
//! them one after another (stdin is never reordered, a checkpoint sent before
//! an execution is taken before it runs). Only the control frames that must act
//! while an execution streams (`kill_process`, `kill_sandbox`, `reconnect`)
//! bypass the queue and act at once. Upstream handled each frame in its own
//! task, which reordered a burst of stdin frames.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use controllers::api::{DesiredState, RESOURCE_NAME_RULE, SandboxId, is_resource_name};
use controllers::runtime::{Command, ExecRequest};
use controllers::sandboxes::{Operation, Progress, SandboxController};
use futures::stream::SplitStream;
use futures::{SinkExt, StreamExt};
use tokio::sync::{Notify, broadcast, mpsc};
use tokio::task::JoinHandle;

use super::live::{LiveSandbox, LiveSandboxes};
use super::output::ExecutionState;
use super::protocol::{ClientFrame, FrameError, Language, MAX_FRAME_BYTES, ServerFrame, Status};
use super::state::Features;

/// Close codes (upstream-wire-contract §2.4).
pub const CLOSE_NORMAL: u16 = 1000;
/// RFC 6455: a message too big to process.
pub const CLOSE_TOO_BIG: u16 = 1009;
pub const CLOSE_UNAVAILABLE: u16 = 1011;
pub const CLOSE_FATAL: u16 = 4000;

/// What the writer task sends.
#[derive(Debug)]
pub enum Outgoing {
    Frame(ServerFrame),
    Close(u16, String),
}

/// How often a streamer held back by a checkpoint that keeps the execution
/// looks again (the checkpoint may fail and delivery go on here).
const FROZEN_POLL: Duration = Duration::from_millis(100);

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

/// Client frames waiting for the session's worker, in arrival order.
const QUEUED_FRAMES: usize = 1024;

/// How long a socket closed for a too-big frame is still drained, so the
/// client reads the close frame instead of a reset connection.
const DRAIN_AFTER_CLOSE: Duration = Duration::from_secs(2);

/// The sending half of a socket, shared by the tasks of one session.
#[derive(Debug, Clone)]
pub struct Out {
    sender: mpsc::Sender<Outgoing>,
    closed: Arc<Notify>,
    closing: Arc<AtomicBool>,
}

impl Out {
    /// Spawns the writer task for `socket`'s sending half.
    pub fn spawn(socket: WebSocket) -> (Self, SplitStream<WebSocket>) {
        let (mut sink, stream) = socket.split();
        let (sender, mut receiver) = mpsc::channel::<Outgoing>(256);
        let closed = Arc::new(Notify::new());
        let out = Self {
            sender,
            closed: Arc::clone(&closed),
            closing: Arc::new(AtomicBool::new(false)),
        };
        tokio::spawn(async move {
            while let Some(outgoing) = receiver.recv().await {
                match outgoing {
                    Outgoing::Frame(frame) => {
                        if sink
                            .send(Message::Text(Utf8Bytes::from(frame.to_text())))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                    Outgoing::Close(code, reason) => {
                        let _ = sink
                            .send(Message::Close(Some(CloseFrame {
                                code,
                                reason: Utf8Bytes::from(reason),
                            })))
                            .await;
                        break;
                    }
                }
            }
            closed.notify_waiters();
            closed.notify_one();
        });
        (out, stream)
    }

    /// Queues a frame; false once the socket is gone.
    pub async fn send(&self, frame: ServerFrame) -> bool {
        if self.closing.load(Ordering::Acquire) {
            return false;
        }
        self.sender.send(Outgoing::Frame(frame)).await.is_ok()
    }

    pub async fn status(&self, status: Status) -> bool {
        self.send(ServerFrame::status(status)).await
    }

    /// An error status with its message, then the `error` event.
    pub async fn error(&self, status: Status, message: &str) -> bool {
        self.send(ServerFrame::status_with(status, message)).await
            && self.send(ServerFrame::Error(message.to_owned())).await
    }

    /// Closes the socket with `code` after what is queued.
    pub async fn close(&self, code: u16) {
        self.close_with(code, String::new()).await;
    }

    /// Closes the socket with `code` and `reason` after what is queued.
    pub async fn close_with(&self, code: u16, reason: String) {
        if !self.closing.swap(true, Ordering::AcqRel) {
            let _ = self.sender.send(Outgoing::Close(code, reason)).await;
        }
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Completes when the writer has stopped.
    pub async fn closed(&self) {
        self.closed.notified().await;
    }
}

/// Reads the next text frame; `None` when the socket is done. Binary and
/// oversized frames come back as errors to report.
pub async fn next_text(stream: &mut SplitStream<WebSocket>) -> Option<Result<String, FrameError>> {
    loop {
        match stream.next().await? {
            Ok(Message::Text(text)) => {
                if text.len() > MAX_FRAME_BYTES {
                    return Some(Err(FrameError::TooLarge(text.len())));
                }
                return Some(Ok(text.as_str().to_owned()));
            }
            Ok(Message::Binary(_)) => return Some(Err(FrameError::Binary)),
            Ok(Message::Ping(_) | Message::Pong(_)) => {}
            Ok(Message::Close(_)) => return None,
            Err(err) => return too_big(err).map(|reason| Err(FrameError::MessageTooBig(reason))),
        }
    }
}

/// The reason, when a read failed because the message exceeds the limits.
fn too_big(err: axum::Error) -> Option<String> {
    let inner = err.into_inner();
    match inner.downcast_ref::<tungstenite::Error>() {
        Some(tungstenite::Error::Capacity(capacity)) => Some(capacity.to_string()),
        _ => None,
    }
}

/// Closes with 1009 and the reason for a message too big to read, then
/// drains what the client still sends for a moment so that it reads the close
/// frame rather than a reset.
pub async fn refuse_too_big(out: &Out, stream: &mut SplitStream<WebSocket>, err: &FrameError) {
    tracing::info!(%err, "closing a socket that sent a message too big");
    out.close_with(CLOSE_TOO_BIG, close_reason(&err.to_string()))
        .await;
    let _ = tokio::time::timeout(DRAIN_AFTER_CLOSE, async {
        while stream.next().await.is_some() {}
    })
    .await;
}

/// A close reason fits in 123 bytes (RFC 6455 §5.5).
fn close_reason(text: &str) -> String {
    let mut end = text.len().min(123);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// Answers a frame that could not be parsed: its status (if it is a request
/// with one) and an `error` event. The connection stays up.
pub async fn report_frame_error(out: &Out, err: &FrameError) {
    let message = err.to_string();
    match err.status() {
        Some(status) => {
            out.error(status, &message).await;
        }
        None => {
            out.send(ServerFrame::Error(message)).await;
        }
    }
}

/// Everything one attached session shares between its tasks.
#[derive(Debug)]
pub struct Session {
    pub id: SandboxId,
    pub out: Out,
    pub live: Arc<LiveSandbox>,
    pub attachment: u64,
    pub controller: Arc<SandboxController>,
    pub features: Features,
    checkpoint_requested: AtomicBool,
    /// The controller is checkpointing (for the client, the idle timer or a move).
    checkpointing: AtomicBool,
    kill_requested: AtomicBool,
    streamer: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Told after every controller event and when the session ends: a worker
    /// waiting for a checkpoint to settle looks again.
    settled: Notify,
    ended: AtomicBool,
}

/// A parsed client frame, or why it could not be.
type Queued = Result<ClientFrame, FrameError>;

/// The frames that must act while an execution streams, ahead of the queue.
fn acts_at_once(frame: &Queued) -> bool {
    matches!(
        frame,
        Ok(ClientFrame::KillProcess | ClientFrame::KillSandbox | ClientFrame::Reconnect)
    )
}

impl Session {
    pub fn new(
        id: SandboxId,
        out: Out,
        live: Arc<LiveSandbox>,
        attachment: u64,
        controller: Arc<SandboxController>,
        features: Features,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            out,
            live,
            attachment,
            controller,
            features,
            checkpoint_requested: AtomicBool::new(false),
            checkpointing: AtomicBool::new(false),
            kill_requested: AtomicBool::new(false),
            streamer: std::sync::Mutex::new(None),
            settled: Notify::new(),
            ended: AtomicBool::new(false),
        })
    }

    /// Serves the socket until it closes, then detaches.
    pub async fn run(
        self: Arc<Self>,
        mut stream: SplitStream<WebSocket>,
        progress: broadcast::Receiver<Progress>,
        registry: Arc<LiveSandboxes>,
    ) {
        self.controller.client_attached(&self.id, true);
        let (queue, queued) = mpsc::channel::<Queued>(QUEUED_FRAMES);
        let worker = tokio::spawn(Arc::clone(&self).work(queued));
        let mut relay = tokio::spawn(Arc::clone(&self).relay_events(progress));
        loop {
            tokio::select! {
                frame = next_text(&mut stream) => {
                    let Some(frame) = frame else { break };
                    self.live.touch();
                    self.controller.client_active(&self.id);
                    if let Err(err @ FrameError::MessageTooBig(_)) = &frame {
                        refuse_too_big(&self.out, &mut stream, err).await;
                        break;
                    }
                    let parsed = frame.and_then(|text| ClientFrame::parse(&text));
                    if acts_at_once(&parsed) {
                        let session = Arc::clone(&self);
                        tokio::spawn(async move { session.handle(parsed).await });
                    } else if queue.send(parsed).await.is_err() {
                        break;
                    }
                }
                _ = &mut relay => break,
                () = self.out.closed() => break,
            }
        }
        relay.abort();
        drop(queue);
        self.ended.store(true, Ordering::Release);
        self.settled.notify_waiters();
        // What was queued is refused once detached; let it drain.
        drop(worker);
        self.stop_streamer();
        registry.detach(&self.live, self.attachment);
        self.controller.client_attached(&self.id, false);
        tracing::debug!(sandbox = %self.id, "session detached");
    }

    /// Handles the queued frames one after another, in arrival order. After a
    /// checkpoint request nothing else is taken until the checkpoint is done
    /// (the session then ends) or refused.
    async fn work(self: Arc<Self>, mut queued: mpsc::Receiver<Queued>) {
        while let Some(frame) = queued.recv().await {
            let checkpoint = matches!(frame, Ok(ClientFrame::Checkpoint { .. }));
            Arc::clone(&self).handle(frame).await;
            if checkpoint {
                self.checkpoint_settled().await;
            }
        }
    }

    /// Waits until no checkpoint request of this session is pending.
    async fn checkpoint_settled(&self) {
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if !self.checkpoint_requested.load(Ordering::Acquire)
                || self.out.is_closing()
                || self.ended.load(Ordering::Acquire)
            {
                return;
            }
            settled.await;
        }
    }

    /// Relays the controller's events until one ends the session.
    async fn relay_events(self: Arc<Self>, mut progress: broadcast::Receiver<Progress>) {
        loop {
            let end = match progress.recv().await {
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

    fn stop_streamer(&self) {
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
    fn stream(self: &Arc<Self>, execution: Arc<ExecutionState>) {
        let out = self.out.clone();
        let mut streamer = self
            .streamer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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

    /// Turns a controller event into status frames. True when the session ends.
    async fn relay(&self, event: Progress) -> bool {
        let out = &self.out;
        let handoff = self.live.options().handoff;
        match event {
            Progress::LockAcquiring | Progress::LockAcquired => {}
            Progress::LockReleaseRequested => {
                out.status(Status::LockReleaseRequested).await;
            }
            Progress::LockReleasing if handoff => {
                out.status(Status::LockReleasing).await;
            }
            Progress::LockReleased if handoff => {
                out.status(Status::LockReleased).await;
            }
            Progress::LockReleasing | Progress::LockReleased => {}
            Progress::Restoring | Progress::Running { .. } => {}
            Progress::Checkpointing => {
                self.checkpointing.store(true, Ordering::Release);
                // Unless it is kept: it goes on after the restore.
                if let Some(execution) = self.live.execution()
                    && !self.live.options().keep_executions
                {
                    execution.expect_forced_kill(true);
                }
                if !self.checkpoint_requested.load(Ordering::Acquire) {
                    out.status(Status::Checkpointing).await;
                }
            }
            Progress::Deleting => {
                out.status(Status::Deleting).await;
            }
            Progress::Deleted => {
                out.status(Status::Deleted).await;
                if self.kill_requested.load(Ordering::Acquire) {
                    out.status(Status::Killed).await;
                    out.close(CLOSE_NORMAL).await;
                    return true;
                }
                if !self.checkpointing.load(Ordering::Acquire) {
                    // Deleted by idle expiry or an operator: nothing to attach to.
                    out.close(CLOSE_NORMAL).await;
                    return true;
                }
            }
            Progress::Checkpointed { .. } => {
                out.status(Status::Checkpointed).await;
                out.close(CLOSE_NORMAL).await;
                return true;
            }
            Progress::ExecutionInProgress => {
                self.checkpointing.store(false, Ordering::Release);
                if let Some(execution) = self.live.execution() {
                    execution.expect_forced_kill(false);
                }
                if self.checkpoint_requested.swap(false, Ordering::AcqRel) {
                    out.error(
                        Status::ExecutionInProgressError,
                        "Cannot checkpoint while an execution is in progress.",
                    )
                    .await;
                    self.cancel_checkpoint().await;
                }
            }
            Progress::Failed { operation, message } => match operation {
                Operation::Checkpoint => {
                    self.checkpointing.store(false, Ordering::Release);
                    out.error(Status::CheckpointError, &message).await;
                    let requested = self.checkpoint_requested.swap(false, Ordering::AcqRel);
                    let gone = !self.controller.is_held_here(&self.id);
                    if requested && !gone {
                        self.cancel_checkpoint().await;
                    }
                    if requested || gone {
                        out.close(CLOSE_FATAL).await;
                        return true;
                    }
                }
                Operation::Delete => {
                    if self.kill_requested.swap(false, Ordering::AcqRel) {
                        out.error(Status::KillError, &message).await;
                        out.close(CLOSE_NORMAL).await;
                        return true;
                    }
                    out.error(Status::Error, &message).await;
                }
                Operation::Create | Operation::Restore => {}
            },
            Progress::Lost { message } => {
                out.error(Status::Error, &message).await;
                out.close(CLOSE_FATAL).await;
                return true;
            }
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

    async fn handle(self: Arc<Self>, parsed: Queued) {
        let frame = match parsed {
            Ok(frame) => frame,
            Err(err) => {
                tracing::debug!(sandbox = %self.id, %err, "bad client frame");
                report_frame_error(&self.out, &err).await;
                return;
            }
        };
        if !self.live.is_attached_by(self.attachment) || self.out.is_closing() {
            return;
        }
        match frame {
            ClientFrame::Exec {
                language,
                code,
                session,
            } => self.exec(language, code, session).await,
            ClientFrame::Stdin { data } => self.stdin(data).await,
            ClientFrame::KillProcess => self.kill_process().await,
            ClientFrame::KillSandbox => self.kill_sandbox().await,
            ClientFrame::Checkpoint { name } => self.checkpoint(name).await,
            ClientFrame::SnapshotFilesystem { name } => self.snapshot(name).await,
            ClientFrame::Reconnect => self.reconnect(),
        }
    }

    async fn exec(self: &Arc<Self>, language: Language, code: String, session: bool) {
        let command = match (language, session) {
            (Language::Bash, _) => Command::Bash(code),
            (Language::Python, false) => Command::Python(code),
            (Language::Python, true) => Command::PythonSession(code),
        };
        let in_progress = "An execution is already in progress.";
        if self.live.execution_running() {
            self.out.error(Status::ExecutionError, in_progress).await;
            return;
        }
        let execution = match self
            .controller
            .exec(
                &self.id,
                ExecRequest {
                    resumable: self.live.options().keep_executions,
                    ..ExecRequest::new(command)
                },
            )
            .await
        {
            Ok(execution) => execution,
            Err(controllers::sandboxes::ControlError::Runtime(
                controllers::runtime::RuntimeError::ExecutionInProgress(_),
            )) => {
                self.out.error(Status::ExecutionError, in_progress).await;
                return;
            }
            Err(err) => {
                let message = format!("Cannot execute code in sandbox {}: {err}", self.id);
                self.out.error(Status::ExecutionError, &message).await;
                return;
            }
        };
        let live = Arc::clone(&self.live);
        let controller = Arc::clone(&self.controller);
        let id = self.id.clone();
        let started = self.live.begin_execution(move || {
            ExecutionState::start(execution, move || {
                live.touch();
                // A checkpoint may be waiting for this execution to end.
                controller.poke(&id);
            })
        });
        match started {
            Some(execution) => {
                self.out.status(Status::ExecutionRunning).await;
                self.stream(execution);
            }
            None => {
                self.out.error(Status::ExecutionError, in_progress).await;
            }
        }
    }

    async fn stdin(&self, data: String) {
        match self.live.execution() {
            None => {
                self.out
                    .error(
                        Status::ExecutionError,
                        "No process is running in the sandbox.",
                    )
                    .await;
            }
            Some(execution) if execution.is_running() => {
                if let Err(err) = execution.write_stdin(bytes::Bytes::from(data)).await {
                    self.out
                        .error(Status::StdinError, &format!("Cannot write to stdin: {err}"))
                        .await;
                }
            }
            // Upstream drops stdin for a finished execution silently.
            Some(_) => {}
        }
    }

    async fn kill_process(&self) {
        let killed_running = match self.live.execution() {
            Some(execution) => execution.kill().await,
            None => false,
        };
        if !killed_running {
            self.out.status(Status::ExecutionForceKilled).await;
        }
    }

    async fn kill_sandbox(&self) {
        self.out.status(Status::Killing).await;
        self.kill_requested.store(true, Ordering::Release);
        if let Err(err) = self
            .controller
            .request_state(&self.id, DesiredState::Deleted, None)
            .await
        {
            self.kill_requested.store(false, Ordering::Release);
            self.out
                .error(
                    Status::KillError,
                    &format!("Failed to kill sandbox {}: {err}", self.id),
                )
                .await;
            self.out.close(CLOSE_NORMAL).await;
        }
    }

    async fn checkpoint(&self, name: Option<String>) {
        let out = &self.out;
        out.status(Status::Checkpointing).await;
        if self.live.execution_running() {
            out.error(
                Status::ExecutionInProgressError,
                "Cannot checkpoint while an execution is in progress.",
            )
            .await;
            return;
        }
        let failed = |detail: String| format!("Failed to checkpoint sandbox {}: {detail}", self.id);
        if !self.features.checkpoint || !self.live.options().enable_checkpoint {
            let message = failed(format!(
                "Sandbox {} is not configured for checkpointing.",
                self.id
            ));
            out.error(Status::CheckpointError, &message).await;
            out.close(CLOSE_FATAL).await;
            return;
        }
        if let Some(name) = &name
            && !is_resource_name(name)
        {
            let message = failed(format!(
                "invalid checkpoint name {name:?}: {RESOURCE_NAME_RULE}"
            ));
            out.error(Status::CheckpointError, &message).await;
            return;
        }
        self.checkpoint_requested.store(true, Ordering::Release);
        if let Err(err) = self
            .controller
            .request_state(&self.id, DesiredState::Checkpointed, name.as_deref())
            .await
        {
            self.checkpoint_requested.store(false, Ordering::Release);
            out.error(Status::CheckpointError, &failed(err.to_string()))
                .await;
            out.close(CLOSE_FATAL).await;
        }
    }

    async fn snapshot(&self, name: String) {
        let out = &self.out;
        out.status(Status::FilesystemSnapshotCreating).await;
        let failed = |detail: String| {
            format!(
                "Failed to snapshot filesystem for sandbox {}: {detail}",
                self.id
            )
        };
        if !self.features.snapshot {
            out.error(
                Status::FilesystemSnapshotError,
                "Filesystem snapshot is not enabled on the server.",
            )
            .await;
            return;
        }
        if !is_resource_name(&name) {
            out.error(
                Status::FilesystemSnapshotError,
                &failed(format!(
                    "invalid snapshot name {name:?}: {RESOURCE_NAME_RULE}"
                )),
            )
            .await;
            return;
        }
        match self.controller.snapshot_filesystem(&self.id, &name).await {
            Ok(_) => {
                out.status(Status::FilesystemSnapshotCreated).await;
            }
            Err(err) => {
                out.error(Status::FilesystemSnapshotError, &failed(err.to_string()))
                    .await;
            }
        }
    }

    /// Replays the current execution's undelivered output, then streams it live.
    /// With nothing to replay it sends nothing (upstream hung or closed, bug B5).
    fn reconnect(self: &Arc<Self>) {
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
