//! Host files a workspace content passes through on its way to the store:
//! removed when dropped (also when a sync is cancelled mid-way), and swept
//! at start after a crash.

use std::path::PathBuf;

/// Name prefix of the host files contents pass through.
pub(super) const SPOOL_PREFIX: &str = "workspace-spool-";

/// A spooled content on the host, removed when dropped, also when a sync is
/// cancelled by its timeout mid-way.
pub(super) struct SpoolFile(pub(super) PathBuf);

impl Drop for SpoolFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Removes spool files a crashed server left in `dir`.
pub(super) fn sweep_spool(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(SPOOL_PREFIX)
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
