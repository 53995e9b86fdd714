//! `sandboxctl gc`'s filesystem snapshots: snapshots older than the
//! retention (by their manifest's `created_at`; `--snapshot-retention-days`,
//! 0 keeps them forever) and archives no manifest names any more (a snapshot
//! taken again under its name writes a fresh archive and leaves the old
//! one, or an upload stopped before its manifest). Both shared
//! (`filesystem_snapshots/<name>/`) and owned
//! (`filesystem_snapshots/owner.<scope>/<name>/`) snapshots are collected.

use std::collections::{BTreeMap, HashSet};

use chrono::{DateTime, Utc};
use controllers::api::{SnapshotManifest, decode};
use controllers::layout::SNAPSHOTS_PREFIX;
use controllers::store::{ObjectKey, Store, StoreError};

use super::OperatorError;

/// What the snapshot collection found (and removed unless a dry run).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SnapshotGcReport {
    /// Snapshots past the retention, by path (`name` or `owner.<scope>/name`).
    pub expired: Vec<String>,
    /// Archives no manifest names, older than the safety age, by key.
    pub unreferenced_archives: Vec<String>,
}

/// One snapshot directory's objects: its manifest (if any) and archives.
#[derive(Debug, Default)]
struct Directory {
    manifest: Option<ObjectKey>,
    archives: Vec<ObjectKey>,
}

/// Collects expired snapshots (older than `retention`; `None` keeps them)
/// and archives no manifest names (older than `min_age`, judged by their
/// directory's manifest or, without one, always: an orphan directory).
pub async fn gc_snapshots(
    snapshots: &dyn Store,
    retention: Option<chrono::Duration>,
    min_age: chrono::Duration,
    now: DateTime<Utc>,
    dry_run: bool,
) -> Result<SnapshotGcReport, OperatorError> {
    let mut directories: BTreeMap<String, Directory> = BTreeMap::new();
    for object in snapshots.list_all(SNAPSHOTS_PREFIX).await? {
        let Some(rest) = object.key.as_str().strip_prefix(SNAPSHOTS_PREFIX) else {
            continue;
        };
        let Some((path, file)) = rest.rsplit_once('/') else {
            continue;
        };
        if !controllers::api::is_snapshot_path(path) {
            continue;
        }
        let directory = directories.entry(path.to_owned()).or_default();
        if file == "manifest.json" {
            directory.manifest = Some(object.key);
        } else if file.ends_with(".tar.gz") {
            directory.archives.push(object.key);
        }
    }
    let mut report = SnapshotGcReport::default();
    for (path, directory) in directories {
        let manifest = match &directory.manifest {
            Some(key) => match snapshots.get(key).await {
                Ok(object) => match decode::<SnapshotManifest>(&object.data) {
                    Ok(manifest) => Some(manifest),
                    // An operator's broken edit: keep everything it may name.
                    Err(_) => continue,
                },
                Err(StoreError::NotFound { .. }) => None,
                Err(err) => return Err(err.into()),
            },
            None => None,
        };
        let expired = match (&manifest, retention) {
            (Some(manifest), Some(retention)) => now - manifest.created_at > retention,
            _ => false,
        };
        if expired {
            report.expired.push(path.clone());
            if !dry_run {
                // The manifest first: a snapshot is gone once it is.
                for key in directory.manifest.iter().chain(&directory.archives) {
                    delete(snapshots, key).await?;
                }
            }
            continue;
        }
        let current: HashSet<&str> = manifest
            .as_ref()
            .map(|m| m.archive.key.as_str())
            .into_iter()
            .collect();
        // A fresh archive waits for its manifest: only old ones go.
        let old_enough = manifest
            .as_ref()
            .is_none_or(|manifest| now - manifest.created_at > min_age);
        if !old_enough {
            continue;
        }
        for archive in &directory.archives {
            if current.contains(archive.as_str()) {
                continue;
            }
            report.unreferenced_archives.push(archive.to_string());
            if !dry_run {
                delete(snapshots, archive).await?;
            }
        }
    }
    Ok(report)
}

async fn delete(store: &dyn Store, key: &ObjectKey) -> Result<(), OperatorError> {
    match store.delete(key).await {
        Ok(()) | Err(StoreError::NotFound { .. }) => Ok(()),
        Err(err) => Err(err.into()),
    }
}
