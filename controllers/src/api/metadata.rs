//! `sandboxes/<id>/metadata.json`: a sandbox's desired state (`spec`) and
//! observed state (`status`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{API_VERSION, ApiObject, ExtraFields, InstanceId, NetworkMode, SandboxId};

/// The whole document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxMetadata {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    pub sandbox_id: SandboxId,
    pub created_at: DateTime<Utc>,
    pub spec: SandboxSpec,
    #[serde(default)]
    pub status: SandboxStatus,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// What should be true. Written by the API layer and by operators.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    pub desired_state: DesiredState,
    /// Seconds without client activity before the sandbox is stopped; `null`
    /// means never.
    #[serde(default)]
    pub idle_timeout: Option<u64>,
    #[serde(default)]
    pub enable_checkpoint: bool,
    #[serde(default)]
    pub enable_sandbox_handoff: bool,
    #[serde(default)]
    pub enable_idle_timeout_auto_checkpoint: bool,
    #[serde(default)]
    pub filesystem_snapshot_name: Option<String>,
    /// A handoff, eviction or drain checkpoints a running execution with the
    /// sandbox instead of killing it (decision 12); absent means `false`, the
    /// earlier server's forced kill.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_executions: bool,
    /// Chosen at create; absent in older documents, which means `none`.
    #[serde(default, skip_serializing_if = "NetworkMode::is_none")]
    pub network: NetworkMode,
    /// The sandbox image asked for at create (a name); absent: the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// SHA-256 (hex) of the sandbox token. The token itself is never stored.
    pub token_sha256: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The name given to the checkpoint taken because `desired_state` became
    /// `checkpointed` (a named checkpoint can be restored by name later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_name: Option<String>,
    /// One-shot request to restore a named checkpoint instead of the latest the
    /// next time the sandbox starts. Honoured once: `status.last_restore_request`
    /// records the `requested_at` it served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_request: Option<RestoreRequest>,
    /// Keep `/workspace` in sync with the bucket (`docs/workspaces.md`); absent means
    /// no sync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceSpec>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// A synced workspace: `/workspace` mirrored incrementally to `workspaces/<id>/`,
/// where `id` is `owner.<scope>/<name>` (scoped by the workspace token) or,
/// for a workspace from before owner scopes, `<name>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkspaceSpec {
    /// The workspace's path (`owner.<scope>/<name>` or an earlier `<name>`).
    /// Sandboxes given the same name and token share its files (one at a
    /// time: see `docs/workspaces.md`).
    pub id: String,
    /// Which set of lifecycle hooks runs (a template the server defines).
    #[serde(default = "default_workspace_template")]
    pub template: String,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// The template a workspace gets when none is named.
pub const DEFAULT_WORKSPACE_TEMPLATE: &str = "default";

fn default_workspace_template() -> String {
    DEFAULT_WORKSPACE_TEMPLATE.to_owned()
}

/// Restore the checkpoint called `checkpoint` (see `status.named_checkpoints`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreRequest {
    pub checkpoint: String,
    pub requested_at: DateTime<Utc>,
}

/// The state an operator or the API asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DesiredState {
    Running,
    Checkpointed,
    Deleted,
}

/// What is true, as last observed. Written by controllers only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxStatus {
    #[serde(default)]
    pub phase: Phase,
    #[serde(default)]
    pub holder: Option<InstanceId>,
    /// The lease epoch of the last writer: fencing refuses writers below it.
    #[serde(default)]
    pub epoch: u64,
    /// The metadata generation whose spec the controllers last acted on.
    #[serde(default)]
    pub observed_generation: Option<i64>,
    #[serde(default)]
    pub latest_checkpoint: Option<CheckpointRef>,
    /// Superseded unnamed checkpoints still kept, newest first (older ones
    /// are deleted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous_checkpoints: Vec<CheckpointRef>,
    /// Every named checkpoint, by name (the latest one with a name wins).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub named_checkpoints: BTreeMap<String, CheckpointRef>,
    /// `spec.restore_request.requested_at` of the last restore request served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restore_request: Option<DateTime<Utc>>,
    #[serde(default)]
    pub latest_snapshot: Option<SnapshotRef>,
    /// The sandbox and checkpoint this one was forked from (absent: created).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// The lifecycle phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    #[default]
    Pending,
    Creating,
    Running,
    Checkpointing,
    Checkpointed,
    Restoring,
    Deleting,
    /// Tombstone: the sandbox is gone; garbage collection removes the objects.
    Deleted,
    Failed,
}

