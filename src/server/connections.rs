//! The server's connections, counted and limited (as mini-redis's
//! `server.rs` does with a semaphore): every accepted socket holds a permit
//! for as long as it lives, and that includes a WebSocket session, whose
//! upgraded connection keeps the socket. So the server knows when its last
//! client is gone, and a flood of connections waits at `accept` instead of
//! exhausting file descriptors.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The connections of one server: at most `limit` at once.
#[derive(Debug, Clone)]
pub struct Connections {
    permits: Arc<Semaphore>,
    limit: u32,
}

impl Connections {
    pub fn new(limit: u32) -> Self {
        let limit = limit.max(1);
        Self {
            permits: Arc::new(Semaphore::new(limit as usize)),
            limit,
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
            // At the limit this socket waits for a connection to close, and
            // the next ones wait in the listen backlog. The semaphore is
            // never closed, so `acquire_owned` cannot fail.
            let Ok(permit) = Arc::clone(&self.connections.permits).acquire_owned().await else {
                continue;
            };
            // The protocol is many small frames (`EXECUTION_RUNNING`, a short
            // `stdout`, `exit_code`, `DONE`): with Nagle's algorithm each one
            // after the first waits for the client's delayed ACK (about 40 ms
            // with the Python and TypeScript clients).
            if let Err(err) = stream.set_nodelay(true) {
                tracing::warn!(%err, "cannot set TCP_NODELAY on an accepted socket");
            }
            return (
                Connection {
                    stream,
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

/// An accepted socket and its permit, released when the socket is dropped.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
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
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
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
        let connections = Connections::new(1);
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
