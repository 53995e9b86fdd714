//! Forks: a new sandbox started from its own copy of another one's checkpoint (fresh id), never a
//! reference: each reconciler deletes its own superseded checkpoints, so a shared image would
//! vanish under one. A copy is one GCS server-side request (a file copy on a directory store); one
//! whose fork is never recorded is garbage for `sandboxctl gc`.

use super::*;
use crate::api::encode;
use crate::store::{ObjectKey, PutMode};

/// Which checkpoint of the source a fork starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForkPoint {
    Latest,
    Named(String),
}

/// Why a fork cannot start from the checkpoint asked for.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("sandbox {0} has no checkpoint yet: checkpoint it first")]
    NoCheckpoint(SandboxId),
    #[error("sandbox {sandbox} has no checkpoint named {name:?}")]
    NoNamedCheckpoint { sandbox: SandboxId, name: String },
    #[error("cannot copy the checkpoint: {0}")]
    Copy(#[from] ReconcileError),
}

/// A fork's own copy of its source's checkpoint.
#[derive(Debug, Clone)]
pub struct ForkedCheckpoint {
    /// What the fork records as its latest checkpoint.
    pub reference: CheckpointRef,
    /// The copy's manifest (the fork's id, epoch 0).
    pub manifest: CheckpointManifest,
    pub source_checkpoint: String,
}

impl Reconciler {
    /// Copies checkpoint `point` of `source` for the new sandbox `fork`;
    /// returns what its metadata records as latest (epoch 0: no lease yet).
    pub async fn copy_checkpoint_for_fork(
        &self,
        source: &SandboxMetadata,
        point: &ForkPoint,
        fork: &SandboxId,
    ) -> Result<ForkedCheckpoint, ForkError> {
        let reference = match point {
            ForkPoint::Latest => source
                .status
                .latest_checkpoint
                .as_ref()
                .ok_or_else(|| ForkError::NoCheckpoint(source.sandbox_id.clone()))?,
            ForkPoint::Named(name) => {
                source.status.named_checkpoints.get(name).ok_or_else(|| {
                    ForkError::NoNamedCheckpoint {
                        sandbox: source.sandbox_id.clone(),
                        name: name.clone(),
                    }
                })?
            }
        };
        let manifest = self.load_manifest(reference).await?;
        let source_image =
            ObjectKey::new(manifest.image.key.as_str()).map_err(|err| ReconcileError::Invalid {
                key: "manifest.image.key".to_owned(),
                detail: err.to_string(),
            })?;
        let checkpoint_id = SandboxId::random();
        let image_key = checkpoint_image_key(&checkpoint_id);
        let copying = self.checkpoints.copy_blob(&source_image, &image_key);
        let copied = copying.await.map_err(ReconcileError::from)?;
        if copied.size != manifest.image.size {
            return Err(ForkError::Copy(ReconcileError::Invalid {
                key: image_key.to_string(),
                detail: format!(
                    "the copy has {} bytes, the manifest says {}",
                    copied.size, manifest.image.size
                ),
            }));
        }
        let source_checkpoint = manifest.checkpoint_id.clone();
        let mut copy = manifest;
        copy.checkpoint_id = checkpoint_id.to_string();
        copy.sandbox_id = fork.clone();
        copy.epoch = 0;
        copy.name = None;
        copy.image.key = image_key.to_string();
        // Its own age, lest `gc` take a fresh copy whose fork is being recorded for an old orphan.
        copy.created_at = self.clock.now();
        let manifest_key = checkpoint_manifest_key(&checkpoint_id);
        let put = self
            .checkpoints
            .put(&manifest_key, encode(&copy), PutMode::Create);
        put.await.map_err(ReconcileError::from)?;
        Ok(ForkedCheckpoint {
            reference: self.checkpoint_ref(&copy, 0, None),
            manifest: copy,
            source_checkpoint,
        })
    }
}
