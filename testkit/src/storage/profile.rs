//! Named latency profiles: how long a modelled request takes, by kind.
//!
//! Each kind's delay is lognormal (`median · e^(σ·Z)`, Z standard normal),
//! which is how request latencies of a remote service are usually shaped: a
//! firm floor near the median and a long right side. A rare tail (one
//! request in N takes a uniform 1–2 s) stands for the slow requests any
//! cloud store has. Bodies add `bytes / throughput`. The numbers are a MODEL
//! (`docs/benchmarks.md` says where they come from), not a measurement of
//! GCS.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use rand::Rng;

use super::limiter::MutationLimit;
use super::record::RequestKind;

/// A lognormal delay: `median · e^(σ·Z)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lognormal {
    pub median: Duration,
    pub sigma: f64,
}

impl Lognormal {
    pub const ZERO: Self = Self {
        median: Duration::ZERO,
        sigma: 0.0,
    };

    pub const fn millis(median_ms: u64, sigma: f64) -> Self {
        Self {
            median: Duration::from_millis(median_ms),
            sigma,
        }
    }

    pub fn sample(&self, rng: &mut impl Rng) -> Duration {
        if self.median.is_zero() {
            return Duration::ZERO;
        }
        let factor = (self.sigma * standard_normal(rng)).exp();
        // A factor is finite and positive; cap it anyway (σ·Z of 5 is e^5).
        self.median.mul_f64(factor.clamp(0.0, 150.0))
    }
}

/// One draw of a standard normal (Box–Muller).
fn standard_normal(rng: &mut impl Rng) -> f64 {
    // (0, 1]: the logarithm stays finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// One request in `one_in` takes a uniform delay in `min..=max` instead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tail {
    pub one_in: u32,
    pub min: Duration,
    pub max: Duration,
}

/// How a modelled bucket answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub name: &'static str,
    /// GET and HEAD of one object.
    pub read: Lognormal,
    /// Every other method: uploads, deletes, rewrites.
    pub write: Lognormal,
    /// A GET of a listing (`/b/{bucket}/o` without an object).
    pub list: Lognormal,
    pub tail: Option<Tail>,
    /// Throughput of a request's or response's body (by its
    /// `Content-Length`); `None`: no added time.
    pub body_bytes_per_s: Option<f64>,
    /// GCS's per-object mutation rate; `None`: unlimited.
    pub mutation_limit: Option<MutationLimit>,
}

/// The names [`Profile::named`] knows.
pub const PROFILE_NAMES: [&str; 3] = ["loopback", "gcs-regional", "gcs-slow"];

const SLOW_TAIL: Tail = Tail {
    one_in: 1000,
    min: Duration::from_secs(1),
    max: Duration::from_secs(2),
};

impl Profile {
    /// The emulator as it is: nothing added, no limits.
    pub fn loopback() -> Self {
        Self {
            name: "loopback",
            read: Lognormal::ZERO,
            write: Lognormal::ZERO,
            list: Lognormal::ZERO,
            tail: None,
            body_bytes_per_s: None,
            mutation_limit: None,
        }
    }

    /// A bucket in the instance's region: reads 30 ms, writes 80 ms, lists
    /// 50 ms (medians, σ 0.3), one request in 1,000 taking 1–2 s, bodies at
    /// 100 MB/s, one mutation a second per object with a burst of 3.
    pub fn gcs_regional() -> Self {
        Self {
            name: "gcs-regional",
            read: Lognormal::millis(30, 0.3),
            write: Lognormal::millis(80, 0.3),
            list: Lognormal::millis(50, 0.3),
            tail: Some(SLOW_TAIL),
            body_bytes_per_s: Some(100e6),
            mutation_limit: Some(MutationLimit::GCS),
        }
    }

