//! The server's connections, counted and limited (as mini-redis's
//! `server.rs` does with a semaphore): every accepted socket holds a permit
//! for as long as it lives, and that includes a WebSocket session, whose
//! upgraded connection keeps the socket. So the server knows when its last
//! client is gone, and a flood of connections waits at `accept` instead of
//! exhausting file descriptors.
//!
//! A connection must earn its permit ([`ConnectionDeadlines`]): one whose
//! request headers take longer than the header-read timeout, or that sits
//! with no request in flight (it never sent one, or is between keep-alive
//! requests) for the idle timeout, is closed. And when every permit is
//! taken, the connection idle the longest is closed to make room, so idle
//! sockets never keep a request out. A connection serving a request has
//! two deadlines of its own, so that a client cannot hold one by being
//! slow: its request body must arrive at [`MIN_BODY_BYTES_PER_SECOND`],
//! counted over the time the server spends reading it, after an allowance of the
//! header-read timeout ([`track_requests`]); and a response the client
//! stops reading is cut off once a write has made no progress for the idle
//! timeout. A connection upgraded to a WebSocket has no deadline here: its
//! session checks its liveness by pings and its writes by their own stall
//! timeout (`api/session/out.rs`).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::extract::Request;
use axum::extract::connect_info::Connected;
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::IncomingStream;
use controllers::clock::Clock;
use futures::task::AtomicWaker;

use crate::api::caller::ClientAddr;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Default of [`ConnectionDeadlines::header_read`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`ConnectionDeadlines::idle`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection may take to become a request
/// (`--header-read-timeout-s`, `--connection-idle-timeout-s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionDeadlines {
    /// From a request's first byte to its complete headers.
    pub header_read: Duration,
    /// With no request in flight and nothing received.
    pub idle: Duration,
}

