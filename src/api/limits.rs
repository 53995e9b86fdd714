//! Concurrency caps of their own for the starts that cost most besides a
//! sandbox's memory (docs/security.md): forks (each copies a checkpoint in the
//! bucket and restores it) and `POST /execute` requests (each boots a
//! one-shot sandbox). A start over its cap is refused at once with a message
//! naming the cap and its flag, never queued: a client that floods the
//! instance gets answers, not a growing backlog. Named checkpoints have a
//! per-sandbox cap, checked where they are asked for (`session/frames.rs`,
//! `Features::max_named_checkpoints`). And what one `POST /execute` may
//! cost ([`ExecuteLimits`]: its output and its run time).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Default of `--max-concurrent-executes`.
pub const DEFAULT_MAX_CONCURRENT_EXECUTES: usize = 16;
/// Default of `--max-concurrent-forks`.
pub const DEFAULT_MAX_CONCURRENT_FORKS: usize = 4;

/// The caps, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitSettings {
    pub max_concurrent_executes: usize,
    pub max_concurrent_forks: usize,
}

impl Default for LimitSettings {
    fn default() -> Self {
        Self {
            max_concurrent_executes: DEFAULT_MAX_CONCURRENT_EXECUTES,
            max_concurrent_forks: DEFAULT_MAX_CONCURRENT_FORKS,
        }
    }
}

/// A start refused because its cap is reached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{limit} {what} are in progress on this instance, the most allowed ({flag}); try again shortly"
)]
pub struct Busy {
    pub what: &'static str,
    pub limit: usize,
    pub flag: &'static str,
}

/// The slots of one instance.
#[derive(Debug)]
pub struct Limits {
    settings: LimitSettings,
    executes: Arc<Semaphore>,
    forks: Arc<Semaphore>,
}

impl Limits {
    pub fn new(settings: LimitSettings) -> Self {
        Self {
            settings,
            executes: Arc::new(Semaphore::new(settings.max_concurrent_executes)),
            forks: Arc::new(Semaphore::new(settings.max_concurrent_forks)),
        }
    }

    /// A slot for one `POST /execute`, held until its sandbox is destroyed.
    pub fn execute_slot(&self) -> Result<OwnedSemaphorePermit, Busy> {
        Arc::clone(&self.executes)
            .try_acquire_owned()
            .map_err(|_| Busy {
                what: "POST /execute requests",
                limit: self.settings.max_concurrent_executes,
                flag: "--max-concurrent-executes",
            })
    }

    /// A slot for one fork, held until it runs or fails.
    pub fn fork_slot(&self) -> Result<OwnedSemaphorePermit, Busy> {
        Arc::clone(&self.forks)
            .try_acquire_owned()
            .map_err(|_| Busy {
                what: "forks",
                limit: self.settings.max_concurrent_forks,
                flag: "--max-concurrent-forks",
            })
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::new(LimitSettings::default())
    }
}

/// What one `POST /execute` may cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecuteLimits {
    /// Output returned (stdout and stderr together) before the marker.
    pub max_output_bytes: usize,
    /// How long the script may run.
    pub timeout: Duration,
}

/// Default of `--execute-max-output-bytes`.
pub const DEFAULT_MAX_OUTPUT_BYTES: usize = 1 << 20;
/// Default of `--execute-timeout-s`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for ExecuteLimits {
    fn default() -> Self {
        Self {
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_over_its_cap_is_refused_naming_the_cap_and_a_freed_slot_is_reused() {
        let limits = Limits::new(LimitSettings {
            max_concurrent_executes: 2,
            max_concurrent_forks: 1,
        });
        let first = limits.execute_slot().expect("one");
        let _second = limits.execute_slot().expect("two");
        let busy = limits.execute_slot().expect_err("three");
        assert_eq!(
            busy.to_string(),
            "2 POST /execute requests are in progress on this instance, the most allowed \
             (--max-concurrent-executes); try again shortly"
        );
        // The caps are separate.
        let fork = limits.fork_slot().expect("a fork");
        assert!(
            limits
                .fork_slot()
                .unwrap_err()
                .to_string()
                .contains("--max-concurrent-forks")
        );
        drop((first, fork));
        let _freed = limits.execute_slot().expect("freed");
        let _fork = limits.fork_slot().expect("freed");
    }
}
