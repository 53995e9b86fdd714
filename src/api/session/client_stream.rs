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

use axum::extract::ws::{Message, WebSocket};
use futures::StreamExt;
use futures::stream::SplitStream;

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
}

impl ClientStream {
    pub fn new(inner: SplitStream<WebSocket>) -> Self {
        Self {
            inner,
            early: VecDeque::new(),
            early_bytes: 0,
            ended: false,
        }
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
        self.inner.next().await
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
                read = self.inner.next(), if room => match read {
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

fn size_of_read(read: &Read) -> usize {
    match read {
        Ok(Message::Text(text)) => text.len(),
        Ok(Message::Binary(data)) => data.len(),
        Ok(_) | Err(_) => 0,
    }
}
