//! Where each object lives in the bucket (`docs/operations.md`). The only place that
//! spells out key formats; ids are validated types, so every key is valid.

use crate::api::{InstanceId, SandboxId};
use crate::store::ObjectKey;

/// Prefix under which every sandbox has its directory.
pub const SANDBOXES_PREFIX: &str = "sandboxes/";

fn key(value: String) -> ObjectKey {
    // Every caller builds the key from validated ids and fixed names, which
    // always form a valid key; an invalid one would be a bug here.
    ObjectKey::new(value).unwrap_or_else(|err| panic!("layout built an invalid key: {err}"))
}

/// `sandboxes/<id>/metadata.json`
pub fn metadata_key(id: &SandboxId) -> ObjectKey {
    key(format!("{SANDBOXES_PREFIX}{id}/metadata.json"))
}

/// `sandboxes/<id>/lock.json`
pub fn lock_key(id: &SandboxId) -> ObjectKey {
    key(format!("{SANDBOXES_PREFIX}{id}/lock.json"))
}

/// Prefix under which every instance has its lease and doorbell.
pub const INSTANCES_PREFIX: &str = "instances/";

/// An instance id as a key segment: instance ids may hold `:` or start with
/// `.`, which keys refuse; both become `_`.
fn instance_segment(instance: &InstanceId) -> String {
    let mut segment: String = instance
        .to_string()
        .chars()
        .map(|c| if c == ':' { '_' } else { c })
        .collect();
    if segment.starts_with('.') {
        segment.replace_range(..1, "_");
    }
    segment
}

/// `instances/<instance>/lease.json`
pub fn instance_lease_key(instance: &InstanceId) -> ObjectKey {
    key(format!(
        "{INSTANCES_PREFIX}{}/lease.json",
        instance_segment(instance)
    ))
}

/// `instances/<instance>/doorbell.json`
pub fn doorbell_key(instance: &InstanceId) -> ObjectKey {
    key(format!(
        "{INSTANCES_PREFIX}{}/doorbell.json",
        instance_segment(instance)
    ))
}

/// Prefix of every checkpoint's directory.
pub const CHECKPOINTS_PREFIX: &str = "sandbox_checkpoints/";
/// Prefix of every filesystem snapshot's directory.
pub const SNAPSHOTS_PREFIX: &str = "filesystem_snapshots/";

/// `sandbox_checkpoints/<checkpoint_id>/checkpoint.img`; the id is a fresh
/// 32-hex-digit name (or, for a handoff, [`handoff_checkpoint_id`]), so a
/// recorded image is never written again.
pub fn checkpoint_image_key(checkpoint_id: &SandboxId) -> ObjectKey {
    key(format!(
        "{CHECKPOINTS_PREFIX}{checkpoint_id}/checkpoint.img"
    ))
}

/// The checkpoint id of the handoff of `sandbox` held at `epoch` to
/// `taker`: known to both sides before the checkpoint is taken, so the taker
/// can fetch the image the moment it is uploaded, before the hold is
/// transferred (decision 24). Unique per sandbox and epoch and taker: a
/// holder checkpoints a sandbox for one taker at one epoch at most once
/// successfully (the checkpoint stops it here; running it again takes a new
/// epoch), so a recorded image is never overwritten; an unrecorded one (a
/// failed attempt) may be, and the taker checks every byte against the
/// digest the transfer records anyway.
pub fn handoff_checkpoint_id(sandbox: &SandboxId, epoch: u64, taker: &InstanceId) -> SandboxId {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"handoff\0")
        .chain_update(sandbox.as_str())
        .chain_update(b"\0")
        .chain_update(epoch.to_be_bytes())
        .chain_update(taker.as_str())
        .finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    SandboxId::from_u128(u128::from_be_bytes(first))
}

/// `sandbox_checkpoints/<checkpoint_id>/manifest.json`
pub fn checkpoint_manifest_key(checkpoint_id: &SandboxId) -> ObjectKey {
    key(format!("{CHECKPOINTS_PREFIX}{checkpoint_id}/manifest.json"))
}

/// The checkpoint id in an image key written by [`checkpoint_image_key`];
/// `None` for any other string (an operator may have edited it).
pub fn checkpoint_id_of_image(image_key: &str) -> Option<SandboxId> {
    let id = image_key
        .strip_prefix(CHECKPOINTS_PREFIX)?
        .strip_suffix("/checkpoint.img")?;
    SandboxId::parse(id).ok()
}

/// `filesystem_snapshots/<name>/<archive_id>.tar.gz`, or `None` for an invalid
/// name. Every snapshot gets a fresh archive id, so two snapshots taken under
/// one name never overwrite each other's bytes; the manifest names the current one.
///
/// `name` is a snapshot path (`crate::api::split_snapshot_path`): an owned
/// snapshot's objects are under `filesystem_snapshots/owner.<scope>/<name>/`.
pub fn snapshot_archive_key(name: &str, archive_id: &SandboxId) -> Option<ObjectKey> {
    crate::api::is_snapshot_path(name)
        .then(|| key(format!("{SNAPSHOTS_PREFIX}{name}/{archive_id}.tar.gz")))
}

/// `filesystem_snapshots/<path>/manifest.json`, or `None` for an invalid
/// snapshot path (`<name>` or `owner.<scope>/<name>`).
pub fn snapshot_manifest_key(name: &str) -> Option<ObjectKey> {
    crate::api::is_snapshot_path(name)
        .then(|| key(format!("{SNAPSHOTS_PREFIX}{name}/manifest.json")))
}

