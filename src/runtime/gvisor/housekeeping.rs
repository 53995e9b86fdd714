//! What a runtime tidies on its local disk: at startup, the snapshot
//! temporaries a crashed server left (never a live one's, in a shared
//! directory); at startup and after each failed upload, the images of failed
//! checkpoint uploads beyond their disk budget (docs/security.md).

use std::path::PathBuf;

use super::owner::Owner;

/// Where the owner locks of the containers under `root` live (beside it:
/// runsc reads every entry of its root).
pub(super) fn owners_dir(root: &std::path::Path) -> PathBuf {
    let mut name = root.file_name().unwrap_or_default().to_owned();
    name.push("-owners");
    root.with_file_name(name)
}

/// Removes the snapshot archives in transit that a crashed server left in
/// the state directory (they stayed forever); a live server's, in a
/// shared directory, are left alone.
pub(super) async fn sweep_temporaries(state_dir: &std::path::Path, owner: &Owner) {
    let Ok(mut entries) = tokio::fs::read_dir(state_dir).await else {
        return;
    };
    while let Ok(Some(entry)) = entries.next_entry().await {
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = [
            ("snapshot", ".tar.gz"),
            (super::prefetch::TEMPORARY_KIND, ".img"),
        ]
        .into_iter()
        .find(|(kind, ext)| name.starts_with(&format!("{kind}-")) && name.ends_with(ext));
        if let Some((kind, _)) = kind
            && owner.is_orphan_temporary(kind, &name)
        {
            tracing::info!(file = %entry.path().display(), "removing a {kind} temporary an earlier run left");
            let _ = tokio::fs::remove_file(entry.path()).await;
        }
    }
}

/// Where images of checkpoints that could not be uploaded are kept.
pub(super) fn orphaned_checkpoints_dir(state_dir: &std::path::Path) -> PathBuf {
    state_dir.join("orphaned-checkpoints")
}

/// Keeps the images of failed uploads within `budget` bytes, removing the
/// oldest first (each kept a whole memory image on local disk
/// forever, and on Cloud Run local disk is memory). The newest image is kept
/// even alone over the budget: it may be the only copy of a sandbox.
pub(super) async fn prune_orphaned_checkpoints(state_dir: &std::path::Path, budget: u64) {
    let dir = orphaned_checkpoints_dir(state_dir);
    let Ok(mut entries) = tokio::fs::read_dir(&dir).await else {
        return;
    };
    let mut images = Vec::new();
    while let Ok(Some(entry)) = entries.next_entry().await {
        if let Ok(meta) = entry.metadata().await
            && meta.is_file()
        {
            let modified = meta.modified().unwrap_or(std::time::SystemTime::UNIX_EPOCH);
            images.push((modified, meta.len(), entry.path()));
        }
    }
    images.sort();
    let mut total: u64 = images
        .iter()
        .map(|(_, size, _)| *size)
        .fold(0, u64::saturating_add);
    let newest = images.pop();
    for (_, size, path) in images {
        if total <= budget {
            break;
        }
        tracing::warn!(image = %path.display(), size, budget, "removing the oldest image of a failed checkpoint upload (over the disk budget)");
        if tokio::fs::remove_file(&path).await.is_ok() {
            total = total.saturating_sub(size);
        }
    }
    drop(newest);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &std::path::Path, bytes: usize) {
        std::fs::write(path, vec![0u8; bytes]).unwrap();
    }

    /// A failed upload kept its whole image forever. Past the
    /// budget the oldest go; the newest stays even alone over it.
    #[tokio::test]
    async fn failed_upload_images_are_kept_within_the_budget() {
        let state = tempfile::tempdir().unwrap();
        let dir = orphaned_checkpoints_dir(state.path());
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["a.img", "b.img", "c.img"] {
            write(&dir.join(name), 1000);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        prune_orphaned_checkpoints(state.path(), 2500).await;
        let mut left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["b.img", "c.img"], "the oldest went");
        prune_orphaned_checkpoints(state.path(), 10).await;
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "the newest is always kept");
        assert!(dir.join("c.img").exists());
    }

    /// `snapshot-*.tar.gz` temporaries were never swept. A crashed
    /// or older server's go at startup; a live server's stay.
    #[tokio::test]
    async fn startup_sweeps_the_snapshot_temporaries_no_live_server_owns() {
        let state = tempfile::tempdir().unwrap();
        let owners = state.path().join("owners");
        let live = Owner::claim(&owners).unwrap();
        let crashed = Owner::claim(&owners).unwrap();
        let starting = Owner::claim(&owners).unwrap();
        let kept = live.temporary("snapshot", "tar.gz");
        let gone = crashed.temporary("snapshot", "tar.gz");
        for name in [
            &kept,
            &gone,
            &"snapshot-0123456789abcdef0123456789abcdef.tar.gz".to_owned(),
        ] {
            write(&state.path().join(name), 10);
        }
        write(&state.path().join("other.txt"), 10);
        drop(crashed);
        sweep_temporaries(state.path(), &starting).await;
        let mut left: Vec<_> = std::fs::read_dir(state.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|name| name != "owners")
            .collect();
        left.sort();
        let mut expected = vec![kept, "other.txt".to_owned()];
        expected.sort();
        assert_eq!(left, expected);
    }
}
