//! An attached WebSocket session: reads client frames and answers them, and
//! relays what the controller does to the sandbox. Everything that changes the
//! sandbox's lifecycle (checkpoint, kill, idle expiry) is written as an intent;
//! the controller's domain events then become the status frames the clients
//! expect (`relay`).
//!
//! Frames take effect in the order they arrived: one worker per socket handles
//! them one after another (stdin is never reordered, a checkpoint sent before
//! an execution is taken before it runs). Only the control frames that must act
//! while an execution streams (`kill_process`, `kill_sandbox`, `reconnect`,
//! `resize`) bypass the queue and act at once, on a second task of their own
//! (in their order; resizes coalesced to the latest size, and applied before
//! any queued frame that arrived after them). Upstream handled
//! each frame in its own task, which reordered a burst of stdin frames.

mod client_stream;
mod early_budget;
mod files;
mod frames;
mod heard;
mod out;
mod pending;
mod relay;
mod stream;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use controllers::api::SandboxId;
use controllers::sandboxes::{SandboxController, SandboxEvent};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, broadcast, mpsc};
use tokio::task::JoinHandle;

pub use client_stream::ClientStream;
pub use early_budget::{DEFAULT_EARLY_FRAMES_BUDGET_BYTES, EarlyBudget};
pub use out::{
    CLOSE_FATAL, CLOSE_GOING_AWAY, CLOSE_NORMAL, CLOSE_STALLED, CLOSE_TOO_BIG, CLOSE_UNAVAILABLE,
    DEFAULT_INIT_TIMEOUT, DEFAULT_PING_INTERVAL, DEFAULT_PING_TIMEOUT, DEFAULT_REPLY_BUDGET_BYTES,
    DEFAULT_STALL_TIMEOUT, Incoming, Out, Outgoing, ShutdownNotice, SocketSettings, next_message,
    next_text, refuse_too_big, report_frame_error,
};

use super::features::Features;
use super::live::{LiveSandbox, LiveSandboxes};
use super::protocol::{ClientFrame, FrameError, ServerFrame};
use super::snapshot_owner::SnapshotProof;
use pending::Pending;

/// Client frames waiting for the session's worker, in arrival order.
const QUEUED_FRAMES: usize = 1024;

/// Bytes of client frames waiting for the session's worker, at most (without
/// it, 1,024 frames of up to 1 MiB each could wait while a checkpoint ran).
/// When they are used up the socket is not read until the worker catches up,
/// and TCP holds the client back. At least one frame of the largest size fits.
pub const QUEUED_BYTES: usize = 8 * super::protocol::MAX_FRAME_BYTES;

/// Everything one attached session shares between its tasks.
#[derive(Debug)]
pub struct Session {
    pub id: SandboxId,
    pub out: Out,
    pub live: Arc<LiveSandbox>,
    pub attachment: u64,
    pub controller: Arc<SandboxController>,
    pub features: Features,
    /// The owner of the snapshots this session takes (the sandbox's token's
    /// snapshot token; `api::snapshot_owner`).
    snapshot_owner: SnapshotProof,
    /// Where snapshots are kept, to count their owner's quota (`None`: not
    /// counted).
    snapshot_store: Option<Arc<dyn controllers::store::Store>>,
    /// What this session asked the controller for and awaits the end of.
    pending: Pending,
    streamer: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Told after every controller event and when the session ends: a worker
    /// waiting for a checkpoint to settle looks again.
    settled: Notify,
    /// The relay said CHECKPOINTING (and, before it, a handoff's
    /// LOCK_RELEASE_REQUESTED) for the checkpoint under way. The controller
    /// says it before the runtime kills a running execution, but the relay
    /// and the streamer are two tasks: the streamer holds that execution's
    /// FORCE_KILLED until this is true, so the socket gets them in
    /// upstream's order. Written by the relay only.
    checkpoint_said: AtomicBool,
    ended: AtomicBool,
    resizes: Resizes,
}

/// A parsed client frame, or why it could not be.
type Queued = Result<ClientFrame, FrameError>;

/// A queued frame, for an upload where its bytes arrive, and its share of
/// the socket's queued-bytes budget.
type Work = (
    Queued,
    Option<mpsc::Receiver<bytes::Bytes>>,
    OwnedSemaphorePermit,
);

