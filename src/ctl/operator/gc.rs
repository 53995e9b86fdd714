//! `sandboxctl gc`: tombstones past their retention, sandboxes that failed
//! without a checkpoint (creates that never ran) created before it,
//! superseded checkpoints beyond the newest few, and checkpoints no sandbox
//! references.

use super::*;

/// What `gc` found (and removed unless it was a dry run).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Tombstoned sandboxes older than the retention.
    pub tombstones: Vec<String>,
    /// Sandboxes that failed without ever being checkpointed (nothing to
    /// restore: a create that never ran), created before the retention.
    pub failed: Vec<String>,
    /// Checkpoint directories no sandbox points at.
    pub orphan_checkpoints: Vec<String>,
    /// Superseded checkpoints beyond `--keep-checkpoints`, as
    /// `sandbox/checkpoint`.
    pub trimmed: Vec<String>,
    /// Sandboxes whose history could not be trimmed (a controller wrote
    /// meanwhile), with why: the next run tries again.
    pub skipped: Vec<String>,
}

/// `gc [--dry-run] [--keep-checkpoints N]`: tombstones past `retention`,
/// superseded checkpoints beyond the newest `keep_checkpoints` of each
/// sandbox (named ones always stay), and checkpoints no metadata references
/// (older than `retention` too, so a checkpoint being recorded right now is
/// not taken for an orphan).
pub async fn gc(
    metadata_store: &dyn Store,
    checkpoint_store: &dyn Store,
    retention: chrono::Duration,
    now: DateTime<Utc>,
    dry_run: bool,
    keep_checkpoints: Option<usize>,
) -> Result<GcReport, OperatorError> {
    let mut report = GcReport::default();
    let mut referenced = std::collections::HashSet::new();
    let mut ids: Vec<String> = metadata_store
        .list_all(SANDBOXES_PREFIX)
        .await?
        .into_iter()
        .filter_map(|o| {
            o.key
                .as_str()
                .strip_prefix(SANDBOXES_PREFIX)?
                .split('/')
                .next()
                .map(str::to_owned)
        })
        .collect();
    ids.dedup();
    for id in ids {
        let Ok(sandbox) = SandboxId::parse(&id) else {
            continue;
        };
        if let Some(keep) = keep_checkpoints {
            match crate::ctl::checkpoints::trim_history(
                metadata_store,
                checkpoint_store,
                &sandbox,
                keep,
                dry_run,
            )
            .await
            {
                Ok(removed) => report
                    .trimmed
                    .extend(removed.into_iter().map(|c| format!("{id}/{c}"))),
                Err(err @ OperatorError::Conflict { .. }) => {
                    report.skipped.push(format!("{id}: {err}"));
                }
                Err(OperatorError::NotFound(_)) => continue,
                Err(err) => return Err(err),
            }
        }
        let Ok((metadata, _, _)) = read_metadata(metadata_store, &sandbox).await else {
            // Unreadable documents keep everything they might point at.
            return Err(OperatorError::Invalid(format!(
                "sandboxes/{id}/metadata.json is missing or invalid: fix it before collecting garbage"
            )));
        };
        // The checkpoint the lock carries is referenced too: a hand-back's
        // record may not have landed (or never will, until the next holder
        // records it), and it may be the sandbox's only latest checkpoint.
        let lock = match read_lease(metadata_store, &sandbox).await {
            Ok(lock) => lock,
            Err(OperatorError::Invalid(detail)) => {
                return Err(OperatorError::Invalid(format!(
                    "sandboxes/{id}/lock.json is invalid ({detail}): fix it before collecting garbage"
                )));
            }
            Err(err) => return Err(err),
        };
        let status = &metadata.status;
        let carried = lock.as_ref().and_then(|(lock, _)| lock.checkpoint.as_ref());
        let all: Vec<&controllers::api::CheckpointRef> = status
            .latest_checkpoint
            .iter()
            .chain(&status.previous_checkpoints)
            .chain(status.named_checkpoints.values())
            .chain(carried)
            .collect();
        let deleted_at = status.deleted_at().unwrap_or(metadata.created_at);
        let tombstone =
            status.phase == controllers::api::Phase::Deleted && now - deleted_at > retention;
        let never_ran = status.phase == controllers::api::Phase::Failed
            && all.is_empty()
            && now - metadata.created_at > retention;
        if tombstone || never_ran {
            if tombstone {
                report.tombstones.push(id.clone());
            } else {
                report.failed.push(id.clone());
            }
            if !dry_run {
                for checkpoint in &all {
                    delete_checkpoint(checkpoint_store, &checkpoint.path).await?;
                }
                for key in [lock_key(&sandbox), metadata_key(&sandbox)] {
                    match metadata_store.delete(&key).await {
                        Ok(()) | Err(StoreError::NotFound { .. }) => {}
                        Err(err) => return Err(err.into()),
                    }
                }
            }
            continue;
        }
        for checkpoint in all {
            if let Some(checkpoint_id) = checkpoint_id_of_image(&checkpoint.path) {
                referenced.insert(checkpoint_id.to_string());
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    for object in checkpoint_store.list_all(CHECKPOINTS_PREFIX).await? {
        let Some(checkpoint_id) = object
            .key
            .as_str()
            .strip_prefix(CHECKPOINTS_PREFIX)
            .and_then(|rest| rest.split('/').next())
        else {
            continue;
        };
        if referenced.contains(checkpoint_id) || !seen.insert(checkpoint_id.to_owned()) {
            continue;
        }
        let Ok(parsed) = SandboxId::parse(checkpoint_id) else {
            continue;
        };
        let manifest_key = controllers::layout::checkpoint_manifest_key(&parsed);
        let created = match checkpoint_store.get(&manifest_key).await {
            Ok(object) => decode::<controllers::api::CheckpointManifest>(&object.data)
                .ok()
                .map(|m| m.created_at),
            Err(_) => None,
        };
        // Without a readable manifest the age is unknown: treat it as old only
        // when the image exists without one (an interrupted upload).
        if created.is_some_and(|created| now - created <= retention) {
            continue;
        }
        report.orphan_checkpoints.push(checkpoint_id.to_owned());
        if !dry_run {
            let image = controllers::layout::checkpoint_image_key(&parsed);
            delete_checkpoint(checkpoint_store, image.as_str()).await?;
        }
    }
    Ok(report)
}

pub(in crate::ctl) async fn delete_checkpoint(
    store: &dyn Store,
    image_path: &str,
) -> Result<(), OperatorError> {
    Ok(controllers::sandboxes::delete_checkpoint_objects(store, image_path).await?)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        reason = "tests fail by panicking"
    )]

    use chrono::{Duration, Utc};
    use controllers::api::{CheckpointRef, Phase, SandboxId, SandboxMetadata, encode};
    use controllers::layout::metadata_key;
    use controllers::store::{PutMode, Store};
    use controllers::testing::MemoryStore;

    /// Writes a sandbox created `age` ago in `phase`, with a checkpoint or not.
    async fn sandbox(store: &MemoryStore, n: u128, age: Duration, phase: Phase, checkpoint: bool) {
        let id = SandboxId::from_u128(n);
        let created = Utc::now() - age;
        let mut metadata = SandboxMetadata::new(id.clone(), created, "ab".repeat(32));
        metadata.status.phase = phase;
        if checkpoint {
            metadata.status.epoch = 1;
            metadata.status.latest_checkpoint = Some(CheckpointRef {
                bucket: "b".to_owned(),
                path: controllers::layout::checkpoint_image_key(&SandboxId::from_u128(n + 100))
                    .to_string(),
                epoch: 1,
                sha256: "0".repeat(64),
                size: 1,
                created_at: created,
                name: None,
                extra: controllers::api::ExtraFields::new(),
            });
        }
        store
            .put(&metadata_key(&id), encode(&metadata), PutMode::Create)
            .await
            .unwrap();
    }

    /// A create that failed without ever running leaves a `Failed` record:
    /// `gc` removes it once older than the retention, and keeps a recent
    /// one, a failed sandbox with a checkpoint (it can be restored) and a
    /// running one.
    #[tokio::test]
    async fn failed_records_past_the_retention_are_collected() {
        let store = MemoryStore::new();
        let hour = Duration::hours(1);
        sandbox(&store, 1, hour, Phase::Failed, false).await;
        sandbox(&store, 2, Duration::seconds(5), Phase::Failed, false).await;
        sandbox(&store, 3, hour, Phase::Failed, true).await;
        sandbox(&store, 4, hour, Phase::Running, false).await;
        let retention = Duration::seconds(600);
        let old_failed = SandboxId::from_u128(1).to_string();

        let dry = super::gc(&store, &store, retention, Utc::now(), true, None)
            .await
            .unwrap();
        assert_eq!(dry.failed, std::slice::from_ref(&old_failed));
        assert!(
            store
                .get(&metadata_key(&SandboxId::from_u128(1)))
                .await
                .is_ok()
        );

        let report = super::gc(&store, &store, retention, Utc::now(), false, None)
            .await
            .unwrap();
        assert_eq!(report.failed, [old_failed]);
        assert!(
            store
                .get(&metadata_key(&SandboxId::from_u128(1)))
                .await
                .is_err()
        );
        for kept in 2..=4 {
            let key = metadata_key(&SandboxId::from_u128(kept));
            assert!(store.get(&key).await.is_ok(), "sandbox {kept} was removed");
        }
        let again = super::gc(&store, &store, retention, Utc::now(), false, None)
            .await
            .unwrap();
        assert!(again.failed.is_empty(), "{again:?}");
    }
}
