//! A work queue of sandbox ids with client-go's guarantees: queued at most once, never run by two
//! workers at once, re-run if added while active; a failed pass retries after a growing back-off.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::Rng;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::api::SandboxId;
use crate::clock::Clock;

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<SandboxId>,
    queued: HashSet<SandboxId>,
    active: HashSet<SandboxId>,
    /// Added while active: queue again when done.
    dirty: HashSet<SandboxId>,
    /// The earliest pending delayed add per id.
    scheduled: HashMap<SandboxId, Instant>,
    /// Failed passes in a row per id. Here, not in the sandbox's slot: no
    /// pass reads it, and it would keep a failing sandbox's slot alive.
    failures: HashMap<SandboxId, u32>,
}

const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Exponential back-off with jitter: 0.5 s, 1 s, 2 s … up to 30 s.
fn backoff(failures: u32) -> Duration {
    let base = Duration::from_millis(500)
        .saturating_mul(1 << failures.saturating_sub(1).min(6))
        .min(MAX_BACKOFF);
    let jitter = rand::rng().random_range(0.8..1.2);
    base.mul_f64(jitter)
}

#[derive(Debug, Clone)]
pub struct WorkQueue {
    state: Arc<Mutex<State>>,
    ready: Arc<Notify>,
    clock: Arc<dyn Clock>,
}

impl WorkQueue {
    /// An empty queue whose delayed adds are timed by `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            state: Arc::default(),
            ready: Arc::default(),
            clock,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn add(&self, id: &SandboxId) {
        let mut state = self.state();
        if state.active.contains(id) {
            state.dirty.insert(id.clone());
        } else if state.queued.insert(id.clone()) {
            state.queue.push_back(id.clone());
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Queues `id` after `delay`, unless an earlier add is already scheduled.
    pub fn add_after(&self, id: &SandboxId, delay: Duration) {
        // A day at most (resyncs come sooner): an operator's timestamp must not overflow the clock.
        let delay = delay.min(Duration::from_secs(86_400));
        let now = self.clock.instant();
        let due = now.checked_add(delay).unwrap_or(now);
        {
            let mut state = self.state();
            if let Some(existing) = state.scheduled.get(id)
                && *existing <= due
            {
                return;
            }
            state.scheduled.insert(id.clone(), due);
        }
        let queue = self.clone();
        let id = id.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(due).await;
            let fire = {
                let mut state = queue.state();
                if state.scheduled.get(&id) == Some(&due) {
                    state.scheduled.remove(&id);
                    true
                } else {
                    false
                }
            };
            if fire {
                queue.add(&id);
            }
        });
    }

    /// Takes every id queued now (a test's look at what was woken).
    #[cfg(test)]
    pub(crate) fn drain(&self) -> Vec<SandboxId> {
        let mut state = self.state();
        state.queued.clear();
        state.queue.drain(..).collect()
    }

    /// Waits for the next id and marks it active.
    pub async fn next(&self) -> SandboxId {
        loop {
            let notified = self.ready.notified();
            {
                let mut state = self.state();
                if let Some(id) = state.queue.pop_front() {
                    state.queued.remove(&id);
                    state.active.insert(id.clone());
                    if !state.queue.is_empty() {
                        drop(state);
                        self.ready.notify_one();
                    }
                    return id;
                }
            }
            notified.await;
        }
    }

    /// Ends a successful pass (forgets its failures); requeues if re-added.
    pub fn done(&self, id: &SandboxId) {
        self.end_pass(id, false);
    }

    /// Ends a failed pass: requeues `id` after a back-off growing with its
    /// failures in a row (at once if added meanwhile); returns the back-off.
    pub fn done_failed(&self, id: &SandboxId) -> Duration {
        let delay = self.end_pass(id, true);
        self.add_after(id, delay);
        delay
    }

    /// Ends the pass; returns the back-off for its failures (zero on success).
    fn end_pass(&self, id: &SandboxId, failed: bool) -> Duration {
        let (again, delay) = {
            let mut state = self.state();
            let delay = if failed {
                let count = state.failures.entry(id.clone()).or_insert(0);
                *count = count.saturating_add(1);
                backoff(*count)
            } else {
                state.failures.remove(id);
                Duration::ZERO
            };
            state.active.remove(id);
            (state.dirty.remove(id), delay)
        };
        if again {
            self.add(id);
        }
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;

    fn id(n: u128) -> SandboxId {
        SandboxId::from_u128(n)
    }

    #[tokio::test]
    async fn an_id_is_queued_once_and_rerun_when_added_while_active() {
        let queue = WorkQueue::new(Arc::new(SystemClock));
        queue.add(&id(1));
        queue.add(&id(1));
        queue.add(&id(2));
        assert_eq!(queue.next().await, id(1));
        queue.add(&id(1)); // while active: deferred, not a second worker
        assert_eq!(queue.next().await, id(2));
        queue.done(&id(2));
        queue.done(&id(1));
        assert_eq!(queue.next().await, id(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_pass_is_retried_after_a_back_off_growing_with_its_failures_in_a_row() {
        let queue = WorkQueue::new(Arc::new(SystemClock));
        let mut delays = Vec::new();
        queue.add(&id(3));
        assert_eq!(queue.next().await, id(3));
        for _ in 0..3 {
            let delay = queue.done_failed(&id(3));
            let started = SystemClock.instant();
            assert_eq!(queue.next().await, id(3), "retried");
            let waited = SystemClock.instant().duration_since(started);
            assert!(waited >= delay && waited < delay + Duration::from_millis(10));
            delays.push(delay);
        }
        queue.done(&id(3));
        // 0.5 s, 1 s, 2 s, each within its jitter.
        for (delay, base) in delays.iter().zip([500, 1_000, 2_000]) {
            let base = Duration::from_millis(base);
            let jitter = base.mul_f64(0.8)..=base.mul_f64(1.2);
            assert!(jitter.contains(delay), "{delays:?}");
        }
        // A pass that succeeded forgets them: the next failure starts over.
        queue.add(&id(3));
        assert_eq!(queue.next().await, id(3));
        assert!(queue.done_failed(&id(3)) <= Duration::from_millis(600));
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_delayed_add_does_not_postpone_an_earlier_one() {
        let queue = WorkQueue::new(Arc::new(SystemClock));
        queue.add_after(&id(7), Duration::from_secs(1));
        queue.add_after(&id(7), Duration::from_secs(60));
        let started = SystemClock.instant();
        assert_eq!(queue.next().await, id(7));
        assert!(SystemClock.instant().duration_since(started) < Duration::from_secs(2));
    }
}
