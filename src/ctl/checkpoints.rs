//! `sandboxctl checkpoints ID [--delete NAME|CHECKPOINT_ID]` and the
//! retention `gc --keep-checkpoints N` applies: a sandbox's checkpoint
//! history as its `metadata.json` records it (the latest, the superseded ones
//! still kept, every named one), with what each one's manifest says.
//!
//! Deleting edits `status` with one compare-and-swap (a controller recording
//! a new checkpoint at the same moment makes it a conflict, never a lost
//! update), then deletes the objects if nothing else in the document still
//! points at them. The latest checkpoint cannot be deleted: the next restore
//! needs it.

use chrono::{DateTime, Utc};
use controllers::api::{
    CheckpointManifest, CheckpointRef, SandboxMetadata, SandboxStatus, decode, encode,
};
use controllers::layout::{checkpoint_id_of_image, checkpoint_manifest_key, metadata_key};
use controllers::store::{PutMode, Store, StoreError};
use serde::Serialize;

use super::inventory::aligned;
use super::operator::{OperatorError, conflict, delete_checkpoint, parse_id, read_metadata};

/// One checkpoint of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointRow {
    /// `latest`, `previous` or `named`.
    pub role: &'static str,
    /// The name it was taken under, if any.
    pub name: Option<String>,
    pub checkpoint_id: String,
    pub created_at: DateTime<Utc>,
    pub size: u64,
    /// The lease epoch of the holder that took it.
    pub epoch: u64,
    /// The sandbox image it needs (from its manifest); `None` when the
    /// manifest is missing or predates images.
    pub image: Option<String>,
    /// Why the manifest could not be read, if it could not.
    pub problem: Option<String>,
}

fn refs(status: &SandboxStatus) -> Vec<(&'static str, Option<String>, &CheckpointRef)> {
    let mut all = Vec::new();
    if let Some(latest) = &status.latest_checkpoint {
        all.push(("latest", latest.name.clone(), latest));
    }
    for previous in &status.previous_checkpoints {
        all.push(("previous", previous.name.clone(), previous));
    }
    for (name, named) in &status.named_checkpoints {
        all.push(("named", Some(name.clone()), named));
    }
    all
}

/// Every checkpoint the sandbox's document records, newest first, with the
/// image each needs (one manifest read each).
pub async fn list_checkpoints(
    metadata_store: &dyn Store,
    checkpoint_store: &dyn Store,
    id: &str,
) -> Result<Vec<CheckpointRow>, OperatorError> {
    let sandbox = parse_id(id)?;
    let (metadata, _, _) = read_metadata(metadata_store, &sandbox).await?;
    let mut rows = Vec::new();
    for (role, name, reference) in refs(&metadata.status) {
        let checkpoint_id = checkpoint_id_of_image(&reference.path);
        let (image, problem) = match &checkpoint_id {
            None => (
                None,
                Some(format!(
                    "{:?} is not a checkpoint image key",
                    reference.path
                )),
            ),
            Some(checkpoint) => match checkpoint_store
                .get(&checkpoint_manifest_key(checkpoint))
                .await
            {
                Ok(object) => match decode::<CheckpointManifest>(&object.data) {
                    Ok(manifest) => (manifest.sandbox_image, None),
                    Err(err) => (None, Some(format!("invalid manifest: {err}"))),
                },
                Err(StoreError::NotFound { .. }) => (None, Some("manifest missing".to_owned())),
                Err(err) => return Err(err.into()),
            },
        };
        rows.push(CheckpointRow {
            role,
            name,
            checkpoint_id: checkpoint_id.map_or_else(|| reference.path.clone(), |c| c.to_string()),
            created_at: reference.created_at,
            size: reference.size,
            epoch: reference.epoch,
            image,
            problem,
        });
    }
    rows.sort_by_key(|row| std::cmp::Reverse(row.created_at));
    Ok(rows)
}

/// The rows as an aligned table.
pub fn render_checkpoints(rows: &[CheckpointRow], now: DateTime<Utc>) -> String {
    let texts: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.checkpoint_id.clone(),
                r.role.to_owned(),
                r.name.clone().unwrap_or_else(|| "-".to_owned()),
                super::inventory::age(now, r.created_at),
                format!("{:.1} MB", r.size as f64 / 1e6),
                r.epoch.to_string(),
                match (&r.image, &r.problem) {
                    (_, Some(problem)) => problem.clone(),
                    (Some(image), None) => image.clone(),
                    (None, None) => "-".to_owned(),
                },
            ]
        })
        .collect();
    let cells: Vec<[&str; 7]> = texts
        .iter()
        .map(|row| std::array::from_fn(|i| row[i].as_str()))
        .collect();
    aligned(
        &[
            "CHECKPOINT",
            "ROLE",
            "NAME",
            "AGE",
            "SIZE",
            "EPOCH",
            "IMAGE",
        ],
        &cells,
    )
}

