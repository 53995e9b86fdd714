//! A work queue of sandbox ids with client-go's guarantees: an id is queued at
//! most once, never reconciled by two workers at once, and an id added while
//! it is being reconciled runs again right after.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

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
}

#[derive(Debug, Clone)]
pub struct WorkQueue {
    state: Arc<Mutex<State>>,
    ready: Arc<Notify>,
    /// Reads the time delayed adds are due at.
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

    /// Queues `id` now.
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
        // A day at most: a delay computed from an operator's timestamp must
        // not overflow the clock (nothing waits that long without a resync).
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

    /// Marks `id` done; queues it again if it was added meanwhile.
    pub fn done(&self, id: &SandboxId) {
        let again = {
            let mut state = self.state();
            state.active.remove(id);
            state.dirty.remove(id)
        };
        if again {
            self.add(id);
        }
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
        let first = queue.next().await;
        assert_eq!(first, id(1));
        queue.add(&id(1)); // while active: deferred, not a second worker
        assert_eq!(queue.next().await, id(2));
        queue.done(&id(2));
        queue.done(&id(1));
        assert_eq!(queue.next().await, id(1));
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
