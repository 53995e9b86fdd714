//! The API objects: the JSON documents in the bucket that instances and
//! operators read and write.
//!
//! Two objects per sandbox, in the spirit of Kubernetes resources:
//! - `sandboxes/<id>/metadata.json` ([`SandboxMetadata`]): `spec` is the desired
//!   state (API layer and operators write it), `status` the observed state
//!   (controllers write it).
//! - `sandboxes/<id>/lock.json` ([`Lease`]): who runs the sandbox now, the
//!   fencing epoch, and the attach intent `wanted_by`.
//!
//! And two per instance: `instances/<id>/lease.json` ([`InstanceLease`]), which
//! keeps every hold of that instance live, and `instances/<id>/doorbell.json`
//! ([`Doorbell`]), where intent writers ring the holder.
//!
//! Both carry `apiVersion`, are pretty-printed (people read and edit them), and
//! keep fields they do not know: an operator's note survives every controller's
//! read-modify-write. Decoding errors name the offending field (`spec.desired_state`).
//! `docs/operations.md` documents every field.

mod codec;
mod ids;
mod image_name;
mod instance;
mod lease;
mod manifest;
mod metadata;
mod network;
mod snapshot_path;

pub use codec::{ApiObject, DecodeError, decode, encode};
pub use ids::{InstanceId, InvalidId, SandboxId};
pub use image_name::{IMAGE_NAME_RULE, is_digest, is_image_name};
pub use instance::{
    Doorbell, InstanceLease, MAX_RINGS, ReadGenerations, Ring, RungIntent, ring_retention,
};
pub use lease::{AttachIntent, Lease};
pub use manifest::{BlobDigest, CheckpointManifest, SnapshotManifest};
pub use metadata::{
    CheckpointRef, Condition, ConditionStatus, DEFAULT_WORKSPACE_TEMPLATE, DesiredState,
    ForkOrigin, MAX_IDLE_TIMEOUT_S, Phase, READY, RESOURCE_NAME_RULE, ReadyReason, RestoreRequest,
    SandboxMetadata, SandboxSpec, SandboxStatus, SnapshotRef, WorkspaceSpec, is_resource_name,
    is_sha256_hex,
};
pub use network::{NetworkMode, UnknownNetworkMode};
pub use snapshot_path::{
    OWNER_SCOPE_LEN, OWNER_SCOPE_PREFIX, is_owner_scope, is_snapshot_path, is_workspace_path,
    owned_snapshot_path, snapshot_name_of, split_snapshot_path, workspace_name_of,
};

/// The `apiVersion` of every object this version writes and understands.
pub const API_VERSION: &str = "sandboxd.dev/v1";

/// Unknown fields, kept verbatim so read-modify-write never drops them.
pub type ExtraFields = serde_json::Map<String, serde_json::Value>;

#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) mod fuzz_tests;
