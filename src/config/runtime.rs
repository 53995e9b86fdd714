//! How sandboxes run: the runsc binary and its root, the sandbox images,
//! and each sandbox's limits.

use std::path::PathBuf;

use clap::Args;

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
    #[arg(long, env = "SANDBOXD_RUNSC_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=3600), default_value_t = 30)]
    pub runsc_timeout_s: u64,
    /// Seconds a `runsc run`, `restore` or `checkpoint` may take before it is
    /// killed (they move a whole memory image).
    #[arg(long, env = "SANDBOXD_RUNSC_IMAGE_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=86_400), default_value_t = 300)]
    pub runsc_image_timeout_s: u64,
    /// Local disk (MiB) the images of checkpoints that failed to upload may
    /// hold in all (kept for an operator to recover; the oldest go first).
    #[arg(long, env = "SANDBOXD_ORPHANED_CHECKPOINTS_MAX_MB", value_parser = clap::value_parser!(u64).range(0..=1_048_576), default_value_t = 4096)]
    pub orphaned_checkpoints_max_mb: u64,
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
    #[arg(long, env = "SANDBOX_MEMORY_LIMIT_MB", value_parser = clap::value_parser!(u64).range(0..=1_048_576), default_value_t = 2048)]
    pub sandbox_memory_mb: u64,
    /// CPU limit per sandbox in cores (0: none).
    #[arg(long, env = "SANDBOX_CPU_LIMIT", value_parser = super::cpu_cores, default_value_t = 1.0)]
    pub sandbox_cpus: f64,
    /// Most processes user code may run at once (RLIMIT_NPROC).
    #[arg(long, env = "SANDBOX_MAX_PROCESSES", value_parser = clap::value_parser!(u64).range(1..=4_194_304), default_value_t = 256)]
    pub sandbox_max_processes: u64,
    /// Size of each sandbox's /tmp (memory-backed) in MiB.
    #[arg(long, env = "SANDBOX_TMP_SIZE_MB", value_parser = clap::value_parser!(u64).range(1..=1_048_576), default_value_t = 512)]
    pub sandbox_tmp_mb: u64,
    /// Each sandbox's disk budget in MiB: the size of its home, `/workspace`
    /// and `/var/tmp` (each memory-backed, like `/tmp`); a write past it gets
    /// `ENOSPC` ("disk full"). 0: half the memory limit (1 GiB without one).
    #[arg(long, env = "SANDBOX_DISK_MB", value_parser = clap::value_parser!(u64).range(0..=1_048_576), default_value_t = 0)]
    pub sandbox_disk_mb: u64,
    /// Pin the CPU features sandboxes see (comma-separated `/proc/cpuinfo`
    /// flags, e.g. the common set of Cloud Run's machine types), so
    /// checkpoints restore across hosts; needs a runsc that honours
    /// `dev.gvisor.internal.cpufeatures`. Unset: the host's own.
    #[arg(long, env = "SANDBOXD_CPU_FEATURES")]
    pub cpu_features: Option<String>,
    /// Sandboxes of the default image (network `none`) kept booted ahead of
    /// demand, so a create takes one instead of waiting for a cold boot
    /// (0: none). Each costs its memory while it waits (docs/configuration.md).
    #[arg(long, env = "SANDBOXD_WARM_POOL", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=256), default_value_t = 2)]
    pub warm_pool: usize,
    /// A handoff's taker restores the checkpoint it fetched ahead
    /// (network `none` sandboxes) before the transfer lands, and takes
    /// that container up when it does (docs/configuration.md).
    #[arg(long, env = "SANDBOXD_STAGED_RESTORES", default_value_t = true, action = clap::ArgAction::Set)]
    pub staged_restores: bool,
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

    /// Each sandbox's disk budget in MiB (`--sandbox-disk-mb`, or its default).
    pub fn disk_size_mb(&self) -> u64 {
        match self.sandbox_disk_mb {
            0 => crate::runtime::bundle::default_disk_size_mb(self.memory_limit_bytes()),
            configured => configured,
        }
    }

    /// The size of each sandbox's `/workspace` mount in MiB.
    pub fn workspace_size_mb(&self) -> u64 {
        crate::runtime::bundle::workspace_size_mb(self.disk_size_mb())
    }

    /// Each sandbox's memory limit, if it has one.
    fn memory_limit_bytes(&self) -> Option<u64> {
        (self.sandbox_memory_mb > 0).then_some(self.sandbox_memory_mb << 20)
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
                memory_limit_bytes: self.memory_limit_bytes(),
                cpu_limit: (self.sandbox_cpus > 0.0).then_some(self.sandbox_cpus),
                max_processes: self.sandbox_max_processes,
                tmp_size_mb: self.sandbox_tmp_mb,
                disk_size_mb: self.disk_size_mb(),
                cpu_features: self.pinned_cpu_features(),
            },
            checkpoint_bucket,
            orphaned_checkpoints_budget: self.orphaned_checkpoints_max_mb.saturating_mul(1 << 20),
        }
    }
}
