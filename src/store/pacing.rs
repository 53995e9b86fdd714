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
//!
//! A conditional write also knows when the write it is conditional on
//! landed: GCS's generations are that write's time in microseconds
//! (`docs/gcs.md`; a generation that is no plausible time is
//! ignored). If that was within the second, the object's write rate is
//! sure to admit a write once the second is up, whoever wrote it: a retry
//! waits no longer than that (a handoff's transfer refused because the
//! taker's intent had just been written is retried when the intent's
//! second ends, not on the backoff's next step, often hundreds of
//! milliseconds later).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
        #[allow(
            clippy::disallowed_methods,
            reason = "paces writes to a real bucket, whose per-object rate limit runs on real time"
        )]
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
    /// for an object changed elsewhere; never less than `suggested`, unless
    /// `landed_at` (when the write a conditional retry is conditional on
    /// landed) says the object's second ends sooner.
    pub fn retry_after(
        &self,
        key: &str,
        suggested: Duration,
        jitter: Duration,
        landed_at: Option<SystemTime>,
    ) -> Duration {
        #[allow(
            clippy::disallowed_methods,
            reason = "paces writes to a real bucket, whose per-object rate limit runs on real time"
        )]
        let now = Instant::now();
        let since = self
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .map(|at| now.duration_since(*at));
        let paced = match since {
            Some(since) => rest_of_second(since, jitter).unwrap_or(Duration::ZERO),
            None => UNKNOWN_WRITER_FLOOR.saturating_add(jitter),
        };
        let paced = paced.max(suggested);
        // The latest write is the one the precondition names: once its
        // second is up, a token is there (none was taken since, or the
        // precondition fails anyway). Long past, it says nothing.
        let settled = landed_at.and_then(|at| {
            #[allow(
                clippy::disallowed_methods,
                reason = "compared with the time GCS wrote an object (its generation): the host's wall clock, as GCS's"
            )]
            let ago = SystemTime::now()
                .duration_since(at)
                .unwrap_or(Duration::ZERO);
            rest_of_second(ago, jitter)
        });
        match settled {
            Some(settled) => paced.min(settled),
            None => paced,
        }
    }
}

/// What is left of the object's second `since` a write of it (plus
/// `jitter`); `None` once the second is up.
fn rest_of_second(since: Duration, jitter: Duration) -> Option<Duration> {
    (since < OBJECT_MUTATION_INTERVAL)
        .then(|| (OBJECT_MUTATION_INTERVAL - since).saturating_add(jitter))
}

/// When the write that made `generation` landed, if it reads as a time:
/// GCS's generations are microseconds since the epoch. One more than a
/// minute off this machine's clock is taken for something else.
pub fn generation_time(generation: i64) -> Option<SystemTime> {
    let micros = u64::try_from(generation).ok()?;
    let at = UNIX_EPOCH.checked_add(Duration::from_micros(micros))?;
    #[allow(
        clippy::disallowed_methods,
        reason = "compared with the time GCS wrote an object (its generation): the host's wall clock, as GCS's"
    )]
    let now = SystemTime::now();
    let off = match now.duration_since(at) {
        Ok(ago) => ago,
        Err(ahead) => ahead.duration(),
    };
    (off <= Duration::from_secs(60)).then_some(at)
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
            None,
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
            None,
        );
        assert_eq!(other, UNKNOWN_WRITER_FLOOR + Duration::from_millis(5));
        let long = pacer.retry_after(
            "sandboxes/a/metadata.json",
            Duration::from_secs(3),
            Duration::ZERO,
            None,
        );
        assert_eq!(long, Duration::from_secs(3));
    }

    #[test]
    fn a_retry_waits_no_longer_than_the_second_of_the_write_it_is_conditional_on() {
        let pacer = MutationPacer::default();
        let landed = SystemTime::now() - Duration::from_millis(700);
        // Changed elsewhere 700 ms ago: the backoff's 400 ms (or the
        // floor) would retry at 1.1 s; the object admits a write at 1.0 s.
        let wait = pacer.retry_after(
            "sandboxes/a/lock.json",
            Duration::from_millis(800),
            Duration::ZERO,
            Some(landed),
        );
        assert!(
            wait <= Duration::from_millis(300) && wait > Duration::from_millis(200),
            "{wait:?}"
        );
        // A write a second or more ago says nothing: the backoff stands.
        let long_ago = SystemTime::now() - Duration::from_secs(5);
        let wait = pacer.retry_after(
            "sandboxes/a/lock.json",
            Duration::from_millis(800),
            Duration::ZERO,
            Some(long_ago),
        );
        assert_eq!(wait, Duration::from_millis(800));
    }

    #[test]
    fn generations_read_as_times_only_near_this_clock() {
        let now = SystemTime::now();
        let micros = now.duration_since(UNIX_EPOCH).unwrap().as_micros();
        let generation = i64::try_from(micros).unwrap();
        let at = generation_time(generation).expect("a GCS generation is a time");
        assert!(now.duration_since(at).unwrap_or_default() < Duration::from_millis(1));
        assert_eq!(generation_time(7), None, "a counter is no time");
        assert_eq!(generation_time(-1), None);
        assert_eq!(generation_time(i64::MAX), None);
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
