//! `sandboxctl describe | edit | evict | delete | break-lease | gc`: operator
//! verbs on the bucket's documents. Every write is a compare-and-swap on the
//! generation read, so an operator never overwrites a controller's (or another
//! operator's) concurrent change; a lost race is a clear conflict, not a retry
//! behind their back.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};

use super::inventory::age as ago;
use controllers::api::{
    DesiredState, InstanceId, Lease, SandboxId, SandboxMetadata, decode, encode,
};
use controllers::layout::{
    CHECKPOINTS_PREFIX, SANDBOXES_PREFIX, checkpoint_id_of_image, lock_key, metadata_key,
};
use controllers::leasing::ring_doorbell;
use controllers::store::{Generation, PutMode, Store, StoreError};

/// Why an operator verb failed; each maps to an exit code.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("no such sandbox: {0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error(
        "conflict: {key} changed since it was read (generation {read} → {now}); nothing was written{saved}"
    )]
    Conflict {
        key: String,
        read: i64,
        now: String,
        saved: String,
    },
    #[error("cancelled")]
    Cancelled,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Io(String),
}

impl OperatorError {
    /// `sandboxctl`'s exit code: 2 invalid input, 3 not found, 4 storage,
    /// 5 conflict, 6 cancelled.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Invalid(_) | Self::Io(_) => 2,
            Self::NotFound(_) => 3,
            Self::Store(_) => 4,
            Self::Conflict { .. } => 5,
            Self::Cancelled => 6,
        }
    }
}

pub(super) fn parse_id(id: &str) -> Result<SandboxId, OperatorError> {
    SandboxId::parse(id).map_err(|err| OperatorError::Invalid(err.to_string()))
}

pub(super) async fn read_metadata(
    store: &dyn Store,
    sandbox: &SandboxId,
) -> Result<(SandboxMetadata, Generation, bytes::Bytes), OperatorError> {
    let object = match store.get(&metadata_key(sandbox)).await {
        Ok(object) => object,
        Err(StoreError::NotFound { .. }) => {
            return Err(OperatorError::NotFound(sandbox.to_string()));
        }
        Err(err) => return Err(err.into()),
    };
    let metadata = decode::<SandboxMetadata>(&object.data)
        .map_err(|err| OperatorError::Invalid(err.to_string()))?;
    Ok((metadata, object.generation, object.data))
}

