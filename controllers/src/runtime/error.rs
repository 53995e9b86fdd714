//! What a runtime's operations fail with. Below both the port
//! ([`super::SandboxRuntime`]) and its filesystem part ([`crate::files`]),
//! which wraps it.

use crate::api::SandboxId;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("sandbox {0} is not running on this host")]
    NotFound(SandboxId),
    #[error("sandbox {0} already runs on this host")]
    AlreadyExists(SandboxId),
    #[error("sandbox {0} has an execution in progress")]
    ExecutionInProgress(SandboxId),
    /// A checkpoint is being taken: nothing may start until it ends (it
    /// would be frozen half-way into the image).
    #[error("sandbox {0} is being checkpointed")]
    Checkpointing(SandboxId),
    #[error("the checkpoint image {key} is corrupt: {detail}")]
    CorruptImage { key: String, detail: String },
    #[error("the checkpoint cannot be restored on this host: {0}")]
    Incompatible(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The sandbox died or was destroyed while the operation ran.
    #[error("sandbox {sandbox} was lost: {detail}")]
    Lost { sandbox: SandboxId, detail: String },
    #[error("runtime failure: {0}")]
    Failed(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}
