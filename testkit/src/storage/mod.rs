//! A storage latency and fault model: what fake-gcs-server on loopback (a
//! request in about a millisecond, never a refusal) is not.
//!
//! Every `sandboxd` under test reaches the emulator through its own proxy
//! ([`InstanceProxy`], its own loopback address), so one instance can be cut
//! off the bucket while its clients stay connected to it. The proxies of one
//! bucket share a [`StorageModel`]:
//! - each request is delayed by its kind (read, write, list) with a
//!   lognormal draw and a rare tail, plus its bodies at a throughput
//!   ([`Profile`]: `loopback`, `gcs-regional`, `gcs-slow`);
//! - mutations of one object are admitted at GCS's per-object rate (about
//!   one a second, a small burst), then answered 429 ([`MutationLimiter`]);
//! - a configurable share of requests is answered 429 or 503 at random;
//! - each instance can be partitioned ([`Partition`]);
//! - every request is recorded (instance, method, object, start, end,
//!   status), so a benchmark can count the requests of a window and how
//!   many of them were sequential ([`Tally`]).
//!
//! The numbers are a model, not a measurement of GCS: `docs/benchmarks.md`
//! says where they come from.

mod limiter;
mod profile;
mod proxy;
mod record;
mod request;

pub use limiter::{MutationLimit, MutationLimiter};
pub use profile::{Lognormal, PROFILE_NAMES, Profile, Tail, UnknownProfile};
pub use proxy::InstanceProxy;
pub use record::{
    CLASS_A_DOLLARS, CLASS_B_DOLLARS, RequestKind, RequestRecord, Tally, sequential,
    without_repeated_reads,
};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use http::StatusCode;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use crate::FixtureError;

/// How an instance reaches the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partition {
    Connected,
    /// New connections are closed at once and open ones are cut: requests
    /// fail fast with connection errors.
    Refuse,
    /// Requests are held unanswered until the partition ends (the client's
    /// own deadline is what ends them); nothing is refused.
    BlackHole,
}

/// The model shared by one bucket's proxies.
#[derive(Debug, Clone)]
pub struct StorageModel {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    profile: Profile,
    upstream: SocketAddr,
    limiter: Mutex<Option<MutationLimiter>>,
    /// Share of requests answered 429 or 503 at random, in millionths.
    transient_ppm: std::sync::atomic::AtomicU32,
    /// Responses still to lose: the request is passed on, then its
    /// connection cut before the answer.
    lose_responses: std::sync::atomic::AtomicU32,
    /// Requests still to hold for [`Shared::slow_for`] before passing on:
    /// a slow tail on demand.
    slow_requests: std::sync::atomic::AtomicU32,
    slow_for: Mutex<Duration>,
    rng: Mutex<StdRng>,
    records: Mutex<Vec<RequestRecord>>,
    /// Resumable uploads by `upload_id`: their object.
    uploads: Mutex<HashMap<String, String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StorageModel {
    /// A model of `profile` in front of the emulator at `upstream`
    /// (`127.0.0.N:80`).
    pub fn new(upstream: SocketAddr, profile: Profile) -> Self {
        Self {
            shared: Arc::new(Shared {
                limiter: Mutex::new(profile.mutation_limit.map(MutationLimiter::new)),
                profile,
                upstream,
                transient_ppm: std::sync::atomic::AtomicU32::new(0),
                lose_responses: std::sync::atomic::AtomicU32::new(0),
                slow_requests: std::sync::atomic::AtomicU32::new(0),
                slow_for: Mutex::new(Duration::ZERO),
                rng: Mutex::new(StdRng::from_os_rng()),
                records: Mutex::default(),
                uploads: Mutex::default(),
            }),
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.shared.profile
    }

    /// Starts the proxy through which `instance` reaches the bucket (on the
    /// running tokio runtime; it stops when dropped).
    pub async fn proxy(&self, instance: &str) -> Result<InstanceProxy, FixtureError> {
        InstanceProxy::start(Arc::clone(&self.shared), instance).await
    }

    /// Answers this share of requests (0.0–1.0) 429 or 503 at random,
    /// without passing them on.
    pub fn set_transient_faults(&self, share: f64) {
        let ppm = (share.clamp(0.0, 1.0) * 1e6) as u32;
        self.shared
            .transient_ppm
            .store(ppm, std::sync::atomic::Ordering::Relaxed);
    }

    /// Passes the next `count` requests on and then cuts their connections
    /// before the answer: a write lands, its client never hears of it.
    pub fn lose_next_responses(&self, count: u32) {
        self.shared
            .lose_responses
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// Holds the next `count` requests for `delay` more than the profile
    /// says before passing them on: the slow tail, when a test wants it.
    pub fn slow_next_requests(&self, count: u32, delay: Duration) {
        *lock(&self.shared.slow_for) = delay;
        self.shared
            .slow_requests
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// Every request recorded so far.
    pub fn records(&self) -> Vec<RequestRecord> {
        lock(&self.shared.records).clone()
    }

    /// The requests that started in `from..to`.
    pub fn records_between(&self, from: Instant, to: Instant) -> Vec<RequestRecord> {
        lock(&self.shared.records)
            .iter()
            .filter(|r| r.start >= from && r.start < to)
            .cloned()
            .collect()
    }

    /// Forgets the records (a long run's memory stays flat).
    pub fn clear_records(&self) {
        lock(&self.shared.records).clear();
    }
}

impl Shared {
    fn delay(&self, kind: RequestKind) -> Duration {
        let slowed = self
            .slow_requests
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok();
        let extra = if slowed {
            *lock(&self.slow_for)
        } else {
            Duration::ZERO
        };
        self.profile.delay(kind, &mut *lock(&self.rng)) + extra
    }

    /// A 429 or 503 to answer instead of passing the request on, at the
    /// configured share.
    fn injected_fault(&self) -> Option<StatusCode> {
        let ppm = self
            .transient_ppm
            .load(std::sync::atomic::Ordering::Relaxed);
        if ppm == 0 {
            return None;
        }
        let mut rng = lock(&self.rng);
        (rng.random_range(0..1_000_000) < ppm).then(|| {
            if rng.random::<bool>() {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            }
        })
    }

    /// True if this response is to be lost (takes one of the count).
    fn lose_response(&self) -> bool {
        self.lose_responses
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok()
    }

    fn admit_mutation(&self, object: &str) -> bool {
        match lock(&self.limiter).as_mut() {
            Some(limiter) if !object.is_empty() => limiter.admit(object, Instant::now()),
            _ => true,
        }
    }

    fn remember_upload(&self, id: String, object: String) {
        lock(&self.uploads).insert(id, object);
    }

    fn upload_object(&self, id: &str) -> Option<String> {
        lock(&self.uploads).get(id).cloned()
    }

    fn record(&self, record: RequestRecord) {
        lock(&self.records).push(record);
    }
}
