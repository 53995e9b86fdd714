//! Configuration from flags and environment variables, in one place.
//!
//! Variable names follow the earlier Python server (`SANDBOX_METADATA_BUCKET`,
//! `SANDBOX_CHECKPOINT_BUCKET`, `FILESYSTEM_SNAPSHOT_BUCKET`, their `*_MOUNT_PATH`
//! variants, `PORT`, `LOG_LEVEL`) so existing deployments carry over. Parsing is
//! clap's; turning the parsed values into decisions (which store for which
//! artifact, which address to listen on) is plain functions tested without
//! touching the process environment. `docs/configuration.md` lists everything.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Default listen address when neither `--listen` nor `PORT` is given.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);

/// Where the bucket objects live.
#[derive(Debug, Clone, Args)]
pub struct StorageArgs {
    /// Directory of the embedded local store, used for every artifact that has
    /// no bucket or mount path configured.
    #[arg(long, env = "SANDBOXD_DATA_DIR", default_value = "sandboxd-data")]
    pub data_dir: PathBuf,
    /// GCS bucket for sandbox metadata and leases.
    #[arg(long, env = "SANDBOX_METADATA_BUCKET")]
    pub metadata_bucket: Option<String>,
    /// A mounted directory (e.g. GCS FUSE) for metadata; wins over the bucket.
    #[arg(long, env = "SANDBOX_METADATA_MOUNT_PATH")]
    pub metadata_mount_path: Option<PathBuf>,
    /// GCS bucket for checkpoint images.
    #[arg(long, env = "SANDBOX_CHECKPOINT_BUCKET")]
    pub checkpoint_bucket: Option<String>,
    #[arg(long, env = "SANDBOX_CHECKPOINT_MOUNT_PATH")]
    pub checkpoint_mount_path: Option<PathBuf>,
    /// GCS bucket for filesystem snapshots.
    #[arg(long, env = "FILESYSTEM_SNAPSHOT_BUCKET")]
    pub snapshot_bucket: Option<String>,
    #[arg(long, env = "FILESYSTEM_SNAPSHOT_MOUNT_PATH")]
    pub snapshot_mount_path: Option<PathBuf>,
    /// GCS bucket for synced workspaces; unset: the checkpoint bucket's
    /// (under `workspaces/`), or the local store.
    #[arg(long, env = "SANDBOX_WORKSPACE_BUCKET")]
    pub workspace_bucket: Option<String>,
    #[arg(long, env = "SANDBOX_WORKSPACE_MOUNT_PATH")]
    pub workspace_mount_path: Option<PathBuf>,
    /// A fake-gcs-server to use instead of GCS (`127.0.0.3:80` or a URL).
    #[arg(long, env = "STORAGE_EMULATOR_HOST")]
    pub storage_emulator_host: Option<String>,
}

pub use crate::store::StoreLocation;

/// The three artifact kinds the design separates (seed 003).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageLayout {
    pub metadata: StoreLocation,
    pub checkpoints: StoreLocation,
    pub snapshots: StoreLocation,
    pub workspaces: StoreLocation,
}

impl StorageArgs {
    /// Decides each artifact's location: mount path, else bucket, else the
    /// local data directory.
    pub fn layout(&self) -> StorageLayout {
        let choose = |mount: &Option<PathBuf>, bucket: &Option<String>| match (mount, bucket) {
            (Some(path), _) => StoreLocation::Directory(path.clone()),
            (None, Some(bucket)) => StoreLocation::Bucket {
                bucket: bucket.clone(),
                emulator_host: self.storage_emulator_host.clone(),
            },
            (None, None) => StoreLocation::Directory(self.data_dir.clone()),
        };
        StorageLayout {
            metadata: choose(&self.metadata_mount_path, &self.metadata_bucket),
            checkpoints: choose(&self.checkpoint_mount_path, &self.checkpoint_bucket),
            snapshots: choose(&self.snapshot_mount_path, &self.snapshot_bucket),
            // Workspaces follow the checkpoints when not configured: on Cloud
            // Run a local directory would not outlive the instance.
            workspaces: match (&self.workspace_mount_path, &self.workspace_bucket) {
                (None, None) => choose(&self.checkpoint_mount_path, &self.checkpoint_bucket),
                (mount, bucket) => choose(mount, bucket),
            },
        }
    }
}

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

