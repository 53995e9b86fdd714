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
//! sockets never keep a request out. A connection serving a request, or
//! upgraded to a WebSocket (whose liveness its pings check,
//! `api/session/out.rs`), has no deadline here.

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

/// Milliseconds after the server's epoch; `NEVER` for "not set".
const NEVER: u64 = u64::MAX;

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
}

impl Connected<IncomingStream<'_, Tracked>> for Peer {
    fn connect_info(stream: IncomingStream<'_, Tracked>) -> Self {
        Self {
            addr: *stream.remote_addr(),
            activity: Arc::clone(&stream.io().activity),
        }
    }
}

/// Middleware: a request in flight suspends its connection's deadlines,
/// and a WebSocket upgrade ends them.
/// The request gets the client's address ([`ClientAddr`]) as an extension.
pub async fn track_requests(mut request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<ConnectInfo<Peer>>().cloned();
    let Some(ConnectInfo(peer)) = peer else {
        return next.run(request).await;
    };
    request.extensions_mut().insert(ClientAddr(peer.addr));
    let activity = peer.activity;
    activity.request_began.store(NEVER, Ordering::Release);
    activity.in_flight.fetch_add(1, Ordering::AcqRel);
    let response = next.run(request).await;
    if response.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS {
        activity.upgraded.store(true, Ordering::Release);
    }
    activity.active();
    activity.in_flight.fetch_sub(1, Ordering::AcqRel);
    response
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
                    let activity = &self.activity;
                    activity.active();
                    if !activity.busy() && activity.request_began.load(Ordering::Acquire) == NEVER {
                        activity
                            .request_began
                            .store(activity.now(), Ordering::Release);
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

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.active();
        }
        written
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
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.active();
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener as _;

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
