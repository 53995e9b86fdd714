//! Time as the controllers see it: injected, so that lease expiry and requeue
//! timing can be simulated deterministically (a manual clock under `testing`).

use std::fmt;

use chrono::{DateTime, Utc};

/// A source of wall-clock time. Leases compare timestamps written by different
/// instances, so this is wall time (UTC), not a monotonic instant.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> DateTime<Utc>;
}

/// The host's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}
