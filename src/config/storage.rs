//! Which store holds which artifact: a mounted directory, else a bucket,
//! else the local data directory (the earlier server's variable names).

use std::path::PathBuf;

use clap::Args;

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

/// The three artifact kinds the design separates (`docs/configuration.md`).
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
