//! The one budget, shared by every socket of an instance, for the client
//! frames kept while a create or attach waits (`client_stream.rs`).
//!
//! Each waiting socket keeps at most a few frames of its own, but a
//! hostile tenant opens many sockets (from many addresses, so no
//! per-caller quota applies), each waiting up to minutes for the
//! controller; bounded only per socket, the frames kept add up to the
//! socket's bound times the connection limit, more memory than an instance
//! has. So a frame kept also takes its bytes from this budget, and gives
//! them back when the session takes the frame or the socket is dropped
//! ([`EarlyClaim`] is a guard). A socket whose frame the budget cannot
//! give keeps that frame (it is already in memory) and is read no further
//! until its session starts: the flood holds itself back, and a socket that
//! sends no data while it waits (an honest client's pings) is read on.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Default of the budget's size (`--ws-early-frames-budget-bytes`).
pub const DEFAULT_EARLY_FRAMES_BUDGET_BYTES: usize = 64 << 20;

/// Bytes of early frames the instance may keep, shared by all its sockets.
/// Cheap to clone: clones share one budget.
#[derive(Debug, Clone)]
pub struct EarlyBudget {
    /// One permit a byte.
    bytes: Arc<Semaphore>,
    total: usize,
}

/// Bytes taken from an [`EarlyBudget`], given back when dropped.
#[derive(Debug)]
pub struct EarlyClaim {
    _bytes: OwnedSemaphorePermit,
}

impl EarlyBudget {
    /// A budget of `total` bytes (at most what a semaphore counts).
    pub fn new(total: usize) -> Self {
        let total = total.min(Semaphore::MAX_PERMITS);
        Self {
            bytes: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Takes `bytes` from the budget if it has them all; `None` if not
    /// (nothing is taken then).
    pub fn take(&self, bytes: usize) -> Option<EarlyClaim> {
        let bytes = u32::try_from(bytes).ok()?;
        Arc::clone(&self.bytes)
            .try_acquire_many_owned(bytes)
            .ok()
            .map(|permit| EarlyClaim { _bytes: permit })
    }

    /// Takes `bytes` from the budget once it has them all (bytes given
    /// back go to those who wait, first come first served); `None` at once
    /// if it never could (more than the whole budget).
    pub async fn claim(&self, bytes: usize) -> Option<EarlyClaim> {
        if bytes > self.total {
            return None;
        }
        let bytes = u32::try_from(bytes).ok()?;
        Arc::clone(&self.bytes)
            .acquire_many_owned(bytes)
            .await
            .ok()
            .map(|permit| EarlyClaim { _bytes: permit })
    }

    /// Bytes not taken now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// The budget's size.
    pub fn total(&self) -> usize {
        self.total
    }
}

impl Default for EarlyBudget {
    fn default() -> Self {
        Self::new(DEFAULT_EARLY_FRAMES_BUDGET_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_taken_come_back_when_the_claim_is_dropped() {
        let budget = EarlyBudget::new(100);
        let first = budget.take(60).unwrap();
        assert_eq!(budget.available(), 40);
        assert!(budget.take(41).is_none(), "took more than was left");
        assert_eq!(budget.available(), 40, "a refused take took something");
        let second = budget.clone().take(40).unwrap();
        assert_eq!(budget.available(), 0);
        drop(first);
        assert_eq!(budget.available(), 60);
        drop(second);
        assert_eq!(budget.available(), budget.total());
    }

    #[tokio::test]
    async fn a_claim_waits_for_bytes_given_back_and_one_too_large_is_refused_at_once() {
        let budget = EarlyBudget::new(100);
        let first = budget.take(70).unwrap();
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.claim(50).await }
        });
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "claimed bytes the budget did not have"
        );
        assert!(budget.claim(101).await.is_none());
        drop(first);
        let second = waiting.await.unwrap().unwrap();
        assert_eq!(budget.available(), 50);
        drop(second);
        assert_eq!(budget.available(), 100);
    }

    #[test]
    fn a_take_larger_than_a_semaphore_counts_is_refused() {
        let budget = EarlyBudget::new(usize::MAX);
        assert!(budget.take(usize::MAX).is_none());
        assert_eq!(budget.available(), budget.total());
    }
}
