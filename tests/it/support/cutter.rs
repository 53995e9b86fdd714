//! A TCP forwarder whose connections a test can cut, like a network drop,
//! and which can then turn every new connection away, like a server that is
//! gone: what a client's reconnect logic is tested against.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

pub struct Cutter {
    pub addr: String,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    refusing: Arc<AtomicBool>,
    /// Told of each connection turned away once refusing.
    turned_away: Arc<Notify>,
    /// How many were turned away.
    turned_away_count: Arc<AtomicUsize>,
    _accept: JoinHandle<()>,
}

impl Cutter {
    /// Forwards each connection to `target`.
    pub async fn to(target: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let refusing = Arc::new(AtomicBool::new(false));
        let turned_away = Arc::new(Notify::new());
        let turned_away_count = Arc::new(AtomicUsize::new(0));
        let (tracked, refuse, told, counted) = (
            Arc::clone(&connections),
            Arc::clone(&refusing),
            Arc::clone(&turned_away),
            Arc::clone(&turned_away_count),
        );
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if refuse.load(Ordering::Acquire) {
                    // Accepted, then closed before a byte: the client's
                    // WebSocket handshake fails at once.
                    drop(inbound);
                    counted.fetch_add(1, Ordering::AcqRel);
                    told.notify_one();
                    continue;
                }
                let target = target.clone();
                let handle = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tracked.lock().unwrap().push(handle);
            }
        });
        Self {
            addr,
            connections,
            refusing,
            turned_away,
            turned_away_count,
            _accept: accept,
        }
    }

    /// Drops every forwarded connection, both ways.
    pub fn cut(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    /// From now on, closes each new connection as soon as it is accepted.
    pub fn refuse(&self) {
        self.refusing.store(true, Ordering::Release);
    }

    /// Waits until a connection was turned away (since the last wait).
    pub async fn turned_away(&self) {
        self.turned_away.notified().await;
    }

    /// How many connections were turned away so far.
    pub fn turned_away_so_far(&self) -> usize {
        self.turned_away_count.load(Ordering::Acquire)
    }
}
