//! Who owns a named workspace: its scope, derived from the workspace token.
//!
//! `/create` needs no credential, so a workspace name alone must open
//! nothing. A workspace therefore lives under its owner's *scope*,
//! `workspaces/owner.<scope>/<name>/`, where the scope is a one-way hash of
//! the token that names it (as filesystem snapshots are scoped,
//! `crate::api::snapshot_owner`). Two tokens naming `team-main` address two
//! workspaces; neither create is refused, and neither learns that the other
//! exists. The bucket holds only the hash, and there is no owner record to
//! race for: the token *is* the key.
//!
//! Workspaces from before owner scopes live at `workspaces/<name>/` with an
//! `owner.json` holding the token's SHA-256. A create whose token matches
//! that record keeps using the old prefix (so nothing is migrated); any other
//! token gets its own scoped workspace, exactly as if the old one did not
//! exist.

use sha2::{Digest, Sha256};

/// The owner scope of workspace token `token` (32 hex digits). Domain
/// separated from snapshot scopes, so one secret used for both opens
/// unrelated prefixes.
pub fn scope(token: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"sandboxd workspace owner\0");
    hasher.update(token.as_bytes());
    let digest = hex::encode(hasher.finalize());
    digest[..controllers::api::OWNER_SCOPE_LEN].to_owned()
}

/// The workspace path (`spec.workspace.id`) of workspace `name` owned by
/// `token`: `owner.<scope>/<name>`.
pub fn owned_path(token: &str, name: &str) -> String {
    controllers::api::owned_snapshot_path(&scope(token), name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_tokens_naming_one_workspace_address_two_and_hold_no_token() {
        let (a, b) = ("token-of-tenant-a-0123", "token-of-tenant-b-0123");
        let (path_a, path_b) = (owned_path(a, "team-main"), owned_path(b, "team-main"));
        assert_ne!(path_a, path_b);
        assert_eq!(path_a, owned_path(a, "team-main"));
        for (path, token) in [(&path_a, a), (&path_b, b)] {
            assert!(controllers::api::is_workspace_path(path), "{path}");
            assert!(!path.contains(token));
            assert_eq!(controllers::api::workspace_name_of(path), "team-main");
        }
        // Not the snapshot scope of the same secret.
        assert_ne!(
            scope(a),
            crate::api::snapshot_owner::SnapshotProof::new(a).scope()
        );
    }
}