/// Where the newest good checkpoint is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRef {
    pub bucket: String,
    /// Object key of the image, `sandbox_checkpoints/<checkpoint_id>/checkpoint.img`.
    pub path: String,
    /// Lease epoch of the holder that wrote it.
    pub epoch: u64,
    pub sha256: String,
    pub size: u64,
    pub created_at: DateTime<Utc>,
    /// The user's name for a named checkpoint, if any.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

impl CheckpointRef {
    /// True when this is newer than `than` (by epoch, then time taken) at
    /// another path.
    pub fn is_newer_than(&self, than: Option<&CheckpointRef>) -> bool {
        than.is_none_or(|than| {
            (self.epoch, self.created_at) > (than.epoch, than.created_at) && self.path != than.path
        })
    }
}

/// Where a forked sandbox came from: the source and the checkpoint copied
/// (by the source's checkpoint id; the name it was asked for by, if any).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkOrigin {
    pub sandbox_id: SandboxId,
    pub checkpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The newest filesystem snapshot taken of this sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRef {
    pub name: String,
    pub bucket: String,
    pub path: String,
    pub sha256: String,
    pub size: u64,
    pub created_at: DateTime<Utc>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// A Kubernetes-style condition (`type`, `status`, `reason`, `message`,
/// `lastTransitionTime`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: ConditionStatus,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    #[serde(rename = "lastTransitionTime")]
    pub last_transition_time: DateTime<Utc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// The condition type the controllers keep: whether the sandbox runs.
pub const READY: &str = "Ready";

/// Why the `Ready` condition is what it is (its `reason`). Only `Running`
/// means ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyReason {
    Running,
    Checkpointed,
    Deleted,
    /// Its create failed, or it died or was lost with a failed checkpoint.
    Failed,
    /// A restore failed; the checkpoint is as it was and may be tried again.
    RestoreFailed,
}

impl ReadyReason {
    pub const ALL: [Self; 5] = [
        Self::Running,
        Self::Checkpointed,
        Self::Deleted,
        Self::Failed,
        Self::RestoreFailed,
    ];

    /// The `reason` string written in `metadata.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "Running",
            Self::Checkpointed => "Checkpointed",
            Self::Deleted => "Deleted",
            Self::Failed => "Failed",
            Self::RestoreFailed => "RestoreFailed",
        }
    }

    /// The reason a condition's `reason` string names, if it is one of ours.
    pub fn parse(reason: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == reason)
    }
}

impl SandboxMetadata {
    /// A new sandbox's document: desired running, nothing observed yet.
    pub fn new(sandbox_id: SandboxId, created_at: DateTime<Utc>, token_sha256: String) -> Self {
        Self {
            api_version: API_VERSION.to_owned(),
            sandbox_id,
            created_at,
            spec: SandboxSpec {
                desired_state: DesiredState::Running,
                idle_timeout: None,
                enable_checkpoint: false,
                enable_sandbox_handoff: false,
                enable_idle_timeout_auto_checkpoint: false,
                filesystem_snapshot_name: None,
                keep_executions: false,
                network: NetworkMode::None,
                image: None,
                token_sha256,
                labels: BTreeMap::new(),
                checkpoint_name: None,
                restore_request: None,
                workspace: None,
                extra: ExtraFields::new(),
            },
            status: SandboxStatus::default(),
            extra: ExtraFields::new(),
        }
    }

    /// Being deleted (`desired_state: deleted`) or a tombstone (`phase:
    /// Deleted`). Deletion is final: such a sandbox takes no other intent
    /// (a checkpoint, an attach written after the delete would otherwise
    /// bring it back from its checkpoint), and a tombstone is never started
    /// again, whatever its spec says.
    pub fn is_deleted(&self) -> bool {
        self.spec.desired_state == DesiredState::Deleted || self.status.phase == Phase::Deleted
    }
}

impl SandboxStatus {
    /// Sets a condition, moving `lastTransitionTime` only when its status changes.
    pub fn set_condition(
        &mut self,
        kind: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
        now: DateTime<Utc>,
    ) {
        match self.conditions.iter_mut().find(|c| c.kind == kind) {
            Some(existing) => {
                if existing.status != status {
                    existing.last_transition_time = now;
                }
                existing.status = status;
                reason.clone_into(&mut existing.reason);
                message.clone_into(&mut existing.message);
            }
            None => self.conditions.push(Condition {
                kind: kind.to_owned(),
                status,
                reason: reason.to_owned(),
                message: message.to_owned(),
                last_transition_time: now,
            }),
        }
    }

