//! `manifest.json` beside every checkpoint image and snapshot archive: what the
//! blob is, so a restore can verify it before trusting it.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{API_VERSION, ApiObject, ExtraFields, NetworkMode, SandboxId, is_sha256_hex};

/// A stored blob: its key, size and SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobDigest {
    pub key: String,
    pub size: u64,
    pub sha256: String,
}

/// `sandbox_checkpoints/<checkpoint_id>/manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointManifest {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    pub checkpoint_id: String,
    pub sandbox_id: SandboxId,
    /// Lease epoch of the holder that took it.
    pub epoch: u64,
    #[serde(default)]
    pub name: Option<String>,
    pub created_at: DateTime<Utc>,
    pub image: BlobDigest,
    /// `runsc --version`'s first line on the host that took it.
    pub runsc_version: String,
    pub platform: String,
    /// CPU feature flags of the host that took it (from /proc/cpuinfo: this runsc
    /// cannot report the set it exposes). A restore host must have all of them.
    #[serde(default)]
    pub cpu_features: Vec<String>,
    /// The sandbox's network mode: a restore sets the same kind of network up
    /// (with the restoring host's own address). Absent: `none`.
    #[serde(default, skip_serializing_if = "NetworkMode::is_none")]
    pub network: NetworkMode,
    /// The digest (`sha256-<hex>`) of the sandbox image it ran on: a restore
    /// needs that very image. Absent in checkpoints taken before images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_image: Option<String>,
    /// The protocol version of the agent inside the image (it comes back
    /// with the image, so the restoring host must speak it). Absent in
    /// checkpoints taken before it was recorded; the runtime decides what
    /// that means (docs/decisions/0014-typed-agent-protocol.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<u32>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

/// `filesystem_snapshots/<name>/manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotManifest {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    pub name: String,
    pub source_sandbox: SandboxId,
    pub created_at: DateTime<Utc>,
    pub archive: BlobDigest,
    /// Files, directories and links in the archive.
    pub entries: u64,
    /// The digest of the sandbox image it was taken on (sandboxes created
    /// from it without `"image"` get that image). Absent: before images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_image: Option<String>,
    #[serde(flatten)]
    pub extra: ExtraFields,
}

impl CheckpointManifest {
    pub fn api_version() -> String {
        API_VERSION.to_owned()
    }
}

fn check_digest(prefix: &str, digest: &BlobDigest) -> Result<(), (String, String)> {
    if !is_sha256_hex(&digest.sha256) {
        return Err((
            format!("{prefix}.sha256"),
            "expected 64 lowercase hex digits".to_owned(),
        ));
    }
    if crate::store::ObjectKey::new(digest.key.as_str()).is_err() {
        return Err((format!("{prefix}.key"), "not a valid object key".to_owned()));
    }
    Ok(())
}

impl ApiObject for CheckpointManifest {
    const KIND: &'static str = "checkpoint manifest.json";

    fn api_version(&self) -> &str {
        &self.api_version
    }

    fn validate(&self) -> Result<(), (String, String)> {
        check_digest("image", &self.image)
    }
}

impl ApiObject for SnapshotManifest {
    const KIND: &'static str = "snapshot manifest.json";

    fn api_version(&self) -> &str {
        &self.api_version
    }

    fn validate(&self) -> Result<(), (String, String)> {
        if !super::is_snapshot_path(&self.name) {
            return Err((
                "name".to_owned(),
                super::metadata::RESOURCE_NAME_RULE.to_owned(),
            ));
        }
        check_digest("archive", &self.archive)
    }
}
