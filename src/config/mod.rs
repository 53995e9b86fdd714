//! Configuration from flags and environment variables, in one place.
//!
//! Variable names follow the earlier Python server (`SANDBOX_METADATA_BUCKET`,
//! `SANDBOX_CHECKPOINT_BUCKET`, `FILESYSTEM_SNAPSHOT_BUCKET`, their `*_MOUNT_PATH`
//! variants, `PORT`, `LOG_LEVEL`) so existing deployments carry over. Parsing is
//! clap's; turning the parsed values into decisions (which store for which
//! artifact, which address to listen on) is plain functions tested without
//! touching the process environment. `docs/configuration.md` lists everything.

//!
//! One file per group of flags: `storage.rs` (which store for which
//! artifact), `runtime.rs` (runsc, the sandboxes' limits), `control.rs`
//! (leases and the reconcile loop), `network.rs` (sandbox networking),
//! `workspace.rs` (workspace sync), `tenant.rs` (what one client may hold);
//! logging and `sandboxd serve` itself here.

use std::net::{Ipv4Addr, SocketAddr};

use clap::{Args, ValueEnum};

mod admission;
mod control;
mod network;
mod runtime;
mod storage;
mod tenant;
mod workspace;

pub use admission::{AdmissionArgs, CapacityError};
pub use control::{ControlArgs, HandoffArg, LeaseSettingsError};
pub use network::{NetnsWorkaroundArg, NetworkArgs};
pub use runtime::RuntimeArgs;
pub use storage::{StorageArgs, StorageLayout, StoreLocation};
pub use tenant::TenantArgs;
pub use workspace::WorkspaceArgs;

/// Default listen address when neither `--listen` nor `PORT` is given.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line with Cloud Logging's `severity` field.
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log filter (`info`, `sandboxd=debug,info`, ...).
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `sandboxd serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on; defaults to 0.0.0.0:$PORT when PORT is set (Cloud
    /// Run), else 127.0.0.1:8080.
    #[arg(long, env = "SANDBOXD_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// The port Cloud Run assigns.
    #[arg(long, env = "PORT")]
    pub port: Option<u16>,
    /// This instance's id in leases; defaults to a random one per process.
    #[arg(long, env = "SANDBOXD_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Seconds granted on SIGTERM to checkpoint (or delete) the sandboxes
    /// running here; Cloud Run allows 10 in all.
    #[arg(long, env = "SANDBOXD_SHUTDOWN_GRACE_S", value_parser = clap::value_parser!(u64).range(0..=3600), default_value_t = 8)]
    pub shutdown_grace_s: u64,
    /// Filesystem snapshot names are deployment-wide and need no owner's
    /// proof, as on the earlier server: for a deployment used by one team
    /// only (docs/security.md). Off: a snapshot belongs to the sandbox that
    /// made it.
    #[arg(long, env = "SANDBOXD_SHARED_SNAPSHOTS", default_value_t = false, action = clap::ArgAction::Set)]
    pub shared_snapshots: bool,
    /// Output one `POST /execute` returns (stdout and stderr together); the
    /// rest is discarded after a marker line.
    #[arg(long, env = "SANDBOXD_EXECUTE_MAX_OUTPUT_BYTES", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=1 << 30), default_value_t = 1 << 20)]
    pub execute_max_output_bytes: usize,
    /// How long a `POST /execute` script may run before it is killed.
    #[arg(long, env = "SANDBOXD_EXECUTE_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=86_400), default_value_t = 300)]
    pub execute_timeout_s: u64,
    #[command(flatten)]
    pub storage: StorageArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub network: NetworkArgs,
    #[command(flatten)]
    pub control: ControlArgs,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    #[command(flatten)]
    pub tenant: TenantArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

impl ServeArgs {
    pub fn listen_addr(&self) -> SocketAddr {
        match (self.listen, self.port) {
            (Some(addr), _) => addr,
            (None, Some(port)) => {
                SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
            }
            (None, None) => DEFAULT_LISTEN,
        }
    }
}

/// Parses `--sandbox-cpus`: a finite number of cores from 0 (no limit) to
/// 1024. Every other numeric flag is range-checked by clap the same way, at
/// parse time: an absurd value is an error naming the flag, never an
/// overflow later (docs/security.md).
fn cpu_cores(text: &str) -> Result<f64, String> {
    let cores: f64 = text
        .parse()
        .map_err(|err| format!("{text:?} is not a number: {err}"))?;
    if cores.is_finite() && (0.0..=1024.0).contains(&cores) {
        Ok(cores)
    } else {
        Err(format!("{text} is not from 0 (no limit) to 1024 cores"))
    }
}

#[cfg(test)]
mod tests;
