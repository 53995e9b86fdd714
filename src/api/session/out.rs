//! The socket's two halves as a session uses them: [`Out`], the sending half
//! behind a writer task (status frames, errors, the close), and the reading
//! of client text frames with the limits of the wire (binary and oversized
//! frames refused, a too-big message closed with 1009).
//!
//! What waits for the writer is bounded in bytes, not only in frames: every
//! frame holds its size of the socket's reply budget
//! ([`SocketSettings::reply_budget_bytes`]) until it is written, and a
//! sender waits for room. The session's worker is such a sender, so while
//! replies wait it takes no further request, its queue fills and the socket
//! is not read: a client that stops reading stops being served. A write
//! that makes no progress for [`SocketSettings::stall_timeout`] closes the
//! socket with [`CLOSE_STALLED`]. The writer also pings the client every
//! [`SocketSettings::ping_interval`], and a client that sends nothing (not
//! even the pong) for [`SocketSettings::ping_timeout`] after a ping is
//! closed with [`CLOSE_GOING_AWAY`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use bytes::Bytes;
use controllers::clock::Clock;
use futures::{SinkExt, StreamExt};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};

use super::client_stream::ClientStream;
use super::early_budget::EarlyBudget;
use super::heard::Heard;
use crate::api::protocol::{FrameError, MAX_FRAME_BYTES, ServerFrame, Status};

/// Close codes (`docs/wire-contract.md` §2.4).
pub const CLOSE_NORMAL: u16 = 1000;
/// RFC 6455: a message too big to process.
pub const CLOSE_TOO_BIG: u16 = 1009;
pub const CLOSE_UNAVAILABLE: u16 = 1011;
pub const CLOSE_FATAL: u16 = 4000;
/// RFC 6455: the endpoint goes away (here: a client silent past its ping).
pub const CLOSE_GOING_AWAY: u16 = 1001;
/// RFC 6455 policy violation: the client read nothing for the stall timeout.
pub const CLOSE_STALLED: u16 = 1008;

/// Default of [`SocketSettings::reply_budget_bytes`].
pub const DEFAULT_REPLY_BUDGET_BYTES: usize = 16 << 20;
/// Default of [`SocketSettings::stall_timeout`].
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Default of [`SocketSettings::ping_interval`].
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(20);
/// Default of [`SocketSettings::ping_timeout`].
pub const DEFAULT_PING_TIMEOUT: Duration = Duration::from_secs(90);
/// Default of [`SocketSettings::init_timeout`].
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(10);

/// What one client socket may hold of the server and how long it may stay
/// silent (`--ws-reply-budget-bytes`, `--ws-stall-timeout-s`,
/// `--ws-ping-interval-s`, `--ws-ping-timeout-s`, `--ws-init-timeout-s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketSettings {
    /// Bytes of frames waiting for the writer, at most (one frame larger
    /// than this still goes, alone).
    pub reply_budget_bytes: usize,
    /// A write that makes no progress this long closes the socket.
    pub stall_timeout: Duration,
    /// How often the server pings the client.
    pub ping_interval: Duration,
    /// A client that sent nothing for this long (pongs count) is closed.
    pub ping_timeout: Duration,
    /// A `/create` socket whose init message has not come whole this long
    /// after the upgrade is closed: pongs keep a socket alive, and a
    /// message begun and never finished holds its bytes.
    pub init_timeout: Duration,
}

impl Default for SocketSettings {
    fn default() -> Self {
        Self {
            reply_budget_bytes: DEFAULT_REPLY_BUDGET_BYTES,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            ping_interval: DEFAULT_PING_INTERVAL,
            ping_timeout: DEFAULT_PING_TIMEOUT,
            init_timeout: DEFAULT_INIT_TIMEOUT,
        }
    }
}

