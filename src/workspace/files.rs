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

/// Refused files a scan reports by name; past this, one entry counts the rest.
pub const MAX_REFUSED_LISTED: usize = 1000;

impl LocalScan {
    /// What the sandbox reported, bounded (the refused list had no
    /// limit, and the `synced` entries repeat the sandbox's own state file,
    /// which user code can fill with one path a million times): more files
    /// than `max_files` is an error, `synced` keeps each path once and at
    /// most `max_files` of them, `refused` lists [`MAX_REFUSED_LISTED`] by name.
    pub fn bounded(mut self, max_files: u64) -> Result<Self, FilesError> {
        let max = usize::try_from(max_files).unwrap_or(usize::MAX);
        if self.files.len() > max {
            return Err(FilesError::Refused(format!(
                "the sandbox reported {} files, over the {max_files}-file limit",
                self.files.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        self.synced.retain(|entry| seen.insert(entry.path.clone()));
        self.synced.truncate(max);
        if self.refused.len() > MAX_REFUSED_LISTED {
            let more = self.refused.len().saturating_sub(MAX_REFUSED_LISTED);
            self.refused.truncate(MAX_REFUSED_LISTED);
            self.refused.push(Refused {
                path: "...".to_owned(),
                reason: format!("and {more} more files refused (not listed)"),
            });
        }
        Ok(self)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str) -> FileEntry {
        FileEntry {
            path: path.to_owned(),
            checksum: "0".repeat(32),
            size: 1,
            modified_at: 0,
        }
    }

    #[test]
    fn a_scan_is_bounded_whatever_the_sandbox_reports() {
        let scan = LocalScan {
            files: vec![entry("a")],
            refused: (0..5000)
                .map(|i| Refused {
                    path: format!("link{i}"),
                    reason: "a symlink".into(),
                })
                .collect(),
            synced: std::iter::repeat_with(|| entry("same"))
                .take(100_000)
                .collect(),
            ..LocalScan::default()
        };
        let bounded = scan.bounded(10).unwrap();
        assert_eq!(bounded.synced.len(), 1, "a repeated path is kept once");
        assert_eq!(bounded.refused.len(), MAX_REFUSED_LISTED + 1);
        assert!(
            bounded.refused[MAX_REFUSED_LISTED]
                .reason
                .contains("4000 more")
        );
        let many = LocalScan {
            files: (0..11).map(|i| entry(&format!("f{i}"))).collect(),
            ..LocalScan::default()
        };
        assert!(matches!(many.bounded(10), Err(FilesError::Refused(_))));
    }
}
