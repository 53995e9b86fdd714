//! When to retry a refused write of one object: GCS allows about one
//! mutation of an object per second (a short burst tolerated), and answers
//! 429 beyond it. The exponential backoff that suits a flaky network retries
//! a rate-limited write after 0.1, 0.3, 0.6 s: each attempt is refused again
//! (and billed) until the object's second is up, and the backoff then
//! overshoots it. This remembers when this process last changed each object
//! and retries a refused write of it just after that second ends; an object
//! someone else changed (its last write unknown here) waits a floor instead.
//!
//! Only the retry is paced, never a first attempt: GCS tolerates a burst,
//! and a write that would have gone through is not delayed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// GCS's sustained rate for one object: one mutation a second.
pub const OBJECT_MUTATION_INTERVAL: Duration = Duration::from_secs(1);

/// The least wait before retrying a refused write of an object this
/// process did not change lately (someone else did, within the second).
pub const UNKNOWN_WRITER_FLOOR: Duration = Duration::from_millis(400);

/// Objects remembered at most; older entries go first when full.
const MAX_REMEMBERED: usize = 4096;

/// The last successful mutation of each object by this process.
#[derive(Debug, Clone, Default)]
pub struct MutationPacer {
    last: Arc<Mutex<HashMap<String, Instant>>>,
}

impl MutationPacer {
    /// `key` was changed just now.
    pub fn changed(&self, key: &str) {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.len() >= MAX_REMEMBERED && !last.contains_key(key) {
            last.retain(|_, at| now.duration_since(*at) < OBJECT_MUTATION_INTERVAL);
            if last.len() >= MAX_REMEMBERED {
                return;
            }
        }
        last.insert(key.to_owned(), now);
    }

    /// How long to wait before retrying a refused write of `key`, given
    /// the backoff's own suggestion: until the object's second since this
    /// process last changed it is up (plus a little jitter, so writers
    /// that queued together do not collide again), or at least the floor
    /// for an object changed elsewhere. Never less than `suggested`.
    pub fn retry_after(&self, key: &str, suggested: Duration, jitter: Duration) -> Duration {
        let now = Instant::now();
        let since = self
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .map(|at| now.duration_since(*at));
        let paced = match since {
            Some(since) if since < OBJECT_MUTATION_INTERVAL => {
                (OBJECT_MUTATION_INTERVAL - since).saturating_add(jitter)
            }
            Some(_) => Duration::ZERO,
            None => UNKNOWN_WRITER_FLOOR.saturating_add(jitter),
        };
        paced.max(suggested)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_write_waits_out_the_objects_second() {
        let pacer = MutationPacer::default();
        pacer.changed("sandboxes/a/metadata.json");
        let wait = pacer.retry_after(
            "sandboxes/a/metadata.json",
            Duration::from_millis(100),
            Duration::ZERO,
        );
        assert!(
            wait > Duration::from_millis(900) && wait <= OBJECT_MUTATION_INTERVAL,
            "{wait:?}"
        );
    }

    #[test]
    fn an_object_changed_elsewhere_waits_the_floor_and_a_long_suggestion_stands() {
        let pacer = MutationPacer::default();
        pacer.changed("sandboxes/a/metadata.json");
        let other = pacer.retry_after(
            "sandboxes/b/metadata.json",
            Duration::from_millis(100),
            Duration::from_millis(5),
        );
        assert_eq!(other, UNKNOWN_WRITER_FLOOR + Duration::from_millis(5));
        let long = pacer.retry_after(
            "sandboxes/a/metadata.json",
            Duration::from_secs(3),
            Duration::ZERO,
        );
        assert_eq!(long, Duration::from_secs(3));
    }

    #[test]
    fn the_memory_is_bounded() {
        let pacer = MutationPacer::default();
        for index in 0..(MAX_REMEMBERED + 10) {
            pacer.changed(&format!("k{index}"));
        }
        let remembered = pacer.last.lock().map(|last| last.len()).unwrap_or(0);
        assert!(remembered <= MAX_REMEMBERED, "{remembered}");
    }
}
