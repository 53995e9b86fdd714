//! What one tenant may hold of an instance: each client socket's reply
//! budget and deadlines (`api/session/out.rs`), the deadlines of
//! connections that never become a request (`server/connections.rs`), the
//! instance-wide bounds that many tenants together meet (the connection
//! limit, the budget of frames kept while handshakes wait), and the other
//! per-tenant limits (origins, callers' quotas, lifetimes,
//! snapshot quotas, the operator credential). `docs/security.md` says why
//! each exists and how it is tested.

use std::time::Duration;

use clap::Args;

use crate::api::session::SocketSettings;

#[derive(Debug, Clone, Args)]
pub struct TenantArgs {
    /// Bytes of replies one WebSocket may have waiting to be written; a
    /// session whose client reads slower stops taking its requests.
    #[arg(long, env = "SANDBOXD_WS_REPLY_BUDGET_BYTES", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(65_536..=1 << 30), default_value_t = crate::api::session::DEFAULT_REPLY_BUDGET_BYTES)]
    pub ws_reply_budget_bytes: usize,
    /// Seconds a write to a WebSocket may make no progress (the client
    /// reads nothing) before the socket is closed with 1008.
    #[arg(long, env = "SANDBOXD_WS_STALL_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = crate::api::session::DEFAULT_STALL_TIMEOUT.as_secs())]
    pub ws_stall_timeout_s: u64,
    /// Seconds between the server's pings on a WebSocket.
    #[arg(long, env = "SANDBOXD_WS_PING_INTERVAL_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = crate::api::session::DEFAULT_PING_INTERVAL.as_secs())]
    pub ws_ping_interval_s: u64,
    /// Seconds a WebSocket client that is read may send nothing (pongs
    /// count) before it is closed with 1001.
    #[arg(long, env = "SANDBOXD_WS_PING_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = crate::api::session::DEFAULT_PING_TIMEOUT.as_secs())]
    pub ws_ping_timeout_s: u64,
    /// Seconds a `/create` WebSocket may take to send its init message
    /// whole; a slower one is closed with `SANDBOX_CREATION_ERROR`.
    #[arg(long, env = "SANDBOXD_WS_INIT_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = crate::api::session::DEFAULT_INIT_TIMEOUT.as_secs())]
    pub ws_init_timeout_s: u64,
    /// Bytes of client frames that all WebSockets whose create or attach
    /// waits may keep between them for their sessions; a socket whose frame
    /// does not fit is not read until others' sessions take theirs or its
    /// own starts. At least one message of the largest size (4 MiB).
    #[arg(long, env = "SANDBOXD_WS_EARLY_FRAMES_BUDGET_BYTES", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(4_194_304..=68_719_476_736), default_value_t = crate::api::session::DEFAULT_EARLY_FRAMES_BUDGET_BYTES)]
    pub ws_early_frames_budget_bytes: usize,
    /// Connections open at once (WebSocket sessions included); more wait
    /// at `accept`, and at the limit the one idle the longest is closed.
    /// Each WebSocket may hold a few MiB while it reads a message, so size
    /// this to the instance's memory.
    #[arg(long, env = "SANDBOXD_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..=1_048_576), default_value_t = crate::server::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: u32,
    /// Seconds from a request's first byte to its complete headers; a
    /// slower connection is closed.
    #[arg(long, env = "SANDBOXD_HEADER_READ_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = crate::server::DEFAULT_HEADER_READ_TIMEOUT.as_secs())]
    pub header_read_timeout_s: u64,
    /// Seconds a connection with no request in flight (and not a
    /// WebSocket) may stay silent before it is closed.
    #[arg(long, env = "SANDBOXD_CONNECTION_IDLE_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=86_400), default_value_t = crate::server::DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub connection_idle_timeout_s: u64,
    /// Browser origins allowed to call the server (`https://app.example`,
    /// comma-separated). A request with another `Origin` header is refused
    /// with 403; requests without one (non-browser clients) pass.
    #[arg(long, env = "SANDBOXD_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Also allow the server's own origin (an `Origin` naming the request's
    /// `Host`).
    #[arg(long, env = "SANDBOXD_ALLOW_SAME_ORIGIN", default_value_t = true, action = clap::ArgAction::Set)]
    pub allow_same_origin: bool,
    /// Seconds a sandbox may run on an instance in one go (from its start
    /// or restore there); then it is checkpointed if it allows checkpoints
    /// (it restores at its next attach), else deleted.
    #[arg(long, env = "SANDBOXD_MAX_SANDBOX_LIFETIME_S", value_parser = clap::value_parser!(u64).range(1..=31_536_000), default_value_t = crate::api::live::DEFAULT_MAX_LIFETIME.as_secs())]
    pub max_sandbox_lifetime_s: u64,
    /// Seconds an execution may run with no client attached; then it is
    /// killed (the sandbox stays).
    #[arg(long, env = "SANDBOXD_MAX_DETACHED_EXECUTION_S", value_parser = clap::value_parser!(u64).range(1..=31_536_000), default_value_t = crate::api::live::DEFAULT_MAX_DETACHED_EXECUTION.as_secs())]
    pub max_detached_execution_s: u64,
    /// Sandboxes one caller (the identity Cloud Run verified, with
    /// `--caller-identity-verified`, else the client address) may hold on
    /// an instance. 0: the instance's
    /// sandbox capacity less one, so that no caller fills an instance alone
    /// (no limit without admission).
    #[arg(long, env = "SANDBOXD_MAX_SANDBOXES_PER_CALLER", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=100_000), default_value_t = 0)]
    pub max_sandboxes_per_caller: usize,
    /// The platform verified the bearer ID token of every request (Cloud
    /// Run with IAM: `roles/run.invoker` granted to identities, not to
    /// `allUsers`): callers are the token's identity (`email`, else `sub`).
    /// Off, a token is anyone's to write, and callers are their addresses.
    #[arg(long, env = "SANDBOXD_CALLER_IDENTITY_VERIFIED", default_value_t = false, action = clap::ArgAction::Set)]
    pub caller_identity_verified: bool,
    /// The operator credential: a client that sends it in `X-Operator-Token`
    /// may read `/list`, `/metrics`, `/images` and `/readyz`'s detail from
    /// anywhere (clients on this machine always may). Unset: only they may.
    #[arg(long, env = "SANDBOXD_OPERATOR_TOKEN", hide_env_values = true)]
    pub operator_token: Option<String>,
    /// Filesystem snapshots (names) one owner may keep; a snapshot under a
    /// new name past it is refused (overwriting one works).
    #[arg(long, env = "SANDBOXD_MAX_SNAPSHOTS_PER_OWNER", value_parser = clap::value_parser!(u64).range(1..=1_000_000), default_value_t = crate::api::snapshot_quota::DEFAULT_MAX_SNAPSHOTS_PER_OWNER)]
    pub max_snapshots_per_owner: u64,
    /// MiB of snapshot objects one owner may keep; once reached, its
    /// snapshots are refused.
    #[arg(long, env = "SANDBOXD_MAX_SNAPSHOT_MB_PER_OWNER", value_parser = clap::value_parser!(u64).range(1..=16_777_216), default_value_t = crate::api::snapshot_quota::DEFAULT_MAX_SNAPSHOT_BYTES_PER_OWNER >> 20)]
    pub max_snapshot_mb_per_owner: u64,
}

