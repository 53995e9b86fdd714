//! Where a filesystem snapshot lives: its name under its owner's scope.
//!
//! A snapshot belongs to whoever made it (docs/security.md): its objects live under
//! `filesystem_snapshots/owner.<scope>/<name>/`, where the scope is a hash of
//! the owner's snapshot token (the API layer derives both; the bucket holds
//! only the hash). Two owners' snapshots of one name are two snapshots, and a
//! client can only name snapshots under a scope whose token it holds: another
//! owner's snapshot is, to it, an unknown name. A deployment that shares
//! snapshots (one team) keeps the earlier server's layout,
//! `filesystem_snapshots/<name>/`, with no scope.
//!
//! A *snapshot path* is what `spec.filesystem_snapshot_name`, the runtime's
//! snapshot calls and the layout's keys carry: `<name>` (shared) or
//! `owner.<scope>/<name>` (owned). The `.` keeps a scope segment apart from
//! every name (names have no dots).

use super::metadata::is_resource_name;

/// The first segment of an owned snapshot's path, before the scope.
pub const OWNER_SCOPE_PREFIX: &str = "owner.";

/// Hex digits of an owner scope.
pub const OWNER_SCOPE_LEN: usize = 32;

/// True for a valid owner scope (32 lowercase hex digits).
pub fn is_owner_scope(scope: &str) -> bool {
    scope.len() == OWNER_SCOPE_LEN
        && scope
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The path of snapshot `name` owned by `scope`.
pub fn owned_snapshot_path(scope: &str, name: &str) -> String {
    format!("{OWNER_SCOPE_PREFIX}{scope}/{name}")
}

/// The scope (if owned) and name of a snapshot path; `None` if invalid.
pub fn split_snapshot_path(path: &str) -> Option<(Option<&str>, &str)> {
    match path.split_once('/') {
        None => is_resource_name(path).then_some((None, path)),
        Some((owner, name)) => {
            let scope = owner.strip_prefix(OWNER_SCOPE_PREFIX)?;
            (is_owner_scope(scope) && is_resource_name(name)).then_some((Some(scope), name))
        }
    }
}

/// True for a valid snapshot path (`<name>` or `owner.<scope>/<name>`).
pub fn is_snapshot_path(path: &str) -> bool {
    split_snapshot_path(path).is_some()
}

/// True for a valid workspace path: a synced workspace is scoped by its
/// owner the way a snapshot is (`workspaces/owner.<scope>/<name>/`, the
/// scope a hash of the workspace token), and `<name>` alone is the earlier
/// layout, which existing workspaces keep.
pub fn is_workspace_path(path: &str) -> bool {
    split_snapshot_path(path).is_some()
}

/// The name part of a workspace path, for messages (never the scope).
pub fn workspace_name_of(path: &str) -> &str {
    snapshot_name_of(path)
}

/// The name part of a snapshot path (the whole string if it is not one):
/// what messages show, so a refusal never names another owner's scope.
pub fn snapshot_name_of(path: &str) -> &str {
    split_snapshot_path(path).map_or(path, |(_, name)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_a_name_or_a_scope_and_a_name() {
        let scope = "0123456789abcdef0123456789abcdef";
        assert_eq!(split_snapshot_path("base"), Some((None, "base")));
        let owned = owned_snapshot_path(scope, "base");
        assert_eq!(split_snapshot_path(&owned), Some((Some(scope), "base")));
        assert_eq!(snapshot_name_of(&owned), "base");
        for bad in [
            "",
            "Base",
            "../etc",
            "owner./base",
            "owner.0123/base",
            "other.0123456789abcdef0123456789abcdef/base",
            "owner.0123456789abcdef0123456789abcdef/",
            "owner.0123456789abcdef0123456789abcdef/a/b",
            "owner.0123456789ABCDEF0123456789abcdef/base",
        ] {
            assert!(!is_snapshot_path(bad), "{bad:?}");
        }
    }
}