    pub fn condition(&self, kind: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.kind == kind)
    }

    /// Sets the `Ready` condition: true for [`ReadyReason::Running`] only.
    pub fn set_ready(&mut self, reason: ReadyReason, message: &str, now: DateTime<Utc>) {
        let status = if reason == ReadyReason::Running {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        self.set_condition(READY, status, reason.as_str(), message, now);
    }

    /// The `Ready` condition's reason, when it is one the controllers write.
    pub fn ready_reason(&self) -> Option<ReadyReason> {
        self.condition(READY)
            .and_then(|condition| ReadyReason::parse(&condition.reason))
    }

    /// When the sandbox was tombstoned (`Ready` turned false for `Deleted`),
    /// if its condition says so.
    pub fn deleted_at(&self) -> Option<DateTime<Utc>> {
        self.condition(READY)
            .filter(|c| ReadyReason::parse(&c.reason) == Some(ReadyReason::Deleted))
            .map(|c| c.last_transition_time)
    }
}

impl ApiObject for SandboxMetadata {
    const KIND: &'static str = "metadata.json";

    fn api_version(&self) -> &str {
        &self.api_version
    }

    fn validate(&self) -> Result<(), (String, String)> {
        if !is_sha256_hex(&self.spec.token_sha256) {
            return Err(field(
                "spec.token_sha256",
                "expected 64 lowercase hex digits",
            ));
        }
        if self
            .spec
            .idle_timeout
            .is_some_and(|s| s == 0 || s > MAX_IDLE_TIMEOUT_S)
        {
            return Err(field(
                "spec.idle_timeout",
                "must be 1 to 2592000 seconds (30 days), or null for no timeout",
            ));
        }
        if let Some(name) = &self.spec.filesystem_snapshot_name
            && !super::is_snapshot_path(name)
        {
            return Err(field("spec.filesystem_snapshot_name", RESOURCE_NAME_RULE));
        }
        if let Some(name) = &self.spec.checkpoint_name
            && !is_resource_name(name)
        {
            return Err(field("spec.checkpoint_name", RESOURCE_NAME_RULE));
        }
        if let Some(request) = &self.spec.restore_request
            && !is_resource_name(&request.checkpoint)
        {
            return Err(field("spec.restore_request.checkpoint", RESOURCE_NAME_RULE));
        }
        if let Some(workspace) = &self.spec.workspace {
            if !super::is_workspace_path(&workspace.id) {
                return Err(field(
                    "spec.workspace.id",
                    "a name, or owner.<scope>/<name> (32 hex digits of scope)",
                ));
            }
            if !is_resource_name(&workspace.template) {
                return Err(field("spec.workspace.template", RESOURCE_NAME_RULE));
            }
        }
        if let Some(checkpoint) = &self.status.latest_checkpoint {
            if !is_sha256_hex(&checkpoint.sha256) {
                return Err(field(
                    "status.latest_checkpoint.sha256",
                    "expected 64 lowercase hex digits",
                ));
            }
            if crate::store::ObjectKey::new(checkpoint.path.as_str()).is_err() {
                return Err(field(
                    "status.latest_checkpoint.path",
                    "not a valid object key",
                ));
            }
            if checkpoint.epoch > self.status.epoch {
                return Err(field(
                    "status.latest_checkpoint.epoch",
                    "is higher than status.epoch",
                ));
            }
        }
        if let Some(snapshot) = &self.status.latest_snapshot
            && !super::is_snapshot_path(&snapshot.name)
        {
            return Err(field("status.latest_snapshot.name", RESOURCE_NAME_RULE));
        }
        Ok(())
    }
}

/// Longest idle timeout a sandbox may have: 30 days (`null`: none at all).
pub const MAX_IDLE_TIMEOUT_S: u64 = 30 * 24 * 3600;

/// The charset and length of user-chosen names (snapshots, checkpoints).
pub const RESOURCE_NAME_RULE: &str = "expected 1-63 characters of lowercase letters, digits, '-' and '_', starting with a letter or digit";

/// True for an acceptable snapshot or checkpoint name.
pub fn is_resource_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// True for a lowercase hex SHA-256 digest.
pub fn is_sha256_hex(value: &str) -> bool {
    value.len() == 64
        && value
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn field(path: &str, message: &str) -> (String, String) {
    (path.to_owned(), message.to_owned())
}
