//! The client's half of a socket, read also while a handshake waits.
//!
//! tungstenite answers a ping only while the socket's stream is read. A
//! create or attach can wait a long time for the controller (a restore, a
//! holder that checkpoints first, storage under load); a stream nobody reads
//! for that long leaves the client's pings unanswered, and the Python
//! `websockets` client closes after about 40 s of silence (a 20 s ping
//! interval plus a 20 s timeout). [`ClientStream::while_waiting`] reads the
//! socket during such a wait; frames that arrive meanwhile are kept, in
//! order, for the session, up to a bound (beyond it the stream is not read
//! until the session starts: a flooding client slows itself down).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket};
use futures::StreamExt;
use futures::stream::SplitStream;

use super::heard::Heard;
use crate::api::protocol::MAX_MESSAGE_BYTES;

/// At most this many frames are kept from a wait.
const EARLY_FRAMES: usize = 16;
/// And at most this many bytes of them.
const EARLY_BYTES: usize = MAX_MESSAGE_BYTES;

type Read = Result<Message, axum::Error>;

/// The reading half of a client's socket.
#[derive(Debug)]
pub struct ClientStream {
    inner: SplitStream<WebSocket>,
    /// What was read while a handshake waited, oldest first.
    early: VecDeque<Read>,
    early_bytes: usize,
    /// The socket ended during a wait.
    ended: bool,
    /// When the client was last heard from (the writer's keepalive).
    heard: Arc<Heard>,
}

impl ClientStream {
    pub fn new(inner: SplitStream<WebSocket>, heard: Arc<Heard>) -> Self {
        Self {
            inner,
            early: VecDeque::new(),
            early_bytes: 0,
            ended: false,
            heard,
        }
    }

    /// Reads the socket, recording when the client is heard from.
    async fn read(&mut self) -> Option<Read> {
        Self::read_inner(&mut self.inner, &self.heard).await
    }

    /// The next message: first those kept from a wait; `None` once the socket is done.
    pub async fn next(&mut self) -> Option<Read> {
        if let Some(read) = self.early.pop_front() {
            self.early_bytes = self.early_bytes.saturating_sub(size_of_read(&read));
            return Some(read);
        }
        if self.ended {
            return None;
        }
        self.read().await
    }

    /// Runs `wait` to its end while reading the socket, so that pings are
    /// answered; data frames read meanwhile are kept for [`Self::next`].
    pub async fn while_waiting<T>(&mut self, wait: impl Future<Output = T>) -> T {
        tokio::pin!(wait);
        loop {
            let room =
                !self.ended && self.early.len() < EARLY_FRAMES && self.early_bytes < EARLY_BYTES;
            tokio::select! {
                done = &mut wait => return done,
                read = Self::read_inner(&mut self.inner, &self.heard), if room => match read {
                    None => self.ended = true,
                    // Answered by tungstenite as it read them.
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(read) => {
                        let closing = matches!(read, Ok(Message::Close(_)) | Err(_));
                        self.early_bytes = self.early_bytes.saturating_add(size_of_read(&read));
                        self.early.push_back(read);
                        // Nothing after a close or an error is worth reading.
                        self.ended |= closing;
                    }
                },
            }
        }
    }
}

impl ClientStream {
    /// [`Self::read`] on the parts `while_waiting` borrows.
    /// `None` once the socket's writer has stopped (the socket was closed,
    /// stalled, or its client went silent).
    async fn read_inner(inner: &mut SplitStream<WebSocket>, heard: &Heard) -> Option<Read> {
        let _reading = heard.reading();
        let read = tokio::select! {
            read = inner.next() => read,
            () = heard.stopped() => return None,
        };
        heard.now();
        read
    }
}

