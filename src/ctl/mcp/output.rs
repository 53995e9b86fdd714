//! An execution's output as an MCP tool hands it back: each stream kept
//! within a bound (its head and its tail, the middle replaced by a marker, so
//! a traceback at the end survives a flood before it), and streamed while it
//! runs as progress notifications when the client asked for them (a
//! `progressToken`), coalesced so a chatty process does not become one
//! notification per line.

use std::time::Duration;

use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::{Peer, RoleServer};
use tokio::time::Instant;

/// The most of one stream (stdout, stderr) a tool result carries.
pub(super) const OUTPUT_LIMIT: usize = 1 << 20;
/// Progress notifications carry at most this much output in all; past it the
/// result still has the (bounded) output.
const PROGRESS_LIMIT: u64 = 16 << 20;
/// Output is sent once this much has gathered...
const PROGRESS_BATCH: usize = 16 << 10;
/// ...or once the oldest unsent byte is this old.
pub(super) const PROGRESS_DELAY: Duration = Duration::from_millis(100);

/// Text kept within a limit: the first half of it and the latest half.
#[derive(Debug)]
pub(super) struct Bounded {
    limit: usize,
    head: String,
    tail: String,
    /// Bytes that fell out between head and tail.
    dropped: u64,
}

impl Bounded {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            limit,
            head: String::new(),
            tail: String::new(),
            dropped: 0,
        }
    }

    pub(super) fn push(&mut self, mut text: &str) {
        let half = self.limit / 2;
        if self.tail.is_empty() && self.dropped == 0 {
            let room = half.saturating_sub(self.head.len());
            let take = floor_char_boundary(text, room);
            self.head.push_str(&text[..take]);
            text = &text[take..];
        }
        if text.is_empty() {
            return;
        }
        self.tail.push_str(text);
        // Trimmed once it is twice the half: amortised, not per push.
        if self.tail.len() > 2 * half.max(1) {
            let cut = ceil_char_boundary(&self.tail, self.tail.len() - half);
            self.dropped += cut as u64;
            self.tail.drain(..cut);
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.head.is_empty() && self.tail.is_empty()
    }

    /// The text, with a marker where bytes were left out.
    pub(super) fn finish(self) -> String {
        let half = self.limit / 2;
        let mut tail = self.tail;
        let mut dropped = self.dropped;
        if self.head.len() + tail.len() > self.limit {
            let cut = ceil_char_boundary(&tail, tail.len().saturating_sub(half));
            dropped += cut as u64;
            tail.drain(..cut);
        }
        if dropped == 0 {
            return self.head + &tail;
        }
        format!(
            "{}\n[... {dropped} bytes of output left out (over the {} KiB limit) ...]\n{tail}",
            self.head,
            self.limit >> 10
        )
    }
}

/// The largest index `<= at` on a character boundary of `text`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The smallest index `>= at` on a character boundary of `text`.
fn ceil_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// Output on its way to the client as progress notifications (nothing is
/// sent when the request had no progress token).
#[derive(Debug)]
pub(super) struct ProgressStream {
    target: Option<(Peer<RoleServer>, ProgressToken)>,
    pending: String,
    /// When the oldest pending byte arrived.
    since: Option<Instant>,
    /// Bytes sent so far: the notifications' `progress` (it only grows).
    sent: u64,
    capped: bool,
}

impl ProgressStream {
    pub(super) fn new(peer: Peer<RoleServer>, token: Option<ProgressToken>) -> Self {
        Self {
            target: token.map(|token| (peer, token)),
            pending: String::new(),
            since: None,
            sent: 0,
            capped: false,
        }
    }

    /// Queues `text` (stderr is marked), sending a batch once it is big enough.
    pub(super) async fn push(&mut self, text: &str, stderr: bool) {
        if self.target.is_none() || self.capped || text.is_empty() {
            return;
        }
        if stderr {
            self.pending.push_str("[stderr] ");
        }
        self.pending.push_str(text);
        #[allow(
            clippy::disallowed_methods,
            reason = "sandboxctl's MCP server batches progress on the operator's machine, outside any instance"
        )]
        self.since.get_or_insert_with(Instant::now);
        if self.pending.len() >= PROGRESS_BATCH {
            self.flush().await;
        }
    }

    /// When the pending output is due (none pending: never).
    pub(super) fn due(&self) -> Option<Instant> {
        self.since.map(|since| since + PROGRESS_DELAY)
    }

    /// Sends what is pending as one notification.
    pub(super) async fn flush(&mut self) {
        self.since = None;
        if self.pending.is_empty() {
            return;
        }
        let Some((peer, token)) = &self.target else {
            return;
        };
        let mut message = std::mem::take(&mut self.pending);
        self.sent += message.len() as u64;
        if self.sent >= PROGRESS_LIMIT {
            self.capped = true;
            message.push_str(&format!(
                "\n[progress stops after {} MiB of output; the result keeps the output's head and tail]",
                PROGRESS_LIMIT >> 20
            ));
        }
        let notification =
            ProgressNotificationParam::new(token.clone(), self.sent as f64).with_message(message);
        // A client that went away is noticed by the service, not here.
        if let Err(err) = peer.notify_progress(notification).await {
            tracing::debug!(%err, "a progress notification was not sent");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_kept_whole() {
        let mut out = Bounded::new(64);
        out.push("hello ");
        out.push("world");
        assert_eq!(out.finish(), "hello world");
    }

    #[test]
    fn long_output_keeps_head_and_tail_with_a_marker() {
        let mut out = Bounded::new(1024);
        for i in 0..10_000 {
            out.push(&format!("line {i}\n"));
        }
        let text = out.finish();
        assert!(text.starts_with("line 0\nline 1\n"), "{}", &text[..40]);
        assert!(text.ends_with("line 9999\n"));
        assert!(text.contains("bytes of output left out"));
        assert!(text.len() < 1024 + 200, "{}", text.len());
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let mut out = Bounded::new(101);
        for _ in 0..500 {
            out.push("héllo wörld ✓ ");
        }
        // Valid UTF-8 by construction (a String); the bound still holds.
        let text = out.finish();
        assert!(text.contains("left out"));
        assert!(text.starts_with("héllo"));
    }

    #[test]
    fn exactly_the_limit_is_not_truncated() {
        let mut out = Bounded::new(10);
        out.push("0123456789");
        assert_eq!(out.finish(), "0123456789");
        let mut over = Bounded::new(10);
        over.push("0123456789a");
        assert!(over.finish().contains("1 bytes of output left out"));
    }
}