/// The share of [`QUEUED_BYTES`] a frame of `bytes` holds while it waits.
async fn reserve(budget: &Arc<Semaphore>, bytes: usize) -> Option<OwnedSemaphorePermit> {
    let permits = u32::try_from(bytes.clamp(1, QUEUED_BYTES)).unwrap_or(u32::MAX);
    Arc::clone(budget).acquire_many_owned(permits).await.ok()
}

/// [`reserve`] when the budget has room now.
fn try_reserve(budget: &Arc<Semaphore>, bytes: usize) -> Option<OwnedSemaphorePermit> {
    let permits = u32::try_from(bytes.clamp(1, QUEUED_BYTES)).unwrap_or(u32::MAX);
    Arc::clone(budget).try_acquire_many_owned(permits).ok()
}

/// Frames that act at once waiting for their task, at most (the socket is
/// not read while they are full).
const URGENT_FRAMES: usize = 64;

/// The latest terminal size a client asked for, not yet applied. Either
/// worker applies it, under its lock: the urgent one at once, the queued one
/// before the next frame it handles, so a resize the client sent before its
/// stdin reaches the terminal before that stdin does (the urgent worker may
/// have taken it first: the lock is held until it is sent).
#[derive(Debug, Default)]
struct Resizes {
    latest: tokio::sync::Mutex<Option<controllers::runtime::TerminalSize>>,
    pending: Notify,
}

/// The frames that must act while an execution streams, ahead of the queue.
fn acts_at_once(frame: &Queued) -> bool {
    matches!(
        frame,
        Ok(ClientFrame::KillProcess
            | ClientFrame::KillSandbox
            | ClientFrame::Reconnect
            | ClientFrame::Resize(_))
    )
}