/// What the writer task sends, with the share of the reply budget (and of
/// a download's window) it holds until it is written.
#[derive(Debug)]
pub enum Outgoing {
    Text(String, Vec<OwnedSemaphorePermit>),
    /// A binary frame (a download's bytes).
    Binary(Bytes, Vec<OwnedSemaphorePermit>),
    Close(u16, String),
}

impl Outgoing {
    /// The frame to write, the budget it holds, and whether it closes.
    fn into_message(self) -> (Message, Vec<OwnedSemaphorePermit>, bool) {
        match self {
            Self::Text(text, permits) => (Message::Text(Utf8Bytes::from(text)), permits, false),
            Self::Binary(data, permits) => (Message::Binary(data), permits, false),
            Self::Close(code, reason) => {
                let reason = Utf8Bytes::from(reason);
                let close = Message::Close(Some(CloseFrame { code, reason }));
                (close, Vec::new(), true)
            }
        }
    }
}

/// How long a socket closed for a too-big frame is still drained, so the
/// client reads the close frame instead of a reset connection.
const DRAIN_AFTER_CLOSE: Duration = Duration::from_secs(2);

/// Frames waiting for the writer, at most (the reply budget bounds their
/// bytes).
const QUEUED_REPLIES: usize = 256;

/// The sending half of a socket, shared by the tasks of one session.
#[derive(Debug, Clone)]
pub struct Out {
    sender: mpsc::Sender<Outgoing>,
    closed: Arc<Notify>,
    closing: Arc<AtomicBool>,
    /// The reply budget: one permit a byte.
    budget: Arc<Semaphore>,
    budget_bytes: usize,
}

/// Why the writer stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The socket failed or the session closed it.
    Done,
    /// A write made no progress for the stall timeout.
    Stalled,
    /// The client sent nothing for the ping timeout.
    Silent,
    /// The server shuts down ([`ShutdownNotice`]).
    ShuttingDown,
}

/// Set when the server's shutdown grace has run out with sockets still
/// open: each is closed with [`CLOSE_GOING_AWAY`] after what its session
/// queued, rather than dropped without a word when the process ends.
pub type ShutdownNotice = tokio::sync::watch::Receiver<bool>;

