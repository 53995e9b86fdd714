//! GCS's per-object mutation rate: about one write a second sustained to one
//! object name, a short burst tolerated, then 429. Modelled as a token bucket
//! per object name, shared by every instance (the limit is the bucket's, not
//! a client's).

use std::collections::HashMap;
use std::time::Instant;

/// A sustained rate with a burst allowance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MutationLimit {
    pub per_second: f64,
    /// Mutations admitted back to back after a quiet period.
    pub burst: f64,
}

impl MutationLimit {
    /// One a second, bursts of three (GCS documents the rate, not the burst;
    /// three is this model's guess).
    pub const GCS: Self = Self {
        per_second: 1.0,
        burst: 3.0,
    };
}

/// Token buckets by object name.
#[derive(Debug)]
pub struct MutationLimiter {
    limit: MutationLimit,
    buckets: HashMap<String, (f64, Instant)>,
}

impl MutationLimiter {
    pub fn new(limit: MutationLimit) -> Self {
        Self {
            limit,
            buckets: HashMap::new(),
        }
    }

    /// True if a mutation of `object` at `now` is admitted (it takes a
    /// token); false: the store answers 429 and the mutation does not happen.
    pub fn admit(&mut self, object: &str, now: Instant) -> bool {
        let limit = self.limit;
        let (tokens, last) = self
            .buckets
            .entry(object.to_owned())
            .or_insert((limit.burst, now));
        let refill = now.saturating_duration_since(*last).as_secs_f64() * limit.per_second;
        *tokens = (*tokens + refill).min(limit.burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_the_sustained_rate_holds() {
        let mut limiter = MutationLimiter::new(MutationLimit::GCS);
        let start = Instant::now();
        let burst: Vec<bool> = (0..5).map(|_| limiter.admit("lock.json", start)).collect();
        assert_eq!(burst, [true, true, true, false, false]);
        // Another object has its own allowance.
        assert!(limiter.admit("metadata.json", start));
        // Half a second refills half a token: still refused.
        assert!(!limiter.admit("lock.json", start + Duration::from_millis(500)));
        assert!(limiter.admit("lock.json", start + Duration::from_millis(1000)));
        // Ten writes at 2 a second for 5 s: about half are refused.
        let mut admitted = 0;
        for n in 0..10u64 {
            let at = start + Duration::from_millis(1000 + 500 * (n + 1));
            admitted += usize::from(limiter.admit("lock.json", at));
        }
        assert!((5..=6).contains(&admitted), "{admitted} of 10 admitted");
    }

    #[test]
    fn a_quiet_object_gets_its_burst_back_and_no_more() {
        let mut limiter = MutationLimiter::new(MutationLimit::GCS);
        let start = Instant::now();
        for _ in 0..3 {
            assert!(limiter.admit("o", start));
        }
        let later = start + Duration::from_secs(60);
        let admitted = (0..10).filter(|_| limiter.admit("o", later)).count();
        assert_eq!(admitted, 3);
    }
}