fn size_of_read(read: &Read) -> usize {
    match read {
        Ok(Message::Text(text)) => text.len(),
        Ok(Message::Binary(data)) => data.len(),
        Ok(_) | Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use axum::extract::ws::WebSocketUpgrade;
    use futures::SinkExt;
    use tokio::sync::{Notify, oneshot};
    use tokio_tungstenite::tungstenite::Message as ClientMessage;

    use super::*;

    /// Bytes per frame the client sends: 8 fill [`EARLY_BYTES`].
    const FRAME: usize = 512 << 10;
    /// Frames the client tries to send while the handshake waits.
    const FLOOD: usize = 100;

    /// What the server saw: frames kept during the wait, their bytes, then
    /// every frame read after it (up to "end").
    type Seen = (usize, usize, Vec<String>);

    /// A server whose handshake waits until `release`, reading the socket
    /// meanwhile, then reads everything.
    async fn server(release: Arc<Notify>) -> (String, oneshot::Receiver<Seen>) {
        let (report, seen) = oneshot::channel::<Seen>();
        let report = Arc::new(Mutex::new(Some(report)));
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move |upgrade: WebSocketUpgrade| async move {
                upgrade.on_upgrade(move |socket| async move {
                    let (_sink, stream) = socket.split();
                    let mut stream = ClientStream::new(
                        stream,
                        Heard::new(Arc::new(controllers::clock::SystemClock)),
                    );
                    stream.while_waiting(release.notified()).await;
                    let kept = (stream.early.len(), stream.early_bytes);
                    let mut frames = Vec::new();
                    while let Some(Ok(Message::Text(text))) = stream.next().await {
                        if text.as_str() == "end" {
                            break;
                        }
                        frames.push(text.as_str().get(..12).unwrap_or_default().to_owned());
                    }
                    let sender = report.lock().ok().and_then(|mut report| report.take());
                    if let Some(sender) = sender {
                        let _ = sender.send((kept.0, kept.1, frames));
                    }
                })
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("ws://{addr}/"), seen)
    }

    /// Frames a client sends while a create or attach waits are kept for the
    /// session up to the bound; beyond it the socket is not read (the
    /// client's sends stall); once the wait ends every frame arrives, in
    /// order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_sent_during_a_wait_are_kept_up_to_the_bound_and_none_is_lost() {
        let release = Arc::new(Notify::new());
        let (url, seen) = server(Arc::clone(&release)).await;
        let (socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        let (mut sink, _stream) = socket.split();
        let sent = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let flood = {
            let (sent, stop) = (Arc::clone(&sent), Arc::clone(&stop));
            tokio::spawn(async move {
                for n in 0..FLOOD {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let text = format!("frame-{n:05}:{}", "x".repeat(FRAME));
                    sink.send(ClientMessage::text(text)).await.unwrap();
                    sent.fetch_add(1, Ordering::AcqRel);
                }
                sink
            })
        };
        // Wait until the sends stall (or all went through).
        let mut last = (0, Instant::now());
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = sent.load(Ordering::Acquire);
            if now == FLOOD || (now == last.0 && last.1.elapsed() > Duration::from_secs(2)) {
                break;
            }
            if now != last.0 {
                last = (now, Instant::now());
            }
        }
        stop.store(true, Ordering::Release);
        let held = sent.load(Ordering::Acquire);
        assert!(
            held < FLOOD,
            "the server read all {FLOOD} frames of 512 KiB during the wait"
        );
        release.notify_one();
        let mut sink = flood.await.unwrap();
        let total = sent.load(Ordering::Acquire);
        sink.send(ClientMessage::text("end")).await.unwrap();
        let (kept, kept_bytes, frames) = seen.await.unwrap();
        assert!(kept <= EARLY_FRAMES, "{kept} frames kept");
        assert!(
            kept_bytes <= EARLY_BYTES + FRAME + 20,
            "{kept_bytes} bytes kept"
        );
        assert!(kept >= EARLY_BYTES / (FRAME + 20), "{kept} frames kept");
        let expected: Vec<String> = (0..total).map(|n| format!("frame-{n:05}:")).collect();
        assert_eq!(
            frames, expected,
            "every frame, in order ({held} sent during the wait)"
        );
    }
}