/// Completes once `notice` is set; never if its sender is gone unset.
async fn announced(notice: &mut ShutdownNotice) {
    if notice.wait_for(|down| *down).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl Out {
    /// Spawns the writer task for `socket`'s sending half; its silences and
    /// pings are timed by `clock`. The reading half keeps what it reads
    /// during a handshake's wait within `early` (the instance's budget).
    pub fn spawn(
        socket: WebSocket,
        settings: SocketSettings,
        clock: Arc<dyn Clock>,
        early: EarlyBudget,
        shutdown: ShutdownNotice,
    ) -> (Self, ClientStream) {
        let (mut sink, stream) = socket.split();
        let (sender, mut receiver) = mpsc::channel::<Outgoing>(QUEUED_REPLIES);
        let closed = Arc::new(Notify::new());
        let budget_bytes = settings.reply_budget_bytes.clamp(1, u32::MAX as usize);
        let out = Self {
            sender,
            closed: Arc::clone(&closed),
            closing: Arc::new(AtomicBool::new(false)),
            budget: Arc::new(Semaphore::new(budget_bytes)),
            budget_bytes,
        };
        let heard = Heard::new(clock);
        let stream = ClientStream::new(stream, Arc::clone(&heard), early);
        let closing = Arc::clone(&out.closing);
        tokio::spawn(async move {
            let stop = write(&mut sink, &mut receiver, &heard, settings, shutdown).await;
            let (code, reason) = match stop {
                Stop::Done => (None, String::new()),
                Stop::ShuttingDown => (
                    Some(CLOSE_GOING_AWAY),
                    "the server is shutting down: attach again (another instance takes over)"
                        .to_owned(),
                ),
                Stop::Stalled => (
                    Some(CLOSE_STALLED),
                    format!(
                        "the client read nothing for {} s",
                        settings.stall_timeout.as_secs()
                    ),
                ),
                Stop::Silent => (
                    Some(CLOSE_GOING_AWAY),
                    format!(
                        "the client answered no ping for {} s",
                        settings.ping_timeout.as_secs()
                    ),
                ),
            };
            if let Some(code) = code {
                // The server's own close: what the client sent and the
                // session has not taken yet is dropped (nobody reads the
                // answers), as after any close the server makes.
                closing.store(true, Ordering::Release);
                tracing::info!(code, %reason, "closing a client socket");
                // The close goes after what the writer holds; a client that
                // reads again within the stall timeout still gets it.
                let close = Message::Close(Some(CloseFrame {
                    code,
                    reason: Utf8Bytes::from(reason),
                }));
                let _ = tokio::time::timeout(settings.stall_timeout, sink.send(close)).await;
                // Nothing more is read from a dead client (a normal close
                // leaves the reading to the session, which drains it).
                heard.stop();
            }
            closed.notify_waiters();
            closed.notify_one();
        });
        (out, stream)
    }

    /// An `Out` whose frames go nowhere: for an attach made by an HTTP
    /// request (the filesystem API), which has no socket to tell.
    pub fn sink() -> Self {
        let (sender, mut receiver) = mpsc::channel::<Outgoing>(16);
        tokio::spawn(async move { while receiver.recv().await.is_some() {} });
        Self {
            sender,
            closed: Arc::new(Notify::new()),
            closing: Arc::new(AtomicBool::new(false)),
            budget: Arc::new(Semaphore::new(DEFAULT_REPLY_BUDGET_BYTES)),
            budget_bytes: DEFAULT_REPLY_BUDGET_BYTES,
        }
    }

    /// Waits for `bytes` of the reply budget (all of it for a larger frame).
    async fn reserve(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let permits = u32::try_from(bytes.clamp(1, self.budget_bytes)).unwrap_or(u32::MAX);
        Arc::clone(&self.budget)
            .acquire_many_owned(permits)
            .await
            .ok()
    }

    /// Queues a frame once the reply budget has room for it; false once
    /// the socket is gone.
    pub async fn send(&self, frame: ServerFrame) -> bool {
        if self.closing.load(Ordering::Acquire) {
            return false;
        }
        let text = frame.to_text();
        let Some(permit) = self.reserve(text.len()).await else {
            return false;
        };
        self.sender
            .send(Outgoing::Text(text, vec![permit]))
            .await
            .is_ok()
    }

    /// Queues a binary frame once the reply budget has room for it;
    /// `permit` is released once it is written.
    pub async fn binary(&self, data: Bytes, permit: Option<OwnedSemaphorePermit>) -> bool {
        if self.closing.load(Ordering::Acquire) {
            return false;
        }
        let Some(budget) = self.reserve(data.len()).await else {
            return false;
        };
        let permits = std::iter::once(budget).chain(permit).collect();
        self.sender
            .send(Outgoing::Binary(data, permits))
            .await
            .is_ok()
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

/// The writer's loop: sends what is queued (each write bounded by the stall
/// timeout) and pings the client; why it stopped.
async fn write(
    sink: &mut futures::stream::SplitSink<WebSocket, Message>,
    receiver: &mut mpsc::Receiver<Outgoing>,
    heard: &Heard,
    settings: SocketSettings,
    mut shutdown: ShutdownNotice,
) -> Stop {
    let mut ping = tokio::time::interval_at(
        heard.clock.instant() + settings.ping_interval,
        settings.ping_interval.max(Duration::from_millis(10)),
    );
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let (message, permits, closes) = tokio::select! {
            outgoing = receiver.recv() => match outgoing {
                None => return Stop::Done,
                Some(outgoing) => outgoing.into_message(),
            },
            () = announced(&mut shutdown) => {
                // What the session queued before goes first (its last
                // frames); the close follows.
                while let Ok(outgoing) = receiver.try_recv() {
                    let (message, _, closes) = outgoing.into_message();
                    let sent = tokio::time::timeout(settings.stall_timeout, sink.send(message)).await;
                    if closes || !matches!(sent, Ok(Ok(()))) {
                        return Stop::Done;
                    }
                }
                return Stop::ShuttingDown;
            }
            _ = ping.tick() => {
                if heard.silent_for() > settings.ping_timeout {
                    return Stop::Silent;
                }
                (Message::Ping(Bytes::new()), Vec::new(), false)
            }
        };
        let sent = tokio::time::timeout(settings.stall_timeout, sink.send(message)).await;
        drop(permits);
        match sent {
            _ if closes => return Stop::Done,
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Stop::Done,
            Err(_) => return Stop::Stalled,
        }
    }
}

/// Reads the next text frame; `None` when the socket is done. Binary and
/// oversized frames come back as errors to report.
pub async fn next_text(stream: &mut ClientStream) -> Option<Result<String, FrameError>> {
    match next_message(stream).await? {
        Ok(Incoming::Text(text)) => Some(Ok(text)),
        Ok(Incoming::Binary(_)) => Some(Err(FrameError::Binary)),
        Err(err) => Some(Err(err)),
    }
}

/// A client frame: text (a request), or binary (an upload's bytes).
#[derive(Debug)]
pub enum Incoming {
    Text(String),
    Binary(Bytes),
}

/// Reads the next text or binary frame; `None` when the socket is done.
/// Oversized frames come back as errors to report.
pub async fn next_message(stream: &mut ClientStream) -> Option<Result<Incoming, FrameError>> {
    loop {
        match stream.next().await? {
            Ok(Message::Text(text)) => {
                if text.len() > MAX_FRAME_BYTES {
                    return Some(Err(FrameError::TooLarge(text.len())));
                }
                return Some(Ok(Incoming::Text(text.as_str().to_owned())));
            }
            Ok(Message::Binary(data)) => {
                if data.len() > MAX_FRAME_BYTES {
                    return Some(Err(FrameError::TooLarge(data.len())));
                }
                return Some(Ok(Incoming::Binary(data)));
            }
            Ok(Message::Ping(_) | Message::Pong(_)) => {}
            Ok(Message::Close(_)) => return None,
            Err(err) => return Some(Err(read_failed(err)?)),
        }
    }
}

/// What a failed read is to report: a frame too large that a wait read
/// and dropped ([`super::client_stream::DroppedTooLarge`]), as if read now;
/// a message beyond the limits; `None` for anything else (the socket is
/// done).
fn read_failed(err: axum::Error) -> Option<FrameError> {
    let inner = err.into_inner();
    if let Some(dropped) = inner.downcast_ref::<super::client_stream::DroppedTooLarge>() {
        return Some(FrameError::TooLarge(dropped.0));
    }
    too_big(&*inner).map(FrameError::MessageTooBig)
}

/// The reason, when a read failed because the message exceeds the limits.
fn too_big(inner: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<String> {
    match inner.downcast_ref::<tungstenite::Error>() {
        Some(tungstenite::Error::Capacity(capacity)) => Some(capacity.to_string()),
        _ => None,
    }
}

/// Closes with 1009 and the reason for a message too big to read, then
/// drains what the client still sends for a moment so that it reads the close
/// frame rather than a reset.
pub async fn refuse_too_big(out: &Out, stream: &mut ClientStream, err: &FrameError) {
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
    if let FrameError::Fs { request_id, op, .. } = err {
        out.send(crate::api::files::error_frame(
            request_id.as_deref(),
            op,
            "EINVAL",
            &message,
        ))
        .await;
        return;
    }
    match err.status() {
        Some(status) => {
            out.error(status, &message).await;
        }
        None => {
            out.send(ServerFrame::Error(message)).await;
        }
    }
}
