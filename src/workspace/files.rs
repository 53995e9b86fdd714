//! The port through which the sync reaches a sandbox's `/workspace`: the
//! gVisor runtime implements it with agent commands (`ws_*`, `sandbox_agent/workspace.py`),
//! so no host process ever opens a path inside the sandbox.

use std::path::Path;

use async_trait::async_trait;
use controllers::api::SandboxId;
use controllers::store::BlobReader;

use super::state::FileEntry;

/// What a scan may use and must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanRequest {
    pub max_file_bytes: u64,
    pub max_total_bytes: u64,
    pub max_files: u64,
    /// Checksums in a local state older than this are recomputed.
    pub stale_threshold_s: u64,
}

/// A file the scan left out, and why (a symlink, too large, a bad name).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Refused {
    pub path: String,
    pub reason: String,
}

/// The workspace as the sandbox holds it now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LocalScan {
    pub files: Vec<FileEntry>,
    pub refused: Vec<Refused>,
    /// What the sandbox's own `.sandbox-state` lists (synced before).
    pub synced: Vec<FileEntry>,
    /// Unix seconds when the scan started: the next scan trusts a recorded
    /// checksum only for files modified before this second.
    pub scanned_at: i64,
    /// Files whose md5 had to be computed (not reused from the state file).
    pub hashed: u64,
}

/// The md5 and size of bytes actually copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub checksum: String,
    pub size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("sandbox {0} is not running on this host")]
    NotRunning(SandboxId),
    #[error("the sandbox refused: {0}")]
    Refused(String),
    #[error("cannot talk to the sandbox: {0}")]
    Agent(String),
    #[error("local file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// File access inside one sandbox's workspace.
#[async_trait]
pub trait WorkspaceFiles: Send + Sync + std::fmt::Debug {
    async fn scan(
        &self,
        sandbox: &SandboxId,
        request: ScanRequest,
    ) -> Result<LocalScan, FilesError>;

    /// Copies one file's bytes to `dest` on the host.
    async fn read_file(
        &self,
        sandbox: &SandboxId,
        path: &str,
        max_bytes: u64,
        dest: &Path,
    ) -> Result<Copied, FilesError>;

    /// Writes one file atomically; the sandbox refuses bytes whose md5 is not
    /// `entry.checksum`.
    async fn write_file(
        &self,
        sandbox: &SandboxId,
        entry: &FileEntry,
        data: BlobReader,
    ) -> Result<(), FilesError>;

    /// Deletes files (and directories they leave empty); returns how many went.
    async fn delete_files(&self, sandbox: &SandboxId, paths: &[String]) -> Result<u64, FilesError>;

    /// Replaces the sandbox's `.sandbox-state` atomically.
    async fn write_state(&self, sandbox: &SandboxId, content: String) -> Result<(), FilesError>;
}