/// How sandboxes run (gVisor through runsc).
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    /// The runsc binary.
    #[arg(long, env = "RUNSC_BIN", default_value = "runsc")]
    pub runsc: PathBuf,
    /// runsc platform: `ptrace` works everywhere; `systrap` needs a recent runsc.
    #[arg(long, env = "RUNSC_PLATFORM", default_value = "ptrace")]
    pub runsc_platform: String,
    /// Seconds a short runsc call (`state`, `list`, `delete`) may take before
    /// it is killed and reported as hung.
    #[arg(long, env = "SANDBOXD_RUNSC_TIMEOUT_S", default_value_t = 30)]
    pub runsc_timeout_s: u64,
    /// Seconds a `runsc run`, `restore` or `checkpoint` may take before it is
    /// killed (they move a whole memory image).
    #[arg(long, env = "SANDBOXD_RUNSC_IMAGE_TIMEOUT_S", default_value_t = 300)]
    pub runsc_image_timeout_s: u64,
    /// This server's runsc state and working files (bundles, images in transit).
    /// Containers left here by a crashed server are deleted at startup, so give
    /// every server process on a machine its own directory.
    #[arg(long, env = "SANDBOXD_RUNTIME_DIR", default_value = "/run/sandboxd")]
    pub runtime_dir: PathBuf,
    /// The sandbox images (root filesystems; `scripts/build-image.sh` builds
    /// them here). Never the host's `/`: sandboxes see nothing of the host.
    #[arg(
        long,
        env = "SANDBOXD_IMAGES",
        default_value = "/var/lib/sandboxd/images"
    )]
    pub images_dir: PathBuf,
    /// The image sandboxes get when the client names none (`"image"`).
    #[arg(long, env = "SANDBOXD_DEFAULT_IMAGE", default_value = crate::runtime::DEFAULT_IMAGE)]
    pub default_image: String,
    /// Python interpreter inside the images.
    #[arg(long, env = "SANDBOX_PYTHON", default_value = "/usr/bin/python3")]
    pub sandbox_python: String,
    /// Memory limit per sandbox in MiB (0: none).
    #[arg(long, env = "SANDBOX_MEMORY_LIMIT_MB", default_value_t = 2048)]
    pub sandbox_memory_mb: u64,
    /// CPU limit per sandbox in cores (0: none).
    #[arg(long, env = "SANDBOX_CPU_LIMIT", default_value_t = 1.0)]
    pub sandbox_cpus: f64,
    /// Most processes user code may run at once (RLIMIT_NPROC).
    #[arg(long, env = "SANDBOX_MAX_PROCESSES", default_value_t = 256)]
    pub sandbox_max_processes: u64,
    /// Size of each sandbox's /tmp (memory-backed) in MiB.
    #[arg(long, env = "SANDBOX_TMP_SIZE_MB", default_value_t = 512)]
    pub sandbox_tmp_mb: u64,
    /// Pin the CPU features sandboxes see (comma-separated `/proc/cpuinfo`
    /// flags, e.g. the common set of Cloud Run's machine types), so
    /// checkpoints restore across hosts; needs a runsc that honours
    /// `dev.gvisor.internal.cpufeatures`. Unset: the host's own.
    #[arg(long, env = "SANDBOXD_CPU_FEATURES")]
    pub cpu_features: Option<String>,
}

impl RuntimeArgs {
    /// The pinned CPU feature list, if configured.
    pub fn pinned_cpu_features(&self) -> Option<Vec<String>> {
        let features: Vec<String> = self
            .cpu_features
            .as_deref()?
            .split(',')
            .map(|f| f.trim().to_owned())
            .filter(|f| !f.is_empty())
            .collect();
        (!features.is_empty()).then_some(features)
    }

    /// The image directory and default image these settings name.
    pub fn images(&self) -> crate::runtime::ImageCatalog {
        crate::runtime::ImageCatalog::new(self.images_dir.clone(), self.default_image.clone())
    }