impl TenantArgs {
    pub fn snapshot_quota(&self) -> crate::api::snapshot_quota::SnapshotQuota {
        crate::api::snapshot_quota::SnapshotQuota {
            max_count: self.max_snapshots_per_owner,
            max_bytes: self.max_snapshot_mb_per_owner.saturating_mul(1 << 20),
        }
    }

    /// `--max-sandboxes-per-caller`, with 0 resolved against admission:
    /// the sandboxes that fit less one (at least one); `None` without
    /// admission.
    pub fn sandboxes_per_caller(
        &self,
        admission: Option<&crate::api::admission::AdmissionSettings>,
    ) -> Option<usize> {
        if self.max_sandboxes_per_caller > 0 {
            return Some(self.max_sandboxes_per_caller);
        }
        let admission = admission?;
        let fit = admission
            .capacity_bytes
            .checked_div(admission.sandbox_bytes)?;
        Some(
            usize::try_from(fit)
                .unwrap_or(usize::MAX)
                .saturating_sub(1)
                .max(1),
        )
    }

    pub fn lifetimes(&self) -> crate::api::live::Lifetimes {
        crate::api::live::Lifetimes {
            max_lifetime: Duration::from_secs(self.max_sandbox_lifetime_s),
            max_detached_execution: Duration::from_secs(self.max_detached_execution_s),
        }
    }

    pub fn origins(&self) -> crate::server::origin::OriginPolicy {
        crate::server::origin::OriginPolicy {
            allowed: self
                .allowed_origins
                .iter()
                .map(|origin| origin.trim().to_owned())
                .filter(|origin| !origin.is_empty())
                .collect(),
            same_origin: self.allow_same_origin,
        }
    }

    pub fn connection_deadlines(&self) -> crate::server::ConnectionDeadlines {
        crate::server::ConnectionDeadlines {
            header_read: Duration::from_secs(self.header_read_timeout_s),
            idle: Duration::from_secs(self.connection_idle_timeout_s),
        }
    }

    pub fn socket(&self) -> SocketSettings {
        SocketSettings {
            reply_budget_bytes: self.ws_reply_budget_bytes,
            stall_timeout: Duration::from_secs(self.ws_stall_timeout_s),
            ping_interval: Duration::from_secs(self.ws_ping_interval_s),
            ping_timeout: Duration::from_secs(self.ws_ping_timeout_s),
            init_timeout: Duration::from_secs(self.ws_init_timeout_s),
        }
    }
}
