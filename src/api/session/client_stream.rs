//! The client's half of a socket, read also while a handshake waits.
//!
//! tungstenite answers a ping only while the socket's stream is read. A
//! create or attach can wait a long time for the controller (a restore, a
//! holder that checkpoints first, storage under load); a stream nobody reads
//! for that long leaves the client's pings unanswered, and the Python
//! `websockets` client closes after about 40 s of silence (a 20 s ping
//! interval plus a 20 s timeout). [`ClientStream::while_waiting`] reads the
//! socket during such a wait; frames that arrive meanwhile are kept, in
//! order, for the session, up to a bound per socket and within the
//! instance's [`EarlyBudget`], shared by every waiting socket. Beyond the
//! socket's bound the stream is not read until the session starts; a frame
//! the shared budget cannot give its bytes is kept all the same (it is read
//! already), and the stream is not read until the budget can (other
//! sessions take their frames) or the session starts. A flooding client
//! slows itself down, and many of them cannot hold more than the budget,
//! plus one frame each, between them.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket};
use futures::StreamExt;
use futures::stream::SplitStream;

use super::early_budget::{EarlyBudget, EarlyClaim};
use super::heard::Heard;
use crate::api::protocol::MAX_FRAME_BYTES;

/// At most this many frames are kept from a wait.
const EARLY_FRAMES: usize = 16;
/// And a socket stops reading once this many bytes of them are kept: one
/// frame of the largest valid size (a larger message, up to
/// `MAX_MESSAGE_BYTES`, is read whole but only its size is kept,
/// [`DroppedTooLarge`]).
const EARLY_BYTES: usize = MAX_FRAME_BYTES;

type Read = Result<Message, axum::Error>;

/// A frame kept from a wait, and its bytes' share of the budget (`None`
/// while the budget could not give them).
#[derive(Debug)]
struct Early {
    read: Read,
    claim: Option<EarlyClaim>,
}

/// The reading half of a client's socket.
#[derive(Debug)]
pub struct ClientStream {
    inner: SplitStream<WebSocket>,
    /// What was read while a handshake waited, oldest first.
    early: VecDeque<Early>,
    early_bytes: usize,
    /// The instance's budget for what waits keep.
    budget: EarlyBudget,
    /// This socket's own bound on the bytes kept ([`EARLY_BYTES`]).
    early_cap: usize,
    /// The socket ended during a wait.
    ended: bool,
    /// When the client was last heard from (the writer's keepalive).
    heard: Arc<Heard>,
}

impl ClientStream {
    pub fn new(inner: SplitStream<WebSocket>, heard: Arc<Heard>, budget: EarlyBudget) -> Self {
        Self {
            inner,
            early: VecDeque::new(),
            early_bytes: 0,
            budget,
            early_cap: EARLY_BYTES,
            ended: false,
            heard,
        }
    }

    /// Reads the socket, recording when the client is heard from.
    async fn read(&mut self) -> Option<Read> {
        Self::read_inner(&mut self.inner, &self.heard).await
    }

