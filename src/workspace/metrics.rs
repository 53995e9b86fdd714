//! Workspace sync counters, rendered on `/metrics`.

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

    /// Prometheus text.
    pub fn render(&self) -> String {
        let counters: [(&str, &AtomicU64); 15] = [
            (
                "sandboxd_workspace_syncs_total{direction=\"down\"}",
                &self.syncs_down,
            ),
            (
                "sandboxd_workspace_syncs_total{direction=\"up\"}",
                &self.syncs_up,
            ),
            (
                "sandboxd_workspace_syncs_total{direction=\"up_unchanged\"}",
                &self.syncs_unchanged,
            ),
            (
                "sandboxd_workspace_files_total{op=\"uploaded\"}",
                &self.files_uploaded,
            ),
            (
                "sandboxd_workspace_files_total{op=\"downloaded\"}",
                &self.files_downloaded,
            ),
            (
                "sandboxd_workspace_files_total{op=\"deleted\"}",
                &self.files_deleted,
            ),
            (
                "sandboxd_workspace_files_total{op=\"hashed\"}",
                &self.files_hashed,
            ),
            (
                "sandboxd_workspace_files_total{op=\"refused\"}",
                &self.files_refused,
            ),
            (
                "sandboxd_workspace_files_total{op=\"missing\"}",
                &self.missing_contents,
            ),
            (
                "sandboxd_workspace_objects_deleted_total",
                &self.objects_deleted,
            ),
            (
                "sandboxd_workspace_bytes_total{op=\"uploaded\"}",
                &self.bytes_uploaded,
            ),
            (
                "sandboxd_workspace_bytes_total{op=\"downloaded\"}",
                &self.bytes_downloaded,
            ),
            (
                "sandboxd_workspace_hook_failures_total{point=\"cold_start\"}",
                &self.cold_start_failures,
            ),
            (
                "sandboxd_workspace_hook_failures_total{point=\"after_exec\"}",
                &self.after_exec_failures,
            ),
            (
                "sandboxd_workspace_hook_failures_total{point=\"terminate\"}",
                &self.terminate_failures,
            ),
        ];
        let mut text = String::from(
            "# HELP sandboxd_workspace_syncs_total Workspace syncs by direction.\n\
             # TYPE sandboxd_workspace_syncs_total counter\n\
             # HELP sandboxd_workspace_files_total Workspace files moved or examined.\n\
             # TYPE sandboxd_workspace_files_total counter\n\
             # HELP sandboxd_workspace_bytes_total Workspace bytes moved.\n\
             # TYPE sandboxd_workspace_bytes_total counter\n\
             # HELP sandboxd_workspace_objects_deleted_total Unreferenced workspace contents deleted.\n\
             # TYPE sandboxd_workspace_objects_deleted_total counter\n\
             # HELP sandboxd_workspace_hook_failures_total Lifecycle hooks that failed (each is logged).\n\
             # TYPE sandboxd_workspace_hook_failures_total counter\n",
        );
        for (name, counter) in counters {
            text.push_str(&format!("{name} {}\n", Self::get(counter)));
        }
        text
    }
}