    /// The runsc wrapper and bundle these settings describe.
    pub fn gvisor(&self, checkpoint_bucket: String) -> crate::runtime::GvisorConfig {
        crate::runtime::GvisorConfig {
            runsc: crate::runtime::Runsc {
                binary: self.runsc.clone(),
                root: self.runtime_dir.join("runsc"),
                platform: self.runsc_platform.clone(),
                timeouts: crate::runtime::RunscTimeouts {
                    command: std::time::Duration::from_secs(self.runsc_timeout_s.max(1)),
                    image: std::time::Duration::from_secs(self.runsc_image_timeout_s.max(1)),
                },
            },
            state_dir: self.runtime_dir.join("state"),
            images: self.images(),
            bundle: crate::runtime::BundleSpec {
                python: self.sandbox_python.clone(),
                memory_limit_bytes: (self.sandbox_memory_mb > 0)
                    .then_some(self.sandbox_memory_mb << 20),
                cpu_limit: (self.sandbox_cpus > 0.0).then_some(self.sandbox_cpus),
                max_processes: self.sandbox_max_processes,
                tmp_size_mb: self.sandbox_tmp_mb,
                cpu_features: self.pinned_cpu_features(),
            },
            checkpoint_bucket,
        }
    }
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
    #[arg(long, env = "SANDBOXD_SHUTDOWN_GRACE_S", default_value_t = 8)]
    pub shutdown_grace_s: u64,
    #[command(flatten)]
    pub storage: StorageArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub network: NetworkArgs,
    #[command(flatten)]
    pub control: ControlArgs,
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// Workspace sync (`docs/workspaces.md`).
#[derive(Debug, Clone, Args)]
pub struct WorkspaceArgs {
    /// Offer workspace sync to clients (`enable_workspace_sync` at create).
    #[arg(long, env = "SANDBOXD_WORKSPACE_SYNC", default_value_t = true, action = clap::ArgAction::Set)]
    pub workspace_sync: bool,
    /// Seconds after which the checksums a sandbox's `.sandbox-state` records
    /// are recomputed rather than trusted.
    #[arg(long, env = "SANDBOX_SYNC_STALE_THRESHOLD", default_value_t = 3600)]
    pub sync_stale_threshold_s: u64,
    /// Largest file synced, in MiB (larger ones are left out and logged).
    #[arg(long, env = "SANDBOXD_WORKSPACE_MAX_FILE_MB", default_value_t = 100)]
    pub workspace_max_file_mb: u64,
    /// Largest workspace synced, in MiB (a larger one fails its sync).
    #[arg(long, env = "SANDBOXD_WORKSPACE_MAX_TOTAL_MB", default_value_t = 1024)]
    pub workspace_max_total_mb: u64,
    /// Most files a synced workspace may hold (a larger one fails its sync).
    #[arg(long, env = "SANDBOXD_WORKSPACE_MAX_FILES", default_value_t = 100_000)]
    pub workspace_max_files: u64,
    /// Longest a single sync may take, in seconds.
    #[arg(long, env = "SANDBOXD_WORKSPACE_SYNC_TIMEOUT_S", default_value_t = 120)]
    pub workspace_sync_timeout_s: u64,
    /// Extra hook templates, JSON: `{"name": {"cold_start": ["sync_down"],
    /// "after_exec": ["sync_up"], "terminate": ["sync_up"]}}`.
    #[arg(long, env = "SANDBOXD_WORKSPACE_TEMPLATES")]
    pub workspace_templates: Option<String>,
}

impl WorkspaceArgs {
    pub fn limits(&self) -> crate::workspace::SyncLimits {
        crate::workspace::SyncLimits {
            max_file_bytes: self.workspace_max_file_mb.saturating_mul(1 << 20),
            max_total_bytes: self.workspace_max_total_mb.saturating_mul(1 << 20),
            max_files: self.workspace_max_files,
            timeout: std::time::Duration::from_secs(self.workspace_sync_timeout_s.max(1)),
            stale_threshold_s: self.sync_stale_threshold_s,
        }
    }