async fn read_lease(
    store: &dyn Store,
    sandbox: &SandboxId,
) -> Result<Option<(Lease, Generation)>, OperatorError> {
    match store.get(&lock_key(sandbox)).await {
        Ok(object) => Ok(Some((
            decode::<Lease>(&object.data).map_err(|err| OperatorError::Invalid(err.to_string()))?,
            object.generation,
        ))),
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

pub(super) async fn conflict(
    store: &dyn Store,
    key: &controllers::store::ObjectKey,
    read: Generation,
    saved: Option<&Path>,
) -> OperatorError {
    let now = match store.get(key).await {
        Ok(object) => object.generation.0.to_string(),
        Err(err) => format!("unreadable: {err}"),
    };
    OperatorError::Conflict {
        key: key.to_string(),
        read: read.0,
        now,
        saved: saved.map_or_else(String::new, |path| {
            format!("; your edit is kept in {}", path.display())
        }),
    }
}

/// `describe ID`: spec beside status, conditions, lease timing, checkpoints.
pub async fn describe(
    store: &dyn Store,
    id: &str,
    now: DateTime<Utc>,
) -> Result<String, OperatorError> {
    let sandbox = parse_id(id)?;
    let (metadata, generation, _) = read_metadata(store, &sandbox).await?;
    let lease = read_lease(store, &sandbox).await?;
    let spec = &metadata.spec;
    let status = &metadata.status;
    let mut out = String::new();
    let or_dash = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
    let _ = writeln!(out, "Sandbox:      {}", metadata.sandbox_id);
    let _ = writeln!(
        out,
        "Created:      {} ({} ago)",
        metadata.created_at.to_rfc3339(),
        ago(now, metadata.created_at)
    );
    let _ = writeln!(out, "Generation:   {}", generation.0);
    let _ = writeln!(
        out,
        "\nSpec (desired)                          Status (observed)"
    );
    let rows = [
        (
            format!("desired_state: {:?}", spec.desired_state).to_lowercase(),
            format!("phase: {:?}", status.phase),
        ),
        (
            format!(
                "idle_timeout: {}",
                or_dash(spec.idle_timeout.map(|s| format!("{s}s")))
            ),
            format!(
                "holder: {}",
                or_dash(status.holder.as_ref().map(ToString::to_string))
            ),
        ),
        (
            format!("enable_checkpoint: {}", spec.enable_checkpoint),
            format!("epoch: {}", status.epoch),
        ),
        (
            format!("enable_sandbox_handoff: {}", spec.enable_sandbox_handoff),
            format!("last_error: {}", or_dash(status.last_error.clone())),
        ),
        (
            format!(
                "auto_checkpoint_on_idle: {}",
                spec.enable_idle_timeout_auto_checkpoint
            ),
            String::new(),
        ),
        (
            format!(
                "filesystem_snapshot_name: {}",
                or_dash(spec.filesystem_snapshot_name.clone())
            ),
            String::new(),
        ),
        (
            format!(
                "workspace: {}",
                or_dash(
                    spec.workspace
                        .as_ref()
                        .map(|w| format!("{} (template {})", w.id, w.template))
                )
            ),
            String::new(),
        ),
    ];
    for (left, right) in rows {
        let _ = writeln!(out, "  {left:<38}{right}");
    }
    let _ = writeln!(out, "\nConditions:");
    if status.conditions.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for condition in &status.conditions {
        let _ = writeln!(
            out,
            "  {:<8} {:<8} {:<14} {} ago  {}",
            condition.kind,
            format!("{:?}", condition.status),
            condition.reason,
            ago(now, condition.last_transition_time),
            condition.message
        );
    }
    let _ = writeln!(out, "\nLease:");
    match &lease {
        None => {
            let _ = writeln!(out, "  (no lock.json)");
        }
        Some((lease, generation)) => {
            let holder = or_dash(lease.holder.as_ref().map(ToString::to_string));
            let _ = writeln!(
                out,
                "  holder: {holder}   epoch: {}   generation: {}",
                lease.epoch, generation.0
            );
            match lease.expires_at() {
                Some(expires) if lease.holder.is_some() && expires > now => {
                    let _ = writeln!(
                        out,
                        "  renewed {} ago, expires in {}s",
                        lease.renewed_at.map_or("-".into(), |t| ago(now, t)),
                        (expires - now).num_seconds()
                    );
                }
                Some(_) if lease.holder.is_some() => {
                    let _ = writeln!(out, "  EXPIRED: another instance may take it over");
                }
                _ => {
                    let _ = writeln!(out, "  free");
                }
            }
            if let Some(intent) = &lease.wanted_by {
                let live = if intent.expires_at > now {
                    ""
                } else {
                    " (expired)"
                };
                let _ = writeln!(
                    out,
                    "  wanted_by: {} since {} ago{live}",
                    intent.instance,
                    ago(now, intent.requested_at)
                );
            }
        }
    }
    let _ = writeln!(out, "\nCheckpoints:");
    let mut any = false;
    let mut line = |label: &str, checkpoint: &controllers::api::CheckpointRef| {
        any = true;
        let _ = writeln!(
            out,
            "  {label:<10} {}  {} bytes  epoch {}  {} ago{}",
            checkpoint.path,
            checkpoint.size,
            checkpoint.epoch,
            ago(now, checkpoint.created_at),
            checkpoint
                .name
                .as_ref()
                .map_or(String::new(), |n| format!("  name {n}"))
        );
    };
    if let Some(latest) = &status.latest_checkpoint {
        line("latest", latest);
    }
    for previous in &status.previous_checkpoints {
        line("previous", previous);
    }
    for (name, named) in &status.named_checkpoints {
        line(&format!("named:{name}"), named);
    }
    if !any {
        let _ = writeln!(out, "  (none)");
    }
    Ok(out)
}

/// Rings the doorbell of `sandbox`'s holder (if any) after an edit, so it
/// acts within its doorbell interval instead of its resync. Returns what to
/// tell the operator.
async fn ring_holder(store: &dyn Store, sandbox: &SandboxId, holder: Option<InstanceId>) -> String {
    let holder = match holder {
        Some(holder) => Some(holder),
        None => match read_lease(store, sandbox).await {
            Ok(lease) => lease.and_then(|(lease, _)| lease.holder),
            Err(err) => {
                return format!(
                    "; could not read its lock to ring the holder ({err}): it acts within its resync"
                );
            }
        },
    };
    let Some(holder) = holder else {
        return "; nobody holds it".to_owned();
    };
    match ring_doorbell(store, Utc::now(), &holder, sandbox, "sandboxctl").await {
        Ok(()) => format!("; rang {holder}, which acts within its doorbell interval"),
        Err(err) => format!("; could not ring {holder} ({err}): it acts within its resync"),
    }
}

/// Sets `spec.desired_state` with one compare-and-swap.
async fn set_desired(
    store: &dyn Store,
    id: &str,
    desired: DesiredState,
) -> Result<String, OperatorError> {
    let sandbox = parse_id(id)?;
    let (mut metadata, generation, _) = read_metadata(store, &sandbox).await?;
    if desired == DesiredState::Checkpointed && !metadata.spec.enable_checkpoint {
        return Err(OperatorError::Invalid(format!(
            "sandbox {sandbox} was not created with enable_checkpoint: it cannot be evicted (delete it instead)"
        )));
    }
    if metadata.spec.desired_state == desired {
        return Ok(
            format!("sandbox {sandbox} already has desired_state {desired:?}").to_lowercase(),
        );
    }
    metadata.spec.desired_state = desired;
    let key = metadata_key(&sandbox);
    match store
        .put(&key, encode(&metadata), PutMode::Update(generation))
        .await
    {
        Ok(_) => {
            let rung = ring_holder(store, &sandbox, None).await;
            Ok(format!(
                "sandbox {sandbox}: desired_state set to {}{rung}",
                format!("{desired:?}").to_lowercase()
            ))
        }
        Err(StoreError::PreconditionFailed { .. }) => {
            Err(conflict(store, &key, generation, None).await)
        }
        Err(err) => Err(err.into()),
    }
}

/// `evict ID`: checkpoint and release it (it restores on the next attach).
pub async fn evict(store: &dyn Store, id: &str) -> Result<String, OperatorError> {
    set_desired(store, id, DesiredState::Checkpointed).await
}

/// `delete ID`: destroy it; the tombstone and its objects go later.
pub async fn delete(store: &dyn Store, id: &str) -> Result<String, OperatorError> {
    set_desired(store, id, DesiredState::Deleted).await
}

/// `break-lease ID`: `holder: null`. The old holder (if alive) is rung and
/// stops the sandbox without writing; the next attach restores the latest
/// checkpoint.
pub async fn break_lease(store: &dyn Store, id: &str) -> Result<String, OperatorError> {
    let sandbox = parse_id(id)?;
    let Some((mut lease, generation)) = read_lease(store, &sandbox).await? else {
        return Err(OperatorError::NotFound(format!(
            "{sandbox} has no lock.json"
        )));
    };
    let Some(holder) = lease.holder.take() else {
        return Ok(format!("sandbox {sandbox}: the lease is already free"));
    };
    let key = lock_key(&sandbox);
    match store
        .put(&key, encode(&lease), PutMode::Update(generation))
        .await
    {
        Ok(_) => {
            let epoch = lease.epoch;
            let rung = ring_holder(store, &sandbox, Some(holder.clone())).await;
            Ok(format!(
                "sandbox {sandbox}: lease broken (was held by {holder} at epoch {epoch}); that instance stops it without writing{rung}"
            ))
        }
        Err(StoreError::PreconditionFailed { .. }) => {
            Err(conflict(store, &key, generation, None).await)
        }
        Err(err) => Err(err.into()),
    }
}

/// `edit ID`: the document in `$EDITOR`, validated, written back with a
/// compare-and-swap. `editor` is the command (`$EDITOR`, default `vi`).
pub async fn edit(
    store: &dyn Store,
    id: &str,
    editor: &str,
    scratch: &Path,
) -> Result<String, OperatorError> {
    let sandbox = parse_id(id)?;
    let key = metadata_key(&sandbox);
    let object = match store.get(&key).await {
        Ok(object) => object,
        Err(StoreError::NotFound { .. }) => {
            return Err(OperatorError::NotFound(sandbox.to_string()));
        }
        Err(err) => return Err(err.into()),
    };
    let path: PathBuf = scratch.join(format!("sandboxctl-edit-{sandbox}.json"));
    std::fs::write(&path, &object.data)
        .map_err(|err| OperatorError::Io(format!("cannot write {}: {err}", path.display())))?;
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sandboxctl-edit")
        .arg(&path)
        .status()
        .map_err(|err| OperatorError::Io(format!("cannot run the editor {editor:?}: {err}")))?;
    if !status.success() {
        return Err(OperatorError::Io(format!(
            "the editor exited with {status}; nothing was written"
        )));
    }
    let edited = std::fs::read(&path)
        .map_err(|err| OperatorError::Io(format!("cannot read {}: {err}", path.display())))?;
    if edited == object.data.as_ref() {
        let _ = std::fs::remove_file(&path);
        return Ok("no changes".to_owned());
    }
    let metadata = decode::<SandboxMetadata>(&edited).map_err(|err| {
        OperatorError::Invalid(format!(
            "{err}; nothing was written; your edit is kept in {}",
            path.display()
        ))
    })?;
    if metadata.sandbox_id != sandbox {
        return Err(OperatorError::Invalid(format!(
            "sandbox_id must stay {sandbox}; nothing was written; your edit is kept in {}",
            path.display()
        )));
    }
    match store
        .put(
            &key,
            bytes::Bytes::from(edited),
            PutMode::Update(object.generation),
        )
        .await
    {
        Ok(generation) => {
            let _ = std::fs::remove_file(&path);
            let rung = ring_holder(store, &sandbox, None).await;
            Ok(format!(
                "sandbox {sandbox} edited (generation {}){rung}",
                generation.0
            ))
        }
        Err(StoreError::PreconditionFailed { .. }) => {
            Err(conflict(store, &key, object.generation, Some(&path)).await)
        }
        Err(err) => Err(err.into()),
    }
}

/// What `gc` found (and removed unless it was a dry run).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Tombstoned sandboxes older than the retention.
    pub tombstones: Vec<String>,
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
            match super::checkpoints::trim_history(
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
        let status = &metadata.status;
        let all: Vec<&controllers::api::CheckpointRef> = status
            .latest_checkpoint
            .iter()
            .chain(&status.previous_checkpoints)
            .chain(status.named_checkpoints.values())
            .collect();
        let deleted_at = status.deleted_at().unwrap_or(metadata.created_at);
        if status.phase == controllers::api::Phase::Deleted && now - deleted_at > retention {
            report.tombstones.push(id.clone());
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

pub(super) async fn delete_checkpoint(
    store: &dyn Store,
    image_path: &str,
) -> Result<(), OperatorError> {
    Ok(controllers::sandboxes::delete_checkpoint_objects(store, image_path).await?)
}