    /// A slow day or a far bucket: reads 100 ms, writes 200 ms, lists 150 ms
    /// (σ 0.5), the same tail, bodies at 50 MB/s, the same mutation rate.
    pub fn gcs_slow() -> Self {
        Self {
            name: "gcs-slow",
            read: Lognormal::millis(100, 0.5),
            write: Lognormal::millis(200, 0.5),
            list: Lognormal::millis(150, 0.5),
            tail: Some(SLOW_TAIL),
            body_bytes_per_s: Some(50e6),
            mutation_limit: Some(MutationLimit::GCS),
        }
    }

    /// The profile called `name` (one of [`PROFILE_NAMES`]).
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "loopback" => Some(Self::loopback()),
            "gcs-regional" => Some(Self::gcs_regional()),
            "gcs-slow" => Some(Self::gcs_slow()),
            _ => None,
        }
    }

    /// The delay of one request of `kind`, before its bodies.
    pub fn delay(&self, kind: RequestKind, rng: &mut impl Rng) -> Duration {
        if let Some(tail) = self.tail
            && tail.one_in > 0
            && rng.random_range(0..tail.one_in) == 0
        {
            let span = tail.max.saturating_sub(tail.min);
            return tail.min + span.mul_f64(rng.random::<f64>());
        }
        match kind {
            RequestKind::Read => self.read,
            RequestKind::Write => self.write,
            RequestKind::List => self.list,
        }
        .sample(rng)
    }

    /// The time `bytes` of body take.
    pub fn body_time(&self, bytes: u64) -> Duration {
        match self.body_bytes_per_s {
            Some(rate) if rate > 0.0 && bytes > 0 => Duration::from_secs_f64(bytes as f64 / rate),
            _ => Duration::ZERO,
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A name that is not one of [`PROFILE_NAMES`].
#[derive(Debug, thiserror::Error)]
#[error("unknown storage profile {0:?} (known: loopback, gcs-regional, gcs-slow)")]
pub struct UnknownProfile(pub String);

impl FromStr for Profile {
    type Err = UnknownProfile;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::named(name).ok_or_else(|| UnknownProfile(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn samples(latency: Lognormal, n: usize) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(7);
        let mut all: Vec<f64> = (0..n)
            .map(|_| latency.sample(&mut rng).as_secs_f64() * 1000.0)
            .collect();
        all.sort_by(f64::total_cmp);
        all
    }

    #[test]
    fn a_lognormal_has_its_median_and_its_spread() {
        let all = samples(Lognormal::millis(80, 0.3), 20_000);
        let median = all[all.len() / 2];
        assert!((77.0..83.0).contains(&median), "median {median} ms");
        // The 84th percentile of a lognormal is median · e^σ.
        let p84 = all[all.len() * 841 / 1000];
        let expected = 80.0 * 0.3_f64.exp();
        assert!(
            (p84 - expected).abs() < expected * 0.05,
            "p84 {p84} ms, expected about {expected}"
        );
        assert!(all[0] > 0.0);
    }

    #[test]
    fn the_tail_is_rare_and_slow() {
        let profile = Profile::gcs_regional();
        let mut rng = StdRng::seed_from_u64(11);
        let n = 50_000;
        let slow = (0..n)
            .map(|_| profile.delay(RequestKind::Read, &mut rng))
            .filter(|d| *d >= Duration::from_secs(1))
            .count();
        // One in 1,000 (about 50); a read's own lognormal never gets near 1 s.
        assert!((25..=80).contains(&slow), "{slow} slow requests of {n}");
    }

    #[test]
    fn loopback_adds_nothing_and_names_resolve() {
        let mut rng = StdRng::seed_from_u64(1);
        let loopback: Profile = "loopback".parse().unwrap_or_else(|_| Profile::gcs_slow());
        assert_eq!(loopback.delay(RequestKind::Write, &mut rng), Duration::ZERO);
        assert_eq!(loopback.body_time(1 << 30), Duration::ZERO);
        for name in PROFILE_NAMES {
            assert_eq!(Profile::named(name).map(|p| p.name), Some(name));
        }
        assert!("gcs-fast".parse::<Profile>().is_err());
        let regional = Profile::gcs_regional();
        assert_eq!(regional.body_time(100_000_000), Duration::from_secs(1));
    }
}