/// Prefix of every synced workspace's directory.
pub const WORKSPACES_PREFIX: &str = "workspaces/";

/// `workspaces/<path>/sandbox-state`: the workspace's committed state file (the
/// sandbox-side name, `.sandbox-state`, is not a valid key: segments cannot
/// start with a dot). `None` for an invalid workspace path.
///
/// A workspace path is `owner.<scope>/<name>` (`crate::api::is_workspace_path`)
/// or, for a workspace from before owner scopes, `<name>`.
pub fn workspace_state_key(workspace: &str) -> Option<ObjectKey> {
    crate::api::is_workspace_path(workspace)
        .then(|| key(format!("{WORKSPACES_PREFIX}{workspace}/sandbox-state")))
}

/// `workspaces/<name>/owner.json`: the SHA-256 of the token that owns a
/// workspace of the earlier, unscoped layout (read, never written now).
/// `None` for an invalid workspace name.
pub fn workspace_owner_key(workspace: &str) -> Option<ObjectKey> {
    crate::api::is_resource_name(workspace)
        .then(|| key(format!("{WORKSPACES_PREFIX}{workspace}/owner.json")))
}

/// `workspaces/<path>/files/<md5>`: one file content, stored once per checksum.
/// `None` for an invalid workspace path or checksum.
pub fn workspace_blob_key(workspace: &str, md5: &str) -> Option<ObjectKey> {
    let is_md5 = md5.len() == 32
        && md5
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    (crate::api::is_workspace_path(workspace) && is_md5)
        .then(|| key(format!("{WORKSPACES_PREFIX}{workspace}/files/{md5}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_design_layout() {
        let id = SandboxId::parse("0123456789abcdef0123456789abcdef").unwrap();
        assert_eq!(
            metadata_key(&id).as_str(),
            "sandboxes/0123456789abcdef0123456789abcdef/metadata.json"
        );
        assert_eq!(
            lock_key(&id).as_str(),
            "sandboxes/0123456789abcdef0123456789abcdef/lock.json"
        );
    }

    #[test]
    fn every_instance_id_makes_valid_instance_keys() {
        for raw in ["sandboxd-1", "host:8080", ".hidden", "a.b_c-d"] {
            let instance = InstanceId::parse(raw).unwrap();
            let lease = instance_lease_key(&instance);
            assert!(lease.as_str().starts_with("instances/"), "{lease}");
            assert!(doorbell_key(&instance).as_str().ends_with("/doorbell.json"));
        }
        assert_eq!(
            instance_lease_key(&InstanceId::parse("host:8080").unwrap()).as_str(),
            "instances/host_8080/lease.json"
        );
    }

    #[test]
    fn a_handoff_checkpoint_id_is_known_to_both_sides_and_differs_by_epoch_and_taker() {
        let sandbox = SandboxId::parse("0123456789abcdef0123456789abcdef").unwrap();
        let other = SandboxId::parse("fedcba9876543210fedcba9876543210").unwrap();
        let (b, c) = (
            InstanceId::parse("b").unwrap(),
            InstanceId::parse("c").unwrap(),
        );
        let id = handoff_checkpoint_id(&sandbox, 7, &b);
        assert_eq!(id, handoff_checkpoint_id(&sandbox, 7, &b));
        for different in [
            handoff_checkpoint_id(&sandbox, 8, &b),
            handoff_checkpoint_id(&sandbox, 7, &c),
            handoff_checkpoint_id(&other, 7, &b),
        ] {
            assert_ne!(id, different);
        }
        assert_eq!(
            checkpoint_id_of_image(checkpoint_image_key(&id).as_str()),
            Some(id)
        );
    }

    #[test]
    fn a_checkpoint_id_round_trips_through_its_image_key() {
        let id = SandboxId::from_u128(42);
        assert_eq!(
            checkpoint_id_of_image(checkpoint_image_key(&id).as_str()),
            Some(id)
        );
        assert_eq!(
            checkpoint_id_of_image("sandbox_checkpoints/../x/checkpoint.img"),
            None
        );
        assert_eq!(checkpoint_id_of_image("elsewhere/checkpoint.img"), None);
    }

    #[test]
    fn workspace_keys_refuse_bad_names_and_checksums() {
        assert_eq!(
            workspace_blob_key("proj", "d41d8cd98f00b204e9800998ecf8427e")
                .unwrap()
                .as_str(),
            "workspaces/proj/files/d41d8cd98f00b204e9800998ecf8427e"
        );
        assert!(workspace_blob_key("proj", "../../x").is_none());
        assert!(workspace_blob_key("Proj", "d41d8cd98f00b204e9800998ecf8427e").is_none());
        assert!(workspace_state_key("../x").is_none());
        assert_eq!(
            workspace_state_key("proj").unwrap().as_str(),
            "workspaces/proj/sandbox-state"
        );
        let owned = format!("owner.{}/proj", "0".repeat(32));
        assert_eq!(
            workspace_state_key(&owned).unwrap().as_str(),
            format!("workspaces/{owned}/sandbox-state")
        );
        assert!(workspace_state_key("owner.0/proj").is_none());
        assert!(workspace_owner_key(&owned).is_none());
    }
}
