//! Leases and the reconcile loop: durations, intervals, retention, what a
//! holder does with a running execution when asked to move.

use clap::{Args, ValueEnum};

/// What a holder does with a running execution when another instance asks for
/// the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HandoffArg {
    /// Kill it and move at once (the earlier server's behaviour).
    Force,
    /// Let it finish; the attach waits.
    Wait,
}

/// Leases and the reconcile loop.
#[derive(Debug, Clone, Args)]
pub struct ControlArgs {
    /// Lease duration (the instance lease, and a sandbox lock's own grace
    /// after acquisition): how long a dead instance keeps its sandboxes
    /// before another may take them over.
    #[arg(long, env = "SANDBOXD_LEASE_DURATION_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = 15)]
    pub lease_duration_s: u64,
    /// Tolerated clock difference between instances.
    #[arg(long, env = "SANDBOXD_CLOCK_SKEW_S", value_parser = clap::value_parser!(u64).range(0..=600), default_value_t = 2)]
    pub clock_skew_s: u64,
    /// Instance lease renewal interval (one write for all the sandboxes the
    /// instance holds); must be under the duration minus the skew.
    #[arg(long, env = "SANDBOXD_RENEW_INTERVAL_S", default_value_t = 10.0)]
    pub renew_interval_s: f64,
    /// Full re-read of each held sandbox's metadata and lock: raw edits made
    /// without `sandboxctl` (which rings the holder) take effect within this.
    #[arg(long, env = "SANDBOXD_RESYNC_INTERVAL_S", value_parser = clap::value_parser!(u64).range(1..=86_400), default_value_t = 60)]
    pub resync_interval_s: u64,
    /// How often an instance that holds sandboxes reads its doorbell (where
    /// other instances and `sandboxctl` ring it after writing an intent).
    #[arg(long, env = "SANDBOXD_DOORBELL_POLL_MS", value_parser = clap::value_parser!(u64).range(10..=60_000), default_value_t = 400)]
    pub doorbell_poll_ms: u64,
    /// How often it reads it instead while a client attached to it sent a
    /// frame within the last minute (the instance serves requests then).
    #[arg(long, env = "SANDBOXD_DOORBELL_POLL_ACTIVE_MS", value_parser = clap::value_parser!(u64).range(10..=60_000), default_value_t = 200)]
    pub doorbell_poll_active_ms: u64,
    #[arg(long, env = "SANDBOXD_HANDOFF_RUNNING_EXECUTION", value_enum, default_value_t = HandoffArg::Force)]
    pub handoff_running_execution: HandoffArg,
    /// Superseded unnamed checkpoints kept per sandbox besides the latest.
    #[arg(long, env = "SANDBOXD_KEEP_CHECKPOINTS", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1000), default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Checkpoint held checkpointable sandboxes this often, between
    /// executions (0: never); bounds what a crash of this instance loses.
    #[arg(long, env = "SANDBOXD_CHECKPOINT_INTERVAL_S", value_parser = clap::value_parser!(u64).range(0..=2_592_000), default_value_t = 0)]
    pub checkpoint_interval_s: u64,
    /// Fault tests only: abort the process at this step of a handoff
    /// (handoff:before-checkpoint, handoff:after-upload, handoff:after-record).
    #[arg(long, env = "SANDBOXD_FAILPOINT", hide = true)]
    pub failpoint: Option<String>,
    /// How long a deleted sandbox's tombstone stays before its objects go.
    #[arg(long, env = "SANDBOXD_TOMBSTONE_RETENTION_S", value_parser = clap::value_parser!(u64).range(0..=31_536_000), default_value_t = 600)]
    pub tombstone_retention_s: u64,
}

/// A combination of lease settings that cannot keep a hold alive.
#[derive(Debug, thiserror::Error)]
#[error(
    "--renew-interval-s {renew}s must be positive and under --lease-duration-s {duration}s minus \
     --clock-skew-s {skew}s, or every hold would lapse between renewals"
)]
pub struct LeaseSettingsError {
    renew: f64,
    duration: u64,
    skew: u64,
}

impl ControlArgs {
    /// Checks that renewals can keep the instance lease alive.
    pub fn validate(&self) -> Result<(), LeaseSettingsError> {
        let window = self.lease_duration_s.saturating_sub(self.clock_skew_s) as f64;
        if self.renew_interval_s.is_finite()
            && self.renew_interval_s > 0.0
            && self.renew_interval_s < window
        {
            Ok(())
        } else {
            Err(LeaseSettingsError {
                renew: self.renew_interval_s,
                duration: self.lease_duration_s,
                skew: self.clock_skew_s,
            })
        }
    }

    pub fn lease(&self) -> controllers::leasing::LeaseConfig {
        let seconds = |s: u64| chrono::Duration::seconds(i64::try_from(s).unwrap_or(i64::MAX));
        controllers::leasing::LeaseConfig {
            duration: seconds(self.lease_duration_s.max(1)),
            skew_tolerance: seconds(self.clock_skew_s),
            ..controllers::leasing::LeaseConfig::default()
        }
    }

    pub fn reconciler(&self) -> controllers::sandboxes::ReconcilerConfig {
        use std::time::Duration;
        controllers::sandboxes::ReconcilerConfig {
            renew_interval: Duration::try_from_secs_f64(self.renew_interval_s)
                .unwrap_or(Duration::from_secs(1))
                .max(Duration::from_millis(100)),
            resync_interval: Duration::from_secs(self.resync_interval_s.max(1)),
            doorbell_poll: Duration::from_millis(self.doorbell_poll_ms.max(10)),
            doorbell_poll_active: Duration::from_millis(self.doorbell_poll_active_ms.max(10)),
            handoff: match self.handoff_running_execution {
                HandoffArg::Force => controllers::sandboxes::HandoffPolicy::Force,
                HandoffArg::Wait => controllers::sandboxes::HandoffPolicy::Wait,
            },
            keep_checkpoints: self.keep_checkpoints,
            tombstone_retention: Duration::from_secs(self.tombstone_retention_s),
            failpoint: self.failpoint.clone(),
            checkpoint_interval: (self.checkpoint_interval_s > 0)
                .then(|| Duration::from_secs(self.checkpoint_interval_s)),
            ..controllers::sandboxes::ReconcilerConfig::default()
        }
    }
}