impl Session {
    #[allow(clippy::too_many_arguments, reason = "the parts of one session")]
    pub fn new(
        id: SandboxId,
        out: Out,
        live: Arc<LiveSandbox>,
        attachment: u64,
        controller: Arc<SandboxController>,
        features: Features,
        snapshot_owner: SnapshotProof,
        snapshot_store: Option<Arc<dyn controllers::store::Store>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            out,
            live,
            attachment,
            controller,
            features,
            snapshot_owner,
            snapshot_store,
            pending: Pending::default(),
            streamer: std::sync::Mutex::new(None),
            settled: Notify::new(),
            checkpoint_said: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            resizes: Resizes::default(),
        })
    }

    /// Serves the socket until it closes, then detaches.
    pub async fn run(
        self: Arc<Self>,
        mut stream: ClientStream,
        events: broadcast::Receiver<SandboxEvent>,
        registry: Arc<LiveSandboxes>,
    ) {
        self.controller.client_attached(&self.id, true);
        let (queue, queued) = mpsc::channel::<Work>(QUEUED_FRAMES);
        let budget = Arc::new(Semaphore::new(QUEUED_BYTES));
        let worker = tokio::spawn(Arc::clone(&self).work(queued));
        let (urgent, urgent_work) = mpsc::channel(URGENT_FRAMES);
        let urgent_worker = tokio::spawn(Arc::clone(&self).work_urgent(urgent_work));
        let mut relay = tokio::spawn(Arc::clone(&self).relay_events(events));
        let mut uploads = files::UploadIntake::default();
        loop {
            tokio::select! {
                message = next_message(&mut stream) => {
                    let Some(message) = message else { break };
                    self.live.touch();
                    self.controller.client_active(&self.id);
                    let frame = match message {
                        Err(err @ FrameError::MessageTooBig(_)) => {
                            refuse_too_big(&self.out, &mut stream, &err).await;
                            break;
                        }
                        Ok(Incoming::Binary(data)) => {
                            // An upload's bytes, read here so the upload
                            // slows the socket down rather than queue.
                            match uploads.bytes(data).await {
                                Ok(()) => continue,
                                Err(err) => Err(err),
                            }
                        }
                        Ok(Incoming::Text(text)) => Ok(text),
                        Err(err) => Err(err),
                    };
                    let frame_bytes = frame.as_ref().map_or(0, String::len);
                    let parsed = frame.and_then(|text| ClientFrame::parse(&text));
                    if let Ok(ClientFrame::Resize(size)) = &parsed {
                        *self.resizes.latest.lock().await = Some(*size);
                        self.resizes.pending.notify_one();
                        continue;
                    }
                    if acts_at_once(&parsed) {
                        if urgent.send(parsed).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    let permit = match try_reserve(&budget, frame_bytes) {
                        Some(permit) => permit,
                        None => {
                            // The queue is full and the socket will not be
                            // read until it drains. An upload still waiting
                            // for its bytes would wait forever (they come
                            // after this frame, and the session may be in
                            // that upload): it ends short, with an fs_error.
                            uploads.abandon();
                            let Some(permit) = reserve(&budget, frame_bytes).await else { break };
                            permit
                        }
                    };
                    let bytes = match &parsed {
                        Ok(ClientFrame::Fs(files::FsCall {
                            op: files::FsOp::Upload { size, .. },
                            ..
                        })) => Some(uploads.expect(*size)),
                        _ => None,
                    };
                    if queue.send((parsed, bytes, permit)).await.is_err() {
                        break;
                    }
                }
                _ = &mut relay => break,
                () = self.out.closed() => break,
            }
        }
        relay.abort();
        drop(queue);
        drop(urgent);
        drop(urgent_worker);
        self.ended.store(true, Ordering::Release);
        self.settled.notify_waiters();
        // What was queued still takes effect (a frame received is a frame
        // honoured); the worker drains it after the detach, so a client
        // that re-attaches at once is not refused as in use meanwhile.
        drop(worker);
        self.stop_streamer();
        registry.detach(&self.live, self.attachment);
        self.controller.client_attached(&self.id, false);
        tracing::debug!(sandbox = %self.id, "session detached");
    }

    /// Handles the queued frames one after another, in arrival order. After a
    /// checkpoint request nothing else is taken until the checkpoint is done
    /// (the session then ends) or refused.
    async fn work(self: Arc<Self>, mut queued: mpsc::Receiver<Work>) {
        while let Some((frame, bytes, permit)) = queued.recv().await {
            let checkpoint = matches!(frame, Ok(ClientFrame::Checkpoint { .. }));
            // The frame's bytes are handed over (to the agent, to the
            // execution): its share of the budget is free again.
            drop(permit);
            self.apply_resize().await;
            Arc::clone(&self).handle(frame, bytes).await;
            if checkpoint {
                self.checkpoint_settled().await;
            }
        }
    }

    /// Handles the frames that act at once, in arrival order, on one task:
    /// a resize is applied as the latest size asked for (a burst of them
    /// costs one resize each time the task gets to it), the others in turn.
    async fn work_urgent(self: Arc<Self>, mut frames: mpsc::Receiver<Queued>) {
        loop {
            let pending = self.resizes.pending.notified();
            tokio::pin!(pending);
            pending.as_mut().enable();
            if self.apply_resize().await {
                continue;
            }
            tokio::select! {
                biased;
                frame = frames.recv() => match frame {
                    Some(frame) => Arc::clone(&self).handle(frame, None).await,
                    None => break,
                },
                () = &mut pending => {}
            }
        }
        // The socket is done: a resize it sent last still applies.
        self.apply_resize().await;
    }

    /// Applies the size waiting to be applied, if any, to the running
    /// execution; true if there was one. The lock is held until the resize
    /// is queued for the agent, so a worker that finds nothing waiting knows
    /// every resize received so far is ahead of what it sends next.
    async fn apply_resize(&self) -> bool {
        let failed = {
            let mut latest = self.resizes.latest.lock().await;
            let Some(size) = latest.take() else {
                return false;
            };
            match self.live.execution() {
                Some(execution) if execution.is_running() => execution.resize(size).await.err(),
                _ => None,
            }
        };
        if let Some(err) = failed
            && !self.out.is_closing()
        {
            self.out
                .send(ServerFrame::Error(format!("Cannot resize: {err}")))
                .await;
        }
        true
    }

    /// Waits until no checkpoint request of this session is pending.
    async fn checkpoint_settled(&self) {
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if !self.pending.checkpoint()
                || self.out.is_closing()
                || self.ended.load(Ordering::Acquire)
            {
                return;
            }
            settled.await;
        }
    }
}
