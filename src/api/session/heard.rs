//! When the client was last heard from: the one piece of state the socket's
//! reading half ([`super::client_stream`]) and its writer ([`super::out`])
//! share, below both.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use controllers::clock::Clock;
use tokio::sync::Notify;
use tokio::time::Instant;

/// When the client was last heard from, shared by the reading half (which
/// records it) and the writer (which closes a silent client). Only a client
/// the server is reading can be silent: one the server does not read (its
/// queue is full) is never closed for it.
#[derive(Debug)]
pub struct Heard {
    /// The instance's clock, which the silences are measured on.
    pub(super) clock: Arc<dyn Clock>,
    since: Instant,
    /// Milliseconds after `since` of the last frame read.
    heard: AtomicU64,
    /// Milliseconds after `since` the current read began; `u64::MAX` while
    /// the socket is not being read.
    reading: AtomicU64,
    /// The writer stopped (the socket is closed or dead): reads end.
    stopped: AtomicBool,
    stop: Notify,
}

impl Heard {
    pub(super) fn new(clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            since: clock.instant(),
            clock,
            heard: AtomicU64::new(0),
            reading: AtomicU64::new(u64::MAX),
            stopped: AtomicBool::new(false),
            stop: Notify::new(),
        })
    }

    /// The writer stopped: every read of the socket ends.
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.stop.notify_waiters();
    }

    /// Completes once the writer has stopped.
    pub async fn stopped(&self) {
        loop {
            let notified = self.stop.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    fn elapsed_ms(&self) -> u64 {
        let elapsed = self.clock.instant().saturating_duration_since(self.since);
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// The client sent something now.
    pub fn now(&self) {
        self.heard.fetch_max(self.elapsed_ms(), Ordering::AcqRel);
    }

    /// A read of the socket begins; it ends when the guard is dropped.
    pub fn reading(&self) -> ReadingGuard<'_> {
        self.reading.store(self.elapsed_ms(), Ordering::Release);
        ReadingGuard(self)
    }

    /// How long the socket has been read without the client sending
    /// anything (zero while it is not read).
    pub(super) fn silent_for(&self) -> Duration {
        let reading = self.reading.load(Ordering::Acquire);
        if reading == u64::MAX {
            return Duration::ZERO;
        }
        let since = reading.max(self.heard.load(Ordering::Acquire));
        Duration::from_millis(self.elapsed_ms().saturating_sub(since))
    }
}

/// A read of the socket in progress ([`Heard::reading`]).
#[derive(Debug)]
pub struct ReadingGuard<'a>(&'a Heard);

impl Drop for ReadingGuard<'_> {
    fn drop(&mut self) {
        self.0.reading.store(u64::MAX, Ordering::Release);
    }
}