    /// The hook templates: built-ins plus the configured ones.
    pub fn templates(
        &self,
    ) -> Result<std::collections::BTreeMap<String, crate::workspace::HookTemplate>, String> {
        crate::workspace::hooks::templates_with(self.workspace_templates.as_deref())
    }
}

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
    #[arg(long, env = "SANDBOXD_LEASE_DURATION_S", default_value_t = 15)]
    pub lease_duration_s: u64,
    /// Tolerated clock difference between instances.
    #[arg(long, env = "SANDBOXD_CLOCK_SKEW_S", default_value_t = 2)]
    pub clock_skew_s: u64,
    /// Instance lease renewal interval (one write for all the sandboxes the
    /// instance holds); must be under the duration minus the skew.
    #[arg(long, env = "SANDBOXD_RENEW_INTERVAL_S", default_value_t = 10.0)]
    pub renew_interval_s: f64,
    /// Full re-read of each held sandbox's metadata and lock: raw edits made
    /// without `sandboxctl` (which rings the holder) take effect within this.
    #[arg(long, env = "SANDBOXD_RESYNC_INTERVAL_S", default_value_t = 60)]
    pub resync_interval_s: u64,
    /// How often an instance that holds sandboxes reads its doorbell (where
    /// other instances and `sandboxctl` ring it after writing an intent).
    #[arg(long, env = "SANDBOXD_DOORBELL_POLL_MS", default_value_t = 400)]
    pub doorbell_poll_ms: u64,
    /// How often it reads it instead while a client attached to it sent a
    /// frame within the last minute (the instance serves requests then).
    #[arg(long, env = "SANDBOXD_DOORBELL_POLL_ACTIVE_MS", default_value_t = 200)]
    pub doorbell_poll_active_ms: u64,
    #[arg(long, env = "SANDBOXD_HANDOFF_RUNNING_EXECUTION", value_enum, default_value_t = HandoffArg::Force)]
    pub handoff_running_execution: HandoffArg,
    /// Superseded unnamed checkpoints kept per sandbox besides the latest.
    #[arg(long, env = "SANDBOXD_KEEP_CHECKPOINTS", default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Checkpoint held checkpointable sandboxes this often, between
    /// executions (0: never); bounds what a crash of this instance loses.
    #[arg(long, env = "SANDBOXD_CHECKPOINT_INTERVAL_S", default_value_t = 0)]
    pub checkpoint_interval_s: u64,
    /// Fault tests only: abort the process at this step of a handoff
    /// (handoff:before-checkpoint, handoff:after-upload, handoff:after-record).
    #[arg(long, env = "SANDBOXD_FAILPOINT", hide = true)]
    pub failpoint: Option<String>,
    /// How long a deleted sandbox's tombstone stays before its objects go.
    #[arg(long, env = "SANDBOXD_TOMBSTONE_RETENTION_S", default_value_t = 600)]
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

/// Sandbox networking (`docs/configuration.md`, "Sandbox networking").
#[derive(Debug, Clone, Args)]
pub struct NetworkArgs {
    /// Network modes a create may ask for (comma-separated: `none`, `egress`).
    /// `none` is always allowed; `egress` needs root, `ip` and `iptables`.
    #[arg(long, env = "SANDBOXD_NETWORK_MODES", default_value = "none")]
    pub network_modes: String,
    /// Private IPv4 range egress sandboxes get their addresses from (a /30 each).
    #[arg(long, env = "SANDBOXD_NETWORK_RANGE", default_value = crate::runtime::network::DEFAULT_RANGE)]
    pub network_range: String,
    /// Only these destination CIDRs (comma-separated); empty: any not denied.
    #[arg(long, env = "SANDBOXD_NETWORK_ALLOW", default_value = "")]
    pub network_allow: String,
    /// Never these destination CIDRs (comma-separated); wins over the allow
    /// list. 169.254.169.254 and the sandbox range are always denied.
    #[arg(long, env = "SANDBOXD_NETWORK_DENY", default_value = "")]
    pub network_deny: String,
    /// Sandboxes' DNS servers (comma-separated IPv4); default: the host's
    /// non-loopback `/etc/resolv.conf` nameservers.
    #[arg(long, env = "SANDBOXD_NETWORK_NAMESERVERS")]
    pub network_nameservers: Option<String>,
    /// Address leases, shared by every server on the host.
    #[arg(long, env = "SANDBOXD_NETWORK_LEASE_DIR", default_value = crate::runtime::network::DEFAULT_LEASE_DIR)]
    pub network_lease_dir: PathBuf,
    /// Run `runsc run|restore` of egress sandboxes with `/proc/sys/net`
    /// hidden (runsc before 2024-07-31 needs it on kernels 6.x); `auto`
    /// decides from `runsc --version`.
    #[arg(long, env = "SANDBOXD_RUNSC_NETNS_WORKAROUND", value_enum, default_value_t = NetnsWorkaroundArg::Auto)]
    pub runsc_netns_workaround: NetnsWorkaroundArg,
    /// Longest wait, in seconds, for an egress sandbox's closed connections
    /// to clear before a checkpoint is refused (this runsc cannot save them).
    #[arg(long, env = "SANDBOXD_NETWORK_CHECKPOINT_WAIT_S", default_value_t = 5)]
    pub network_checkpoint_wait_s: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NetnsWorkaroundArg {
    Auto,
    Always,
    Never,
}

impl NetworkArgs {
    /// The allowed modes, `none` always among them.
    pub fn modes(&self) -> Result<Vec<controllers::api::NetworkMode>, String> {
        let mut modes = vec![controllers::api::NetworkMode::None];
        for name in self.network_modes.split(',').map(str::trim) {
            if name.is_empty() {
                continue;
            }
            let mode = name
                .parse()
                .map_err(|err| format!("SANDBOXD_NETWORK_MODES: {err}"))?;
            if !modes.contains(&mode) {
                modes.push(mode);
            }
        }
        Ok(modes)
    }