/// Removes `target` (a checkpoint name or id) from the document and deletes
/// its objects unless another entry still points at them.
pub async fn delete_checkpoint_entry(
    metadata_store: &dyn Store,
    checkpoint_store: &dyn Store,
    id: &str,
    target: &str,
) -> Result<String, OperatorError> {
    let sandbox = parse_id(id)?;
    let (mut metadata, generation, _) = read_metadata(metadata_store, &sandbox).await?;
    let matches = |reference: &CheckpointRef| {
        checkpoint_id_of_image(&reference.path).is_some_and(|c| c.as_str() == target)
    };
    let status = &mut metadata.status;
    if status
        .latest_checkpoint
        .as_ref()
        .is_some_and(|latest| matches(latest) || latest.name.as_deref() == Some(target))
    {
        return Err(OperatorError::Invalid(format!(
            "{target} is sandbox {sandbox}'s latest checkpoint: the next restore needs it \
             (take a newer checkpoint first, or delete the sandbox)"
        )));
    }
    let mut removed: Vec<CheckpointRef> = Vec::new();
    if let Some(named) = status.named_checkpoints.remove(target) {
        removed.push(named);
    } else {
        let names: Vec<String> = status
            .named_checkpoints
            .iter()
            .filter(|(_, reference)| matches(reference))
            .map(|(name, _)| name.clone())
            .collect();
        for name in names {
            removed.extend(status.named_checkpoints.remove(&name));
        }
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut status.previous_checkpoints)
            .into_iter()
            .partition(|reference| matches(reference));
        status.previous_checkpoints = kept;
        removed.extend(gone);
    }
    if removed.is_empty() {
        return Err(OperatorError::NotFound(format!(
            "sandbox {sandbox} has no checkpoint named or with id {target:?} (sandboxctl checkpoints {sandbox})"
        )));
    }
    write_status(metadata_store, &metadata, generation).await?;
    let deleted = delete_unreferenced(checkpoint_store, &removed, &metadata).await?;
    Ok(format!(
        "sandbox {sandbox}: removed {target} from its checkpoints; {deleted} checkpoint(s) deleted from storage"
    ))
}

/// Applies "keep the latest, the newest `keep` superseded ones and every
/// named one" to one sandbox's document: the rest leave the document (one
/// compare-and-swap) and storage. Returns the checkpoint ids removed.
pub async fn trim_history(
    metadata_store: &dyn Store,
    checkpoint_store: &dyn Store,
    sandbox: &controllers::api::SandboxId,
    keep: usize,
    dry_run: bool,
) -> Result<Vec<String>, OperatorError> {
    let (mut metadata, generation, _) = read_metadata(metadata_store, sandbox).await?;
    let status = &mut metadata.status;
    if status.previous_checkpoints.len() <= keep {
        return Ok(Vec::new());
    }
    let removed = status.previous_checkpoints.split_off(keep);
    let ids = removed
        .iter()
        .filter_map(|r| checkpoint_id_of_image(&r.path).map(|c| c.to_string()))
        .collect();
    if !dry_run {
        write_status(metadata_store, &metadata, generation).await?;
        delete_unreferenced(checkpoint_store, &removed, &metadata).await?;
    }
    Ok(ids)
}

async fn write_status(
    store: &dyn Store,
    metadata: &SandboxMetadata,
    generation: controllers::store::Generation,
) -> Result<(), OperatorError> {
    let key = metadata_key(&metadata.sandbox_id);
    match store
        .put(&key, encode(metadata), PutMode::Update(generation))
        .await
    {
        Ok(_) => Ok(()),
        Err(StoreError::PreconditionFailed { .. }) => {
            Err(conflict(store, &key, generation, None).await)
        }
        Err(err) => Err(err.into()),
    }
}

/// Deletes the objects of `removed` that no entry of `metadata` still names.
async fn delete_unreferenced(
    store: &dyn Store,
    removed: &[CheckpointRef],
    metadata: &SandboxMetadata,
) -> Result<usize, OperatorError> {
    let still: Vec<&str> = refs(&metadata.status)
        .into_iter()
        .map(|(_, _, reference)| reference.path.as_str())
        .collect();
    let mut deleted = 0;
    let mut seen = std::collections::HashSet::new();
    for reference in removed {
        if still.contains(&reference.path.as_str()) || !seen.insert(reference.path.as_str()) {
            continue;
        }
        delete_checkpoint(store, &reference.path).await?;
        deleted += 1;
    }
    Ok(deleted)
}
