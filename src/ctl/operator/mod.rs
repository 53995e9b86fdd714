//! `sandboxctl describe | edit | evict | delete | break-lease | gc`: operator
//! verbs on the bucket's documents. Every write is a compare-and-swap on the
//! generation read, so an operator never overwrites a controller's (or another
//! operator's) concurrent change; a lost race is a clear conflict, not a retry
//! behind their back.
//!
//! Here: the error, reading a sandbox's documents, and the writes (`edit`,
//! `evict`, `delete`, `break-lease`); `describe.rs` renders one sandbox;
//! `gc.rs` collects what nothing needs any more (`snapshot_gc.rs`: the
//! filesystem snapshots).

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

mod describe;
mod gc;
mod snapshot_gc;

pub use describe::describe;
pub(super) use gc::delete_checkpoint;
pub use gc::{GcReport, gc};
pub use snapshot_gc::{SnapshotGcReport, gc_snapshots};

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

pub(super) async fn read_lease(
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
    #[allow(
        clippy::disallowed_methods,
        reason = "sandboxctl runs on the operator's machine, outside any instance: its time is the host's"
    )]
    let now = Utc::now();
    match ring_doorbell(store, now, &holder, sandbox, "sandboxctl").await {
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
    if desired != DesiredState::Deleted && metadata.is_deleted() {
        return Err(OperatorError::Invalid(format!(
            "sandbox {sandbox} is deleted or being deleted: deletion is final"
        )));
    }
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
    // One scratch file per edit: two edits of one sandbox on one machine
    // (two operators, or two terminals) must not share, or one's cleanup
    // removes the other's file while its editor has it open.
    let path: PathBuf = scratch.join(format!(
        "sandboxctl-edit-{sandbox}-{}.json",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, &object.data))
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

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        reason = "tests fail by panicking"
    )]

    use std::sync::Arc;

    use chrono::Utc;
    use controllers::api::{SandboxId, SandboxMetadata, encode};
    use controllers::layout::metadata_key;
    use controllers::store::{PutMode, Store};
    use controllers::testing::MemoryStore;

    const ID: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    /// Two edits of one sandbox at once on one machine each keep their own
    /// scratch file: the one that finishes first does not remove the file the
    /// other's editor is still reading (they shared one path before).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_edits_of_one_sandbox_at_once_each_have_their_own_file() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let sandbox = SandboxId::parse(ID).unwrap();
        let metadata = SandboxMetadata::new(sandbox.clone(), Utc::now(), "ab".repeat(32));
        store
            .put(&metadata_key(&sandbox), encode(&metadata), PutMode::Create)
            .await
            .unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let edit_with = |editor: &'static str| {
            let store = Arc::clone(&store);
            let scratch = scratch.path().to_owned();
            tokio::spawn(async move { super::edit(store.as_ref(), ID, editor, &scratch).await })
        };
        // The quick editor finishes (no changes: its file is removed) while
        // the slow one still has to read its own.
        let slow = edit_with("sleep 0.6; cat");
        let quick = edit_with("sleep 0.1; cat");
        assert_eq!(quick.await.unwrap().unwrap(), "no changes");
        assert_eq!(slow.await.unwrap().unwrap(), "no changes");
        assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
    }
}