    /// The runtime's networking when `egress` is allowed, else `None`.
    pub fn config(&self) -> Result<Option<crate::runtime::NetworkConfig>, String> {
        use crate::runtime::network::{dns, policy::parse_cidr_list};
        if !self
            .modes()?
            .contains(&controllers::api::NetworkMode::Egress)
        {
            return Ok(None);
        }
        let range = self
            .network_range
            .parse()
            .map_err(|err| format!("SANDBOXD_NETWORK_RANGE: {err}"))?;
        let allow = parse_cidr_list(&self.network_allow)
            .map_err(|err| format!("SANDBOXD_NETWORK_ALLOW: {err}"))?;
        let deny = parse_cidr_list(&self.network_deny)
            .map_err(|err| format!("SANDBOXD_NETWORK_DENY: {err}"))?;
        let nameservers = match &self.network_nameservers {
            None => dns::host_nameservers(),
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.parse().map_err(|_| {
                        format!("SANDBOXD_NETWORK_NAMESERVERS: {s:?} is not an IPv4 address")
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(Some(crate::runtime::NetworkConfig {
            range,
            allow,
            deny,
            nameservers,
            lease_dir: self.network_lease_dir.clone(),
            netns_workaround: match self.runsc_netns_workaround {
                NetnsWorkaroundArg::Auto => crate::runtime::NetnsWorkaround::Auto,
                NetnsWorkaroundArg::Always => crate::runtime::NetnsWorkaround::Always,
                NetnsWorkaroundArg::Never => crate::runtime::NetnsWorkaround::Never,
            },
            checkpoint_wait: std::time::Duration::from_secs(self.network_checkpoint_wait_s),
        }))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("sandboxd").chain(args.iter().copied()))
            .unwrap()
            .serve
    }

    #[test]
    fn mount_path_wins_over_bucket_and_bucket_over_local() {
        let args = parse(&[
            "--metadata-bucket",
            "meta",
            "--metadata-mount-path",
            "/mnt/meta",
            "--checkpoint-bucket",
            "ckpt",
            "--storage-emulator-host",
            "127.0.0.3:80",
            "--data-dir",
            "/var/lib/sandboxd",
        ]);
        let layout = args.storage.layout();
        assert_eq!(
            layout.metadata,
            StoreLocation::Directory("/mnt/meta".into())
        );
        assert_eq!(
            layout.checkpoints,
            StoreLocation::Bucket {
                bucket: "ckpt".into(),
                emulator_host: Some("127.0.0.3:80".into())
            }
        );
        assert_eq!(
            layout.snapshots,
            StoreLocation::Directory("/var/lib/sandboxd".into())
        );
    }

    #[test]
    fn network_defaults_to_none_and_egress_settings_are_checked() {
        let default = parse(&[]);
        assert_eq!(
            default.network.modes().unwrap(),
            vec![controllers::api::NetworkMode::None]
        );
        assert_eq!(default.network.config().unwrap(), None);
        let egress = parse(&[
            "--network-modes",
            "none,egress",
            "--network-deny",
            "203.0.113.0/24",
            "--network-nameservers",
            "10.0.0.2",
        ]);
        let config = egress.network.config().unwrap().unwrap();
        assert_eq!(config.range.to_string(), "10.231.0.0/16");
        assert_eq!(config.deny.len(), 1);
        assert_eq!(config.nameservers, vec![Ipv4Addr::new(10, 0, 0, 2)]);
        for bad in [
            &["--network-modes", "bridge"][..],
            &[
                "--network-modes",
                "egress",
                "--network-range",
                "10.0.0.0/33",
            ][..],
            &["--network-modes", "egress", "--network-allow", "x"][..],
            &[
                "--network-modes",
                "egress",
                "--network-nameservers",
                "dns.google",
            ][..],
        ] {
            assert!(parse(bad).network.config().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn listen_address_prefers_flag_then_port() {
        assert_eq!(
            parse(&["--listen", "127.0.0.1:9000"]).listen_addr().port(),
            9000
        );
        let from_port = parse(&["--port", "8081"]).listen_addr();
        assert_eq!(from_port, "0.0.0.0:8081".parse().unwrap());
    }
}
