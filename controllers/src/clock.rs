//! Time as the controllers see it: injected, so that lease expiry and requeue
//! timing can be simulated deterministically (a manual clock under `testing`).
//! Every reading of time in the controllers goes through a [`Clock`]: this
//! module is the only one that reads the host's clocks.

use std::fmt;

use chrono::{DateTime, Utc};

/// A source of time, two kinds of it.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Wall-clock time (UTC). Leases compare timestamps written by different
    /// instances, so these are wall time, not a monotonic instant.
    fn now(&self) -> DateTime<Utc>;

    /// A monotonic reading, for durations and deadlines on this host only
    /// (never written, never compared across instances). Tokio's, so that
    /// a paused runtime (the tests, the simulation) moves it together with
    /// the timers that wait for those deadlines.
    fn instant(&self) -> tokio::time::Instant {
        #[allow(
            clippy::disallowed_methods,
            reason = "the clock module is where the host's time is read"
        )]
        tokio::time::Instant::now()
    }
}

/// The host's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        #[allow(
            clippy::disallowed_methods,
            reason = "the clock module is where the host's time is read"
        )]
        Utc::now()
    }
}
