//! Workspace sync: whether it is offered, its limits and hook templates.

use clap::Args;

/// Workspace sync (`docs/workspaces.md`).
#[derive(Debug, Clone, Args)]
pub struct WorkspaceArgs {
    /// Offer workspace sync to clients (`enable_workspace_sync` at create).
    #[arg(long, env = "SANDBOXD_WORKSPACE_SYNC", default_value_t = true, action = clap::ArgAction::Set)]
    pub workspace_sync: bool,
    /// Seconds after which the checksums a sandbox's `.sandbox-state` records
    /// are recomputed rather than trusted.
    #[arg(long, env = "SANDBOX_SYNC_STALE_THRESHOLD", value_parser = clap::value_parser!(u64).range(1..=31_536_000), default_value_t = 3600)]
    pub sync_stale_threshold_s: u64,
    /// Largest file synced, in MiB (larger ones are left out and logged).
    #[arg(long, env = "SANDBOXD_WORKSPACE_MAX_FILE_MB", value_parser = clap::value_parser!(u64).range(1..=1_048_576), default_value_t = 100)]
    pub workspace_max_file_mb: u64,
    /// Largest workspace synced, in MiB (a larger one fails its sync); held
    /// to the size of the sandboxes' `/workspace` mount (half the disk
    /// budget), so that what is synced always fits where it is restored.
    #[arg(long, env = "SANDBOXD_WORKSPACE_MAX_TOTAL_MB", value_parser = clap::value_parser!(u64).range(1..=1_048_576), default_value_t = 1024)]
    pub workspace_max_total_mb: u64,
    /// Most files a synced workspace may hold (a larger one fails its sync).
    #[arg(long, env = "SANDBOXD_WORKSPACE_MAX_FILES", value_parser = clap::value_parser!(u64).range(1..=100_000_000), default_value_t = 100_000)]
    pub workspace_max_files: u64,
    /// Longest a single sync may take, in seconds.
    #[arg(long, env = "SANDBOXD_WORKSPACE_SYNC_TIMEOUT_S", value_parser = clap::value_parser!(u64).range(1..=86_400), default_value_t = 120)]
    pub workspace_sync_timeout_s: u64,
    /// Extra hook templates, JSON: `{"name": {"cold_start": ["sync_down"],
    /// "after_exec": ["sync_up"], "terminate": ["sync_up"]}}`.
    #[arg(long, env = "SANDBOXD_WORKSPACE_TEMPLATES")]
    pub workspace_templates: Option<String>,
}

impl WorkspaceArgs {
    /// The sync's limits, for sandboxes whose `/workspace` mount holds
    /// `workspace_size_mb`.
    pub fn limits(&self, workspace_size_mb: u64) -> crate::workspace::SyncLimits {
        crate::workspace::SyncLimits {
            max_file_bytes: self.workspace_max_file_mb.saturating_mul(1 << 20),
            max_total_bytes: self
                .workspace_max_total_mb
                .min(workspace_size_mb)
                .saturating_mul(1 << 20),
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