    /// The next message: first those kept from a wait (their bytes go back
    /// to the budget); `None` once the socket is done.
    pub async fn next(&mut self) -> Option<Read> {
        if let Some(early) = self.early.pop_front() {
            self.early_bytes = self.early_bytes.saturating_sub(size_of_read(&early.read));
            return Some(early.read);
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
            // A kept frame the budget could not give its bytes: the socket
            // is not read until it can.
            let unpaid = self
                .early
                .back()
                .filter(|early| early.claim.is_none())
                .map(|early| size_of_read(&early.read))
                .filter(|&bytes| bytes > 0);
            let room = !self.ended
                && unpaid.is_none()
                && self.early.len() < EARLY_FRAMES
                && self.early_bytes < self.early_cap;
            let budget = self.budget.clone();
            let paid = async move {
                match unpaid {
                    Some(bytes) => budget.claim(bytes).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                done = &mut wait => return done,
                claim = paid, if unpaid.is_some() => {
                    if let Some(early) = self.early.back_mut() {
                        early.claim = claim;
                    }
                    // A frame larger than the whole budget is never paid
                    // for: the socket stays unread until its session starts.
                    if self.early.back().is_some_and(|early| early.claim.is_none()) {
                        return wait.await;
                    }
                }
                read = Self::read_inner(&mut self.inner, &self.heard), if room => match read {
                    None => self.ended = true,
                    // Answered by tungstenite as it read them.
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(read) => {
                        let closing = matches!(read, Ok(Message::Close(_)) | Err(_));
                        let read = drop_too_large(read);
                        let bytes = size_of_read(&read);
                        self.early_bytes = self.early_bytes.saturating_add(bytes);
                        let claim = self.budget.take(bytes);
                        self.early.push_back(Early { read, claim });
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

/// A data frame larger than [`MAX_FRAME_BYTES`] read during a wait: only
/// its size is kept, for the session to answer it with an `error` event
/// (`next_message` turns it into `FrameError::TooLarge`), as it would one
/// read later. Messages up to `MAX_MESSAGE_BYTES` are read whole; keeping
/// them would let each waiting socket hold four times the largest frame.
#[derive(Debug, thiserror::Error)]
#[error("a frame of {0} bytes, more than {MAX_FRAME_BYTES}, was read and dropped")]
pub struct DroppedTooLarge(pub usize);

/// `read`, or in place of a data frame too large to be a request, its size.
fn drop_too_large(read: Read) -> Read {
    match read {
        Ok(Message::Text(text)) if text.len() > MAX_FRAME_BYTES => {
            Err(axum::Error::new(DroppedTooLarge(text.len())))
        }
        Ok(Message::Binary(data)) if data.len() > MAX_FRAME_BYTES => {
            Err(axum::Error::new(DroppedTooLarge(data.len())))
        }
        read => read,
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
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use axum::extract::ws::WebSocketUpgrade;
    use futures::SinkExt;
    use futures::stream::SplitSink;
    use tokio::net::TcpStream;
    use tokio::sync::{Notify, oneshot};
    use tokio::task::JoinHandle;
    use tokio_tungstenite::tungstenite::Message as ClientMessage;
    use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

    use super::*;
    use crate::api::protocol::FrameError;
    use crate::api::session::{Incoming, next_message};

    /// Bytes per frame the client sends: 2 fill [`EARLY_BYTES`].
    const FRAME: usize = 512 << 10;
    /// Frames the client tries to send while the handshake waits.
    const FLOOD: usize = 100;
    /// The numbered prefix of each frame (`frame-00042:`).
    const PREFIX: usize = 12;

    /// What the server saw on one socket: frames kept during the wait,
    /// their bytes, then every frame read after it (up to "end").
    type Seen = (usize, usize, Vec<String>);

    /// One socket's handshake on the test server: it waits until
    /// `release`, and the socket's frames are then taken (or, without
    /// `take`, the stream is dropped with what it kept).
    struct Waiter {
        release: Arc<Notify>,
        take: bool,
        report: oneshot::Sender<Seen>,
    }

    fn waiter(take: bool) -> (Waiter, Arc<Notify>, oneshot::Receiver<Seen>) {
        let release = Arc::new(Notify::new());
        let (report, seen) = oneshot::channel();
        let waiter = Waiter {
            release: Arc::clone(&release),
            take,
            report,
        };
        (waiter, release, seen)
    }

    /// A server whose n-th socket's handshake is the n-th waiter's, reading
    /// the socket meanwhile within `budget` (and, if given, a bound per
    /// socket other than [`EARLY_BYTES`]).
    async fn server(budget: EarlyBudget, cap: Option<usize>, waiters: Vec<Waiter>) -> String {
        let waiters = Arc::new(Mutex::new(VecDeque::from(waiters)));
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move |upgrade: WebSocketUpgrade| {
                let waiter = waiters.lock().unwrap().pop_front().unwrap();
                let budget = budget.clone();
                async move {
                    upgrade.on_upgrade(move |socket| async move {
                        let (_sink, stream) = socket.split();
                        let heard = Heard::new(Arc::new(controllers::clock::SystemClock));
                        let mut stream = ClientStream::new(stream, heard, budget);
                        stream.early_cap = cap.unwrap_or(EARLY_BYTES);
                        stream.while_waiting(waiter.release.notified()).await;
                        let kept = (stream.early.len(), stream.early_bytes);
                        let mut frames = Vec::new();
                        if !waiter.take {
                            drop(stream);
                        } else {
                            // As the session reads them.
                            while let Some(read) = next_message(&mut stream).await {
                                match read {
                                    Ok(Incoming::Text(text)) if text == "end" => break,
                                    Ok(Incoming::Text(text)) => {
                                        let prefix = text.get(..PREFIX).unwrap_or_default();
                                        frames.push(prefix.to_owned());
                                    }
                                    other => frames.push(format!("{other:?}")),
                                }
                            }
                        }
                        let _ = waiter.report.send((kept.0, kept.1, frames));
                    })
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("ws://{addr}/")
    }

    type Sink = SplitSink<WebSocketStream<MaybeTlsStream<TcpStream>>, ClientMessage>;

    /// A client sending numbered frames of `size` bytes, up to `count`,
    /// until stopped.
    struct Flood {
        sent: Arc<AtomicUsize>,
        stop: Arc<AtomicBool>,
        task: JoinHandle<Sink>,
        count: usize,
    }

    async fn flood(url: &str, size: usize, count: usize) -> Flood {
        let (socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        // The reading half is dropped: the server writes nothing here.
        let (mut sink, _stream) = socket.split();
        let sent = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (sent, stop) = (Arc::clone(&sent), Arc::clone(&stop));
            tokio::spawn(async move {
                for n in 0..count {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let text = format!("frame-{n:05}:{}", "x".repeat(size));
                    sink.send(ClientMessage::text(text)).await.unwrap();
                    sent.fetch_add(1, Ordering::AcqRel);
                }
                sink
            })
        };
        Flood {
            sent,
            stop,
            task,
            count,
        }
    }

    impl Flood {
        /// Waits until the sends stall (or all went through); how many went.
        async fn stalled(&self) -> usize {
            let mut last = (self.sent.load(Ordering::Acquire), Instant::now());
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let now = self.sent.load(Ordering::Acquire);
                if now == self.count || (now == last.0 && last.1.elapsed() > Duration::from_secs(2))
                {
                    return now;
                }
                if now != last.0 {
                    last = (now, Instant::now());
                }
            }
        }

        /// Stops sending once the send under way is through, then sends
        /// "end"; how many frames went before it.
        async fn end(self) -> usize {
            self.stop.store(true, Ordering::Release);
            let mut sink = self.task.await.unwrap();
            sink.send(ClientMessage::text("end")).await.unwrap();
            self.sent.load(Ordering::Acquire)
        }
    }

    fn numbered(count: usize) -> Vec<String> {
        (0..count).map(|n| format!("frame-{n:05}:")).collect()
    }

    /// Frames a client sends while a create or attach waits are kept for the
    /// session up to the bound; beyond it the socket is not read (the
    /// client's sends stall); once the wait ends every frame arrives, in
    /// order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_sent_during_a_wait_are_kept_up_to_the_bound_and_none_is_lost() {
        let (waiter, release, seen) = waiter(true);
        let url = server(EarlyBudget::default(), None, vec![waiter]).await;
        let client = flood(&url, FRAME, FLOOD).await;
        let held = client.stalled().await;
        assert!(
            held < FLOOD,
            "the server read all {FLOOD} frames of 512 KiB during the wait"
        );
        release.notify_one();
        let total = client.end().await;
        let (kept, kept_bytes, frames) = seen.await.unwrap();
        assert!(kept <= EARLY_FRAMES, "{kept} frames kept");
        assert!(
            kept_bytes <= EARLY_BYTES + FRAME + PREFIX,
            "{kept_bytes} bytes kept"
        );
        assert!(kept >= EARLY_BYTES / (FRAME + PREFIX), "{kept} frames kept");
        assert_eq!(
            frames,
            numbered(total),
            "every frame, in order ({held} sent during the wait)"
        );
    }

    /// Waiting sockets share the instance's budget: once one has spent it,
    /// the next keeps the frame it read and reads no further; when the
    /// first's session takes its frames their bytes come back, and the
    /// second reads on while its handshake still waits. Every frame of both
    /// arrives, in order, and the budget is whole again at the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_sockets_share_one_budget_and_read_on_when_bytes_come_back() {
        /// 8 fill a socket's own bound; the budget holds 4.
        const SMALL: usize = 128 << 10;
        const MANY: usize = 400;
        let budget = EarlyBudget::new(4 * (SMALL + PREFIX));
        let (first, first_release, first_seen) = waiter(true);
        let (second, second_release, second_seen) = waiter(true);
        let url = server(budget.clone(), None, vec![first, second]).await;

        let a = flood(&url, SMALL, MANY).await;
        let a_held = a.stalled().await;
        assert!(a_held < MANY, "the first socket was read to the end");
        assert_eq!(budget.available(), 0, "the first socket left bytes");

        let b = flood(&url, SMALL, MANY).await;
        let b_held = b.stalled().await;
        assert!(b_held < MANY, "the second socket was read to the end");

        first_release.notify_one();
        let a_total = a.end().await;
        let (a_kept, _, a_frames) = first_seen.await.unwrap();
        assert_eq!(a_kept, 5, "the first socket kept 4 frames paid for, 1 not");
        assert_eq!(a_frames, numbered(a_total), "the first socket's frames");

        // The second socket reads on, its handshake still waiting: it takes
        // the bytes the first gave back. (Counted on the server: the
        // client's sends may not move, the freed room going to what its
        // socket buffers held.)
        let deadline = Instant::now() + Duration::from_secs(10);
        while budget.available() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            budget.available(),
            0,
            "the second socket was not read on when bytes came back ({b_held} sent)"
        );

        second_release.notify_one();
        let b_total = b.end().await;
        let (b_kept, _, b_frames) = second_seen.await.unwrap();
        assert_eq!(b_kept, 5, "the second socket kept 1 frame, then 4 more");
        assert_eq!(b_frames, numbered(b_total), "the second socket's frames");
        assert_eq!(budget.available(), budget.total(), "bytes not given back");
    }

    /// A socket dropped with frames kept (its handshake failed, say) gives
    /// their bytes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_dropped_with_frames_kept_gives_their_bytes_back() {
        let budget = EarlyBudget::new(8 << 20);
        let (waiter, release, seen) = waiter(false);
        let url = server(budget.clone(), None, vec![waiter]).await;
        let client = flood(&url, FRAME, FLOOD).await;
        client.stalled().await;
        assert!(budget.available() < budget.total(), "nothing was kept");
        release.notify_one();
        let (kept, kept_bytes, _) = seen.await.unwrap();
        assert!(kept > 0 && kept_bytes > 0, "nothing was kept");
        assert_eq!(budget.available(), budget.total(), "bytes not given back");
        drop(client);
    }

    /// A frame larger than a request may be, read during a wait, is kept as
    /// its size only: the session still answers it as too large, in its
    /// place among the frames, and the socket reads on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frame_too_large_read_during_a_wait_keeps_only_its_size() {
        let budget = EarlyBudget::new(8 << 20);
        let (waiter, release, seen) = waiter(true);
        let url = server(budget.clone(), None, vec![waiter]).await;
        let (socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        let (mut sink, _stream) = socket.split();
        let large = format!("frame-00000:{}", "x".repeat(3 << 20));
        sink.send(ClientMessage::text(large)).await.unwrap();
        sink.send(ClientMessage::text("frame-00001:x"))
            .await
            .unwrap();
        // Both read while the handshake waits: nothing of the first kept.
        let deadline = Instant::now() + Duration::from_secs(10);
        while budget.available() == budget.total() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(budget.available(), budget.total() - 13, "bytes kept");
        release.notify_one();
        // "end" only once the session took the kept frame (its bytes are
        // back): the socket still had room, so an "end" sent at the release
        // could be read, and kept, before the wait saw its end.
        let deadline = Instant::now() + Duration::from_secs(10);
        while budget.available() < budget.total() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sink.send(ClientMessage::text("end")).await.unwrap();
        let (kept, kept_bytes, frames) = seen.await.unwrap();
        assert_eq!((kept, kept_bytes), (2, 13));
        let too_large = format!(
            "{:?}",
            Err::<Incoming, _>(FrameError::TooLarge(12 + (3 << 20)))
        );
        assert_eq!(frames, vec![too_large, "frame-00001:".to_owned()]);
    }
}
