//! A clock that moves only when a test says so.

use std::sync::{Arc, Mutex, PoisonError};

use chrono::{DateTime, Duration, TimeZone, Utc};

use crate::clock::Clock;

/// A shared, manually advanced clock. Clones see the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock at a fixed, arbitrary instant (2026-01-01T00:00:00Z).
    pub fn new() -> Self {
        let start = Utc
            .with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
            .single()
            .unwrap_or(DateTime::<Utc>::UNIX_EPOCH);
        Self::at(start)
    }

    pub fn at(now: DateTime<Utc>) -> Self {
        Self {
            now: Arc::new(Mutex::new(now)),
        }
    }

    /// A separate clock offset from this one by `offset` now (it does not follow
    /// later advances): for instances whose clocks disagree.
    pub fn skewed(&self, offset: Duration) -> Self {
        Self::at(self.now() + offset)
    }

    /// A view of this clock that is always `offset` ahead (or behind): it
    /// follows later advances, like two hosts' clocks that disagree.
    pub fn offset(&self, offset: Duration) -> OffsetClock {
        OffsetClock {
            base: self.clone(),
            offset,
        }
    }

    pub fn advance(&self, by: Duration) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }

    pub fn set(&self, to: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = to;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A [`ManualClock`] seen with a constant offset.
#[derive(Debug, Clone)]
pub struct OffsetClock {
    base: ManualClock,
    offset: Duration,
}

impl crate::clock::Clock for OffsetClock {
    fn now(&self) -> DateTime<Utc> {
        crate::clock::Clock::now(&self.base) + self.offset
    }
}
