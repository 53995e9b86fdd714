//! Where the agent's reader sends each event: execution output to that
//! execution's channel (bounded by [`MAX_QUEUED_OUTPUT_BYTES`] of queued
//! output), replies to the request waiting for them, archive chunks to their
//! sink. Split from `connection.rs`, which owns the connection and its tasks.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use controllers::runtime::ExecEvent;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::protocol::Event;

/// What a waiter gets: the reply event and the raw bytes after it (empty
/// if none), or the agent's error message.
pub(super) type Reply = Result<(Event, Bytes), String>;

/// An execution's event and the agent's number for it (0: not numbered,
/// the execution is not resumable).
pub type Sequenced = (u64, ExecEvent);

/// Output bytes one execution may have waiting between the reader and its
/// consumer. Beyond it the reader (which never waits) drops output: the first
/// dropped event becomes a notice on stderr, the others empty events of the
/// same number, so a resumable execution's numbering holds (a
/// consumer that stalled, such as a slow `/execute` client, let this grow
/// without bound).
pub const MAX_QUEUED_OUTPUT_BYTES: usize = 8 << 20;

/// One execution's route: its channel and the output bytes in it.
pub(super) struct ExecRoute {
    pub(super) sender: mpsc::UnboundedSender<Sequenced>,
    queued: Arc<AtomicUsize>,
    /// Output is being dropped (the notice was sent).
    dropping: bool,
    /// The stdin the agent granted: bytes the host may still send ahead of
    /// the program (none: the agent keeps no window).
    pub(super) stdin_window: Option<StdinWindow>,
}

/// An execution's stdin window: what the host may send ahead of what the
/// program read. Closed with its route, so a sender waiting for room goes on
/// once the execution is gone.
#[derive(Clone)]
pub(super) struct StdinWindow {
    pub(super) room: Arc<Semaphore>,
    pub(super) size: usize,
}

impl StdinWindow {
    /// A window of `size` bytes with `room` of them free.
    pub(super) fn with_room(size: u64, room: u64) -> Self {
        let size = usize::try_from(size)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        let room = usize::try_from(room).unwrap_or(usize::MAX).min(size);
        Self {
            room: Arc::new(Semaphore::new(room)),
            size,
        }
    }

    /// Gives back room the program made; never more than the window.
    pub(super) fn taken(&self, bytes: u64) {
        let full = self.size.saturating_sub(self.room.available_permits());
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX).min(full);
        self.room.add_permits(bytes);
    }
}

impl Drop for ExecRoute {
    fn drop(&mut self) {
        if let Some(window) = &self.stdin_window {
            window.room.close();
        }
    }
}

impl ExecRoute {
    pub(super) fn new() -> (Self, ExecEvents) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let events = ExecEvents {
            receiver,
            queued: Arc::clone(&queued),
        };
        (
            Self {
                sender,
                queued,
                dropping: false,
                stdin_window: None,
            },
            events,
        )
    }

    /// Queues output of `fd` (1 stdout, 2 stderr, 3 a rich result), or drops
    /// it past [`MAX_QUEUED_OUTPUT_BYTES`].
    pub(super) fn output(&mut self, seq: u64, fd: u8, data: Bytes) {
        let queued = self.queued.load(Ordering::Acquire);
        let data = if queued.saturating_add(data.len()) <= MAX_QUEUED_OUTPUT_BYTES {
            self.dropping = false;
            data
        } else if std::mem::replace(&mut self.dropping, true) {
            Bytes::new()
        } else {
            let notice = Bytes::from(format!(
                "\n[sandboxd] output dropped: more than {MAX_QUEUED_OUTPUT_BYTES} bytes were \
                 waiting for a reader that fell behind\n"
            ));
            let _ = self.sender.send((seq, ExecEvent::Stderr(notice.clone())));
            self.queued.fetch_add(notice.len(), Ordering::AcqRel);
            return;
        };
        self.queued.fetch_add(data.len(), Ordering::AcqRel);
        let event = match fd {
            2 => ExecEvent::Stderr(data),
            3 => ExecEvent::Result(data),
            _ => ExecEvent::Stdout(data),
        };
        let _ = self.sender.send((seq, event));
    }
}

/// The event stream of one execution, as the agent's reader routes it.
#[derive(Debug)]
pub struct ExecEvents {
    receiver: mpsc::UnboundedReceiver<Sequenced>,
    queued: Arc<AtomicUsize>,
}

impl ExecEvents {
    /// The next event; `None` once the execution's route is gone.
    pub async fn recv(&mut self) -> Option<Sequenced> {
        let item = self.receiver.recv().await?;
        if let (_, ExecEvent::Stdout(data) | ExecEvent::Stderr(data) | ExecEvent::Result(data)) =
            &item
        {
            self.queued.fetch_sub(data.len(), Ordering::AcqRel);
        }
        Some(item)
    }
}

#[derive(Default)]
pub(super) struct Routes {
    pub(super) replies: HashMap<String, oneshot::Sender<Reply>>,
    /// Unbounded on purpose: the reader must never wait on one slow consumer,
    /// or replies (kill, ping, checkpoint) would queue behind its output. The
    /// consumers (API sessions) bound what they keep.
    pub(super) execs: HashMap<String, ExecRoute>,
    /// Executions checkpointed with the sandbox: when the agent goes away
    /// their streams end without an exit (they go on elsewhere).
    pub(super) suspended: HashSet<String>,
    /// Unbounded for the same reason; the consumer writes to local disk,
    /// which keeps up with what the agent can tar and encode.
    pub(super) chunks: HashMap<String, mpsc::UnboundedSender<Bytes>>,
    pub(super) gone: bool,
}