impl Default for ConnectionDeadlines {
    fn default() -> Self {
        Self {
            header_read: DEFAULT_HEADER_READ_TIMEOUT,
            idle: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// The least rate at which a request's body must arrive, counted over the
/// time the server spends reading it (beyond the header-read timeout, allowed
/// once): a body slower than this is cut off, the request fails and the
/// connection closes. A client holding a connection by a trickling body
/// must send this much every second on each.
pub const MIN_BODY_BYTES_PER_SECOND: u64 = 4096;

/// Milliseconds after the server's epoch; `NEVER` for "not set".
const NEVER: u64 = u64::MAX;

/// The most bytes of a request's headers (request line included, up to the
/// blank line). hyper buffers up to about 400 KiB of them per connection,
/// and every connection at the limit could hold that for the header-read
/// timeout; clients here send a few KiB (an ID token, the sandbox token). A
/// connection whose headers run past it is closed without an answer.
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// How far a connection's current request's headers have come: their bytes
/// so far, and where the last read left off in its line (the blank line
/// that ends them may straddle two reads). Kept by the connection's reader
/// alone, one byte at a time, without copying a read.
///
/// A line ends at `\n`, with or without `\r` (the HTTP parser takes both).
/// Empty lines before the request line do not end the headers: the parser
/// skips any number of them, so counting stopped there would let the
/// headers after them past the bound.
#[derive(Debug, Default)]
struct HeaderScan {
    bytes: usize,
    /// A byte other than `\r` and `\n` came: the request line began.
    began: bool,
    /// No such byte since the last `\n`.
    at_line_start: bool,
    ended: bool,
}

impl HeaderScan {
    /// Counts `read` as header bytes up to the blank line that ends them;
    /// false once they run past [`MAX_HEADER_BYTES`].
    fn count(&mut self, read: &[u8]) -> bool {
        for &byte in read {
            if self.ended {
                break;
            }
            self.bytes = self.bytes.saturating_add(1);
            match byte {
                b'\n' if self.began && self.at_line_start => self.ended = true,
                b'\n' => self.at_line_start = true,
                b'\r' => {}
                _ => (self.began, self.at_line_start) = (true, false),
            }
            if self.bytes > MAX_HEADER_BYTES {
                return false;
            }
        }
        true
    }
}

/// What a connection's request handling and its socket share.
#[derive(Debug)]
struct Activity {
    /// The server's clock (its deadlines are read on it).
    clock: Arc<dyn Clock>,
    epoch: Instant,
    /// Requests being handled now.
    in_flight: AtomicUsize,
    /// Upgraded to a WebSocket: no deadline here any more.
    upgraded: AtomicBool,
    /// Asked to close (to make room for a new connection).
    shed: AtomicBool,
    /// When bytes last went either way.
    last_active: AtomicU64,
    /// When the first byte of a request not yet handled arrived.
    request_began: AtomicU64,
    /// The socket's reader, woken when the connection is shed.
    waker: AtomicWaker,
}

impl Activity {
    fn new(clock: Arc<dyn Clock>, epoch: Instant) -> Self {
        let activity = Self {
            clock,
            epoch,
            in_flight: AtomicUsize::new(0),
            upgraded: AtomicBool::new(false),
            shed: AtomicBool::new(false),
            last_active: AtomicU64::new(0),
            request_began: AtomicU64::new(NEVER),
            waker: AtomicWaker::new(),
        };
        activity.active();
        activity
    }

    fn now(&self) -> u64 {
        let elapsed = self.clock.instant().saturating_duration_since(self.epoch);
        u64::try_from(elapsed.as_millis()).unwrap_or(NEVER - 1)
    }

    fn active(&self) {
        self.last_active.store(self.now(), Ordering::Release);
    }

    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0 || self.upgraded.load(Ordering::Acquire)
    }

    /// No request in flight and no request begun: may be shed.
    fn idle(&self) -> bool {
        !self.busy() && self.request_began.load(Ordering::Acquire) == NEVER
    }

    /// When this connection's deadline falls, if it has one.
    fn deadline(&self, deadlines: ConnectionDeadlines) -> Option<(Instant, &'static str)> {
        if self.busy() {
            return None;
        }
        let at = |ms: u64, after: Duration| self.epoch + Duration::from_millis(ms) + after;
        match self.request_began.load(Ordering::Acquire) {
            NEVER => Some((
                at(self.last_active.load(Ordering::Acquire), deadlines.idle),
                "idle",
            )),
            began => Some((at(began, deadlines.header_read), "header read")),
        }
    }

    fn shed(&self) {
        self.shed.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// The connections of one server: at most `limit` at once.
#[derive(Debug, Clone)]
pub struct Connections {
    permits: Arc<Semaphore>,
    limit: u32,
    deadlines: ConnectionDeadlines,
    clock: Arc<dyn Clock>,
    epoch: Instant,
    /// Every open connection's activity, to find the one to shed.
    open: Arc<Mutex<Vec<Weak<Activity>>>>,
}

impl Connections {
    /// At most `limit` connections, with the default deadlines, timed by
    /// `clock`.
    pub fn new(limit: u32, clock: Arc<dyn Clock>) -> Self {
        Self::with_deadlines(limit, ConnectionDeadlines::default(), clock)
    }

    /// At most `limit` connections, each within `deadlines` on `clock`.
    pub fn with_deadlines(
        limit: u32,
        deadlines: ConnectionDeadlines,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let limit = limit.max(1);
        Self {
            permits: Arc::new(Semaphore::new(limit as usize)),
            limit,
            deadlines,
            epoch: clock.instant(),
            clock,
            open: Arc::default(),
        }
    }

    /// Connections open now (WebSocket sessions included).
    pub fn open(&self) -> usize {
        (self.limit as usize).saturating_sub(self.permits.available_permits())
    }

    /// Waits until every connection has closed, `grace` at most; how many
    /// were still open then.
    pub async fn closed(&self, grace: Duration) -> usize {
        match tokio::time::timeout(grace, self.permits.acquire_many(self.limit)).await {
            Ok(Ok(all)) => {
                drop(all);
                0
            }
            _ => self.open(),
        }
    }

    /// `listener`, accepting only while a connection may be opened.
    pub(super) fn listen(&self, listener: TcpListener) -> Tracked {
        Tracked {
            listener,
            connections: self.clone(),
        }
    }

    /// Closes the connection idle the longest, if one is; true if one was.
    fn shed_one(&self) -> bool {
        let Ok(mut open) = self.open.lock() else {
            return false;
        };
        open.retain(|activity| activity.strong_count() > 0);
        let oldest = open
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|activity| activity.idle() && !activity.shed.load(Ordering::Acquire))
            .min_by_key(|activity| activity.last_active.load(Ordering::Acquire));
        match oldest {
            Some(activity) => {
                activity.shed();
                true
            }
            None => false,
        }
    }

    /// A permit for a new connection: at once if one is free, else after
    /// the connection idle the longest was closed, else when one closes.
    async fn permit(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() {
            return Some(permit);
        }
        if self.shed_one() {
            tracing::info!(
                limit = self.limit,
                "at the connection limit: closing the connection idle the longest"
            );
        }
        Arc::clone(&self.permits).acquire_owned().await.ok()
    }
}

/// A listener whose sockets hold a permit of their [`Connections`].
#[derive(Debug)]
pub(super) struct Tracked {
    listener: TcpListener,
    connections: Connections,
}

impl axum::serve::Listener for Tracked {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: wait, as axum does.
                Err(err) => {
                    tracing::error!(%err, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            // At the limit the idlest connection is closed, or this socket
            // waits for one to close, and the next ones wait in the listen
            // backlog. The semaphore is never closed.
            let Some(permit) = self.connections.permit().await else {
                continue;
            };
            // The protocol is many small frames (`EXECUTION_RUNNING`, a short
            // `stdout`, `exit_code`, `DONE`): with Nagle's algorithm each one
            // after the first waits for the client's delayed ACK (about 40 ms
            // with the Python and TypeScript clients).
            if let Err(err) = stream.set_nodelay(true) {
                tracing::warn!(%err, "cannot set TCP_NODELAY on an accepted socket");
            }
            let activity = Arc::new(Activity::new(
                Arc::clone(&self.connections.clock),
                self.connections.epoch,
            ));
            if let Ok(mut open) = self.connections.open.lock() {
                // Closed connections' entries go once they outnumber the limit.
                if open.len() >= 2 * self.connections.limit as usize {
                    open.retain(|activity| activity.strong_count() > 0);
                }
                open.push(Arc::downgrade(&activity));
            }
            return (
                Connection {
                    stream,
                    activity,
                    deadlines: self.connections.deadlines,
                    timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
                    write_stalled_since: None,
                    write_timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
                    headers: HeaderScan::default(),
                    _permit: permit,
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// An accepted socket, its deadlines, and its permit, released when the
/// socket is dropped.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    activity: Arc<Activity>,
    deadlines: ConnectionDeadlines,
    timer: Pin<Box<Sleep>>,
    /// Since when writes have made no progress (`None`: the last one did).
    write_stalled_since: Option<Instant>,
    write_timer: Pin<Box<Sleep>>,
    /// The headers of the request being read ([`MAX_HEADER_BYTES`]).
    headers: HeaderScan,
    _permit: OwnedSemaphorePermit,
}

impl Connection {
    /// The error that ends a connection past its deadline or shed.
    fn expired(&self, what: &str) -> io::Error {
        tracing::debug!(what, "closing a connection");
        io::Error::new(io::ErrorKind::TimedOut, format!("{what} timeout"))
    }
}

/// Who is on the other end of a request's connection, and its activity
/// (a request extension, `ConnectInfo<Peer>`).
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    activity: Arc<Activity>,
    deadlines: ConnectionDeadlines,
}

impl Connected<IncomingStream<'_, Tracked>> for Peer {
    fn connect_info(stream: IncomingStream<'_, Tracked>) -> Self {
        Self {
            addr: *stream.remote_addr(),
            activity: Arc::clone(&stream.io().activity),
            deadlines: stream.io().deadlines,
        }
    }
}

/// Middleware: a request in flight, until its response's body is sent,
/// suspends its connection's idle and header deadlines (its body gets one
/// of its own, [`body_at_least`], and stalled writes end it), and a
/// WebSocket upgrade ends them.
/// The request gets the client's address ([`ClientAddr`]) as an extension.
pub async fn track_requests(request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<ConnectInfo<Peer>>().cloned();
    let Some(ConnectInfo(peer)) = peer else {
        return next.run(request).await;
    };
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(ClientAddr(peer.addr));
    let clock = Arc::clone(&peer.activity.clock);
    let body = body_at_least(body, clock, peer.deadlines.header_read);
    let request = Request::from_parts(parts, body);
    let activity = peer.activity;
    activity.request_began.store(NEVER, Ordering::Release);
    activity.in_flight.fetch_add(1, Ordering::AcqRel);
    let in_flight = InFlight(Arc::clone(&activity));
    let response = next.run(request).await;
    if response.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS {
        activity.upgraded.store(true, Ordering::Release);
    }
    // In flight until its body is sent: a streamed answer (`/execute`'s
    // output) may be quiet longer than the idle timeout.
    response.map(|body| {
        axum::body::Body::new(Sending {
            body,
            _in_flight: in_flight,
        })
    })
}

/// A request counted in flight on its connection until dropped (its
/// response's body sent, or the request abandoned).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.active();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight while it is sent.
struct Sending {
    body: axum::body::Body,
    _in_flight: InFlight,
}

impl http_body::Body for Sending {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// `body`, cut off with an error once the time the server has spent
/// reading it exceeds `allowance` plus a second per
/// [`MIN_BODY_BYTES_PER_SECOND`] received, or once it waited `allowance`
/// for the next piece: time earned by a prompt start is not banked for a
/// silence (a client that sent 2 MiB at once and then nothing would
/// otherwise hold its request, and what it sent, for eight and a half
/// minutes). Time counts from the handler's
/// first read of each piece to the piece: a handler that reads its body
/// late (after a restore, say) costs the client nothing, the client's bytes
/// waiting in TCP meanwhile; one that keeps reading while it writes earlier
/// pieces elsewhere counts that time too, which at this rate is slack.
fn body_at_least(
    body: axum::body::Body,
    clock: Arc<dyn Clock>,
    allowance: Duration,
) -> axum::body::Body {
    use futures::StreamExt as _;
    struct Arriving {
        stream: axum::body::BodyDataStream,
        clock: Arc<dyn Clock>,
        received: u64,
        waited: Duration,
        ended: bool,
    }
    let arriving = Arriving {
        stream: body.into_data_stream(),
        clock,
        received: 0,
        waited: Duration::ZERO,
        ended: false,
    };
    let pieces = futures::stream::unfold(arriving, move |mut body| async move {
        if body.ended {
            return None;
        }
        let earned =
            Duration::from_millis(body.received.saturating_mul(1000) / MIN_BODY_BYTES_PER_SECOND);
        let left = (allowance + earned)
            .saturating_sub(body.waited)
            .min(allowance);
        let asked = body.clock.instant();
        let next = tokio::time::timeout_at(asked + left, body.stream.next()).await;
        body.waited += body.clock.instant().saturating_duration_since(asked);
        match next {
            Ok(Some(Ok(piece))) => {
                body.received = body
                    .received
                    .saturating_add(u64::try_from(piece.len()).unwrap_or(u64::MAX));
                Some((Ok(piece), body))
            }
            Ok(Some(Err(err))) => {
                body.ended = true;
                Some((Err(err), body))
            }
            Ok(None) => None,
            Err(_) => {
                body.ended = true;
                tracing::debug!(
                    received = body.received,
                    "a request body arrived too slowly"
                );
                let slow = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the request body arrived slower than {MIN_BODY_BYTES_PER_SECOND} bytes a second"
                    ),
                );
                Some((Err(axum::Error::new(slow)), body))
            }
        }
    });
    axum::body::Body::from_stream(pieces)
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.activity.shed.load(Ordering::Acquire) {
            return Poll::Ready(Err(self.expired("shed at the connection limit")));
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let this = &mut *self;
                    let activity = &this.activity;
                    activity.active();
                    if !activity.busy() {
                        if activity.request_began.load(Ordering::Acquire) == NEVER {
                            activity
                                .request_began
                                .store(activity.now(), Ordering::Release);
                            this.headers = HeaderScan::default();
                        }
                        if !this.headers.count(&buf.filled()[before..]) {
                            tracing::debug!(
                                "closing a connection whose request headers are too large"
                            );
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!("request headers larger than {MAX_HEADER_BYTES} bytes"),
                            )));
                        }
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Pending => {
                self.activity.waker.register(cx.waker());
                if self.activity.shed.load(Ordering::Acquire) {
                    return Poll::Ready(Err(self.expired("shed at the connection limit")));
                }
                let Some((deadline, what)) = self.activity.deadline(self.deadlines) else {
                    return Poll::Pending;
                };
                if self.activity.clock.instant() >= deadline {
                    return Poll::Ready(Err(self.expired(what)));
                }
                self.timer.as_mut().reset(deadline);
                match self.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(self.expired(what))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl Connection {
    /// Notes how a write went: progress ends a stall; a write that cannot
    /// go on (the client reads nothing) fails once it has waited for the
    /// idle timeout, unless the connection is a WebSocket's (its session
    /// times its own writes).
    fn write_went(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match &written {
            Poll::Ready(Ok(n)) if *n > 0 => {
                self.activity.active();
                self.write_stalled_since = None;
            }
            Poll::Pending if !self.activity.upgraded.load(Ordering::Acquire) => {
                let now = self.activity.clock.instant();
                let deadline = *self.write_stalled_since.get_or_insert(now) + self.deadlines.idle;
                if now >= deadline {
                    return Poll::Ready(Err(self.expired("write stall")));
                }
                self.write_timer.as_mut().reset(deadline);
                if self.write_timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(self.expired("write stall")));
                }
            }
            _ => {}
        }
        written
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.write_went(cx, written)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.write_went(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A server on `connections` whose `POST /echo` answers its body's
    /// length and whose `GET /big` answers 256 MiB; its address.
    async fn serve(connections: &Connections) -> SocketAddr {
        use axum::routing::{get, post};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new()
            .route(
                "/echo",
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
            )
            .route(
                "/big",
                get(|| async {
                    let piece = axum::body::Bytes::from(vec![0_u8; 1 << 20]);
                    let pieces = futures::stream::iter(
                        (0..256).map(move |_| Ok::<_, io::Error>(piece.clone())),
                    );
                    axum::body::Body::from_stream(pieces)
                }),
            )
            .route(
                "/quiet",
                get(|| async {
                    let later = futures::stream::once(async {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        Ok::<_, io::Error>(axum::body::Bytes::from_static(b"late"))
                    });
                    axum::body::Body::from_stream(later)
                }),
            )
            .layer(axum::extract::DefaultBodyLimit::max(8 << 20))
            .layer(axum::middleware::from_fn(track_requests))
            .into_make_service_with_connect_info::<Peer>();
        let tracked = connections.listen(listener);
        tokio::spawn(async move { axum::serve(tracked, app).await });
        addr
    }

    fn quick(limit: u32) -> Connections {
        let deadlines = ConnectionDeadlines {
            header_read: Duration::from_secs(1),
            idle: Duration::from_secs(1),
        };
        Connections::with_deadlines(limit, deadlines, Arc::new(controllers::clock::SystemClock))
    }

    /// Everything `stream` still gives until it ends, within `within`.
    async fn rest_of(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
        let mut all = Vec::new();
        tokio::time::timeout(within, async {
            let mut buf = [0_u8; 4096];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => all.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await
        .ok()?;
        Some(all)
    }

    #[test]
    fn headers_are_counted_to_their_blank_line_also_across_reads() {
        let mut scan = HeaderScan::default();
        assert!(scan.count(b"GET / HTTP/1.1\r\nHost: x\r"));
        assert!(scan.count(b"\n\r"));
        assert!(!scan.ended);
        assert!(scan.count(b"\nbody bytes"));
        assert!(scan.ended);
        assert_eq!(scan.bytes, "GET / HTTP/1.1\r\nHost: x\r\n\r\n".len());
        assert!(
            scan.count(&vec![b'y'; 2 * MAX_HEADER_BYTES]),
            "a body is not counted"
        );

        let mut scan = HeaderScan::default();
        assert!(scan.count(&vec![b'h'; MAX_HEADER_BYTES]));
        assert!(!scan.count(b"h"), "one byte past the bound");

        // Lines ended by a bare `\n` end their headers the same way.
        let mut scan = HeaderScan::default();
        assert!(scan.count(b"GET / HTTP/1.1\nHost: x\n\nbody"));
        assert_eq!(scan.bytes, "GET / HTTP/1.1\nHost: x\n\n".len());

        // Empty lines before the request line (the parser skips them) end
        // nothing: what follows them is counted.
        let mut scan = HeaderScan::default();
        assert!(scan.count(b"\r\n\r\n\n"));
        assert!(!scan.ended);
        assert!(!scan.count(&vec![b'h'; MAX_HEADER_BYTES]));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn headers_past_the_bound_close_the_connection_and_large_ones_within_it_are_served() {
        let deadlines = ConnectionDeadlines {
            header_read: Duration::from_secs(30),
            idle: Duration::from_secs(30),
        };
        let clock = Arc::new(controllers::clock::SystemClock);
        let connections = Connections::with_deadlines(8, deadlines, clock);
        let addr = serve(&connections).await;
        let request = |header_bytes: usize, body: usize| {
            let mut request = b"POST /echo HTTP/1.1\r\nHost: x\r\n".to_vec();
            let line = format!("X-Filler: {}\r\n", "f".repeat(1000));
            for _ in 0..header_bytes / line.len() {
                request.extend_from_slice(line.as_bytes());
            }
            request.extend_from_slice(
                format!("Content-Length: {body}\r\nConnection: close\r\n\r\n").as_bytes(),
            );
            request.extend(std::iter::repeat_n(b'y', body));
            request
        };

        // Headers of 60 KiB, a body of 1 MiB sent with them: answered.
        let mut within = TcpStream::connect(addr).await.unwrap();
        within.write_all(&request(60 << 10, 1 << 20)).await.unwrap();
        let answer = rest_of(&mut within, Duration::from_secs(10)).await.unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        assert!(
            answer.contains("200 OK") && answer.ends_with(&(1 << 20).to_string()),
            "{answer}"
        );

        // Headers past the bound: closed without an answer, at once (not at
        // the header-read timeout).
        let mut past = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        // The server may close before every byte is written.
        let _ = past
            .write_all(&request(MAX_HEADER_BYTES + (8 << 10), 0))
            .await;
        let answer = rest_of(&mut past, Duration::from_secs(10)).await;
        let answer = String::from_utf8_lossy(&answer.unwrap_or_default()).into_owned();
        assert!(!answer.contains("200 OK"), "{answer}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "closed after {:?}: at the header-read timeout (30 s), not at the bound",
            started.elapsed()
        );

        // Empty lines before the request line, which the parser skips, do
        // not let the headers after them past the bound.
        let mut prefixed = TcpStream::connect(addr).await.unwrap();
        let mut bytes = b"\r\n\r\n".to_vec();
        bytes.extend(request(MAX_HEADER_BYTES + (8 << 10), 0));
        let _ = prefixed.write_all(&bytes).await;
        let answer = rest_of(&mut prefixed, Duration::from_secs(10)).await;
        let answer = String::from_utf8_lossy(&answer.unwrap_or_default()).into_owned();
        assert!(!answer.contains("200 OK"), "{answer}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_trickling_request_body_is_cut_off_and_a_prompt_one_is_not() {
        let connections = quick(8);
        let addr = serve(&connections).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let trickle = tokio::spawn(async move {
            // Ten bytes a second, far below the least rate, for 20 s at most.
            for _ in 0..200 {
                if slow.write_all(b"x").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            slow
        });
        let mut slow = trickle.await.unwrap();
        let answer = rest_of(&mut slow, Duration::from_secs(5)).await;
        let answer =
            String::from_utf8_lossy(&answer.expect("the connection was closed")).into_owned();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "a body at ten bytes a second held its connection for {:?}",
            started.elapsed()
        );
        assert!(!answer.contains("200 OK"), "{answer}");

        // A prompt body of 1 MiB is read whole.
        let mut prompt = TcpStream::connect(addr).await.unwrap();
        let body = vec![b'y'; 1 << 20];
        prompt
            .write_all(
                format!("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())
                    .as_bytes(),
            )
            .await
            .unwrap();
        prompt.write_all(&body).await.unwrap();
        let answer = rest_of(&mut prompt, Duration::from_secs(10)).await.unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        assert!(
            answer.contains("200 OK") && answer.ends_with("1048576"),
            "{answer}"
        );
    }

    /// A body that starts promptly and then goes silent is cut off one
    /// allowance into the silence, not when the time its first bytes
    /// earned runs out (64 KiB earn 16 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_that_stops_halfway_is_cut_off_one_allowance_into_its_silence() {
        let connections = quick(8);
        let addr = serve(&connections).await;
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            .await
            .unwrap();
        stalled.write_all(&[b'x'; 64 << 10]).await.unwrap();
        let started = std::time::Instant::now();
        let answer = rest_of(&mut stalled, Duration::from_secs(10)).await;
        let answer =
            String::from_utf8_lossy(&answer.expect("the connection was not closed")).into_owned();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a silent body held its connection for {:?}",
            started.elapsed()
        );
        assert!(!answer.contains("200 OK"), "{answer}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quiet_response_its_client_waits_for_is_not_cut_off() {
        let connections = quick(8);
        let addr = serve(&connections).await;
        let mut patient = TcpStream::connect(addr).await.unwrap();
        patient
            .write_all(b"GET /quiet HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = rest_of(&mut patient, Duration::from_secs(10))
            .await
            .unwrap();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        assert!(answer.contains("late"), "{answer:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_response_its_client_does_not_read_is_cut_off_and_frees_the_connection() {
        let connections = quick(8);
        let addr = serve(&connections).await;
        let mut deaf = TcpStream::connect(addr).await.unwrap();
        deaf.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // The answer has begun (peeked, so nothing is read): the connection
        // was served, and its closing below is not that of one never opened.
        let mut head = [0_u8; 12];
        let peeked = tokio::time::timeout(Duration::from_secs(10), deaf.peek(&mut head))
            .await
            .expect("no answer began")
            .unwrap();
        let head = String::from_utf8_lossy(&head[..peeked]).into_owned();
        assert!(peeked > 0 && "HTTP/1.1 200".starts_with(&head), "{head:?}");
        // It reads nothing; the server's writes stall once the socket
        // buffers are full, and the idle timeout (1 s) later it gives up.
        let freed = tokio::time::timeout(Duration::from_secs(10), async {
            while connections.open() > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(
            freed.is_ok(),
            "a client that reads nothing kept its connection"
        );
        drop(deaf);
    }

    #[tokio::test]
    async fn a_socket_holds_its_permit_until_dropped_and_the_limit_makes_accept_wait() {
        let connections = Connections::new(1, Arc::new(controllers::clock::SystemClock));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut tracked = connections.listen(listener);
        assert_eq!(connections.open(), 0);
        let _first = TcpStream::connect(addr).await.unwrap();
        let (socket, _) = tracked.accept().await;
        assert_eq!(connections.open(), 1);
        // At the limit: the next socket is not handed over.
        let _second = TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(200), tracked.accept()).await;
        assert!(waiting.is_err(), "accepted past the limit");
        assert_eq!(connections.closed(Duration::from_millis(50)).await, 1);
        drop(socket);
        assert_eq!(connections.closed(Duration::from_secs(1)).await, 0);
        let _third = TcpStream::connect(addr).await.unwrap();
        let (_again, _) = tracked.accept().await;
        assert_eq!(connections.open(), 1);
    }
}
