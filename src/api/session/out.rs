//! The socket's two halves as a session uses them: [`Out`], the sending half
//! behind a writer task (status frames, errors, the close), and the reading
//! of client text frames with the limits of the wire (binary and oversized
//! frames refused, a too-big message closed with 1009).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};

use super::client_stream::ClientStream;
use crate::api::protocol::{FrameError, MAX_FRAME_BYTES, ServerFrame, Status};

/// Close codes (`docs/wire-contract.md` §2.4).
pub const CLOSE_NORMAL: u16 = 1000;
/// RFC 6455: a message too big to process.
pub const CLOSE_TOO_BIG: u16 = 1009;
pub const CLOSE_UNAVAILABLE: u16 = 1011;
pub const CLOSE_FATAL: u16 = 4000;

/// What the writer task sends.
#[derive(Debug)]
pub enum Outgoing {
    Frame(ServerFrame),
    /// A binary frame (a download's bytes), and what to release once it
    /// is written (the download's window: memory stays flat).
    Binary(Bytes, Option<OwnedSemaphorePermit>),
    Close(u16, String),
}

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
    pub fn spawn(socket: WebSocket) -> (Self, ClientStream) {
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
                    Outgoing::Binary(data, permit) => {
                        let sent = sink.send(Message::Binary(data)).await;
                        drop(permit);
                        if sent.is_err() {
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
        (out, ClientStream::new(stream))
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
        }
    }

    /// Queues a frame; false once the socket is gone.
    pub async fn send(&self, frame: ServerFrame) -> bool {
        if self.closing.load(Ordering::Acquire) {
            return false;
        }
        self.sender.send(Outgoing::Frame(frame)).await.is_ok()
    }

    /// Queues a binary frame; `permit` is released once it is written.
    pub async fn binary(&self, data: Bytes, permit: Option<OwnedSemaphorePermit>) -> bool {
        if self.closing.load(Ordering::Acquire) {
            return false;
        }
        self.sender
            .send(Outgoing::Binary(data, permit))
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
