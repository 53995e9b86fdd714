//! Workspace sync counters; `crate::metrics` reports them on `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct WorkspaceMetrics {
    pub syncs_down: AtomicU64,
    pub syncs_up: AtomicU64,
    /// Syncs up that found nothing to send (and made no storage request).
    pub syncs_unchanged: AtomicU64,
    pub files_uploaded: AtomicU64,
    pub bytes_uploaded: AtomicU64,
    pub files_downloaded: AtomicU64,
    pub bytes_downloaded: AtomicU64,
    /// Files deleted in sandboxes because they were deleted remotely.
    pub files_deleted: AtomicU64,
    /// Contents deleted from the store because nothing references them.
    pub objects_deleted: AtomicU64,
    /// Contents a sync up would have deleted that another writer's commit
    /// (made meanwhile) names again: kept.
    pub releases_kept: AtomicU64,
    pub files_hashed: AtomicU64,
    /// Symlinks, oversized files and bad names left out of a sync.
    pub files_refused: AtomicU64,
    /// Contents a stored state named that were missing (files skipped).
    pub missing_contents: AtomicU64,
    pub cold_start_failures: AtomicU64,
    pub after_exec_failures: AtomicU64,
    pub terminate_failures: AtomicU64,
}

impl WorkspaceMetrics {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
