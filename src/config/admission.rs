//! Admission: the instance's memory capacity, the server's reserve, and how
//! long a start waits for idle sandboxes to make room (`api/admission`).

use std::time::Duration;

use clap::Args;

use crate::api::admission::{AdmissionSettings, capacity};

/// How much memory sandboxes may commit here.
#[derive(Debug, Clone, Args)]
pub struct AdmissionArgs {
    /// This instance's memory in MiB. Unset: the server's cgroup limit
    /// (v2 `memory.max`, v1 `memory.limit_in_bytes`), else `MemTotal`.
    #[arg(long, env = "SANDBOXD_MEMORY_CAPACITY_MB", value_parser = clap::value_parser!(u64).range(1..=16_777_216))]
    pub memory_capacity_mb: Option<u64>,
    /// Memory (MiB) kept for the server itself (its buffers, checkpoint
    /// uploads, the page cache) and never committed to sandboxes.
    #[arg(long, env = "SANDBOXD_MEMORY_RESERVE_MB", value_parser = clap::value_parser!(u64).range(0..=1_048_576), default_value_t = 512)]
    pub memory_reserve_mb: u64,
    /// Seconds a create or restore that does not fit waits for the idle
    /// sandboxes asked to make room to checkpoint and leave, before it is
    /// refused.
    #[arg(long, env = "SANDBOXD_ADMISSION_WAIT_S", value_parser = clap::value_parser!(u64).range(0..=600), default_value_t = 30)]
    pub admission_wait_s: u64,
    /// `POST /execute` requests served at once (each boots a one-shot
    /// sandbox); more are refused with 429.
    #[arg(long, env = "SANDBOXD_MAX_CONCURRENT_EXECUTES", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096), default_value_t = crate::api::limits::DEFAULT_MAX_CONCURRENT_EXECUTES)]
    pub max_concurrent_executes: usize,
    /// Forks starting at once (each copies a checkpoint and restores it);
    /// more are refused with `SANDBOX_CREATION_ERROR`.
    #[arg(long, env = "SANDBOXD_MAX_CONCURRENT_FORKS", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024), default_value_t = crate::api::limits::DEFAULT_MAX_CONCURRENT_FORKS)]
    pub max_concurrent_forks: usize,
    /// Named checkpoints one sandbox may keep; a checkpoint under a new name
    /// beyond it is refused (`SANDBOX_CHECKPOINT_ERROR`), reusing a name works.
    #[arg(long, env = "SANDBOXD_MAX_NAMED_CHECKPOINTS", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=10_000), default_value_t = crate::api::features::DEFAULT_MAX_NAMED_CHECKPOINTS)]
    pub max_named_checkpoints: usize,
}

/// Settings that cannot admit anything.
#[derive(Debug, thiserror::Error)]
#[error(
    "the instance's {capacity_mib} MiB ({measured_by}) minus --memory-reserve-mb {reserve_mib} leave \
     less than one sandbox's --sandbox-memory-mb {sandbox_mib} and {buffers_mib} MiB of the server's \
     buffers for its session: every create would be refused"
)]
pub struct CapacityError {
    capacity_mib: u64,
    measured_by: String,
    reserve_mib: u64,
    sandbox_mib: u64,
    buffers_mib: u64,
}

impl AdmissionArgs {
    /// The concurrency caps.
    pub fn limits(&self) -> crate::api::limits::LimitSettings {
        crate::api::limits::LimitSettings {
            max_concurrent_executes: self.max_concurrent_executes,
            max_concurrent_forks: self.max_concurrent_forks,
        }
    }

    /// The ledger's settings for sandboxes of `sandbox_mb` each (0: no
    /// limit, so nothing to count: admission is off, logged), each counted
    /// with `buffer_bytes` of the server's buffers for its session
    /// (`admission::session_buffer_bytes`), and a warm pool of `warm_pool`.
    pub fn settings(
        &self,
        sandbox_mb: u64,
        buffer_bytes: u64,
        warm_pool: usize,
    ) -> Result<Option<AdmissionSettings>, CapacityError> {
        if sandbox_mb == 0 {
            tracing::warn!(
                "--sandbox-memory-mb 0 (no per-sandbox limit): admission is off, nothing bounds the sandboxes' memory"
            );
            return Ok(None);
        }
        let (capacity_mib, source) = match self.memory_capacity_mb {
            Some(mib) => (mib, "--memory-capacity-mb".to_owned()),
            None => match capacity::detect() {
                Some(found) => (found.bytes >> 20, found.source),
                None => {
                    tracing::warn!(
                        "cannot read this instance's memory (no cgroup limit, no /proc/meminfo): admission is off; set --memory-capacity-mb"
                    );
                    return Ok(None);
                }
            },
        };
        let usable = capacity_mib.saturating_sub(self.memory_reserve_mb) << 20;
        let sandbox_bytes = (sandbox_mb << 20).saturating_add(buffer_bytes);
        if usable < sandbox_bytes {
            return Err(CapacityError {
                capacity_mib,
                measured_by: source,
                reserve_mib: self.memory_reserve_mb,
                sandbox_mib: sandbox_mb,
                buffers_mib: buffer_bytes >> 20,
            });
        }
        tracing::info!(
            capacity_mib,
            %source,
            reserve_mib = self.memory_reserve_mb,
            sandbox_mib = sandbox_mb,
            buffers_mib = buffer_bytes >> 20,
            sandboxes = usable / sandbox_bytes,
            "admission: sandbox memory capacity"
        );
        Ok(Some(AdmissionSettings {
            capacity_bytes: usable,
            sandbox_bytes,
            wait: Duration::from_secs(self.admission_wait_s),
            warm_pool,
        }))
    }
}
