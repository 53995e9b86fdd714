//! Who owns a filesystem snapshot, and what proves it (docs/security.md; the threat
//! model is in docs/security.md).
//!
//! A snapshot belongs to the sandbox that made it. Its owner proves itself
//! with either that sandbox's token or the snapshot token the server returns
//! with `SANDBOX_FILESYSTEM_SNAPSHOT_CREATED` (an extra field the earlier
//! clients ignore). The snapshot token is derived from the sandbox token by
//! a one-way hash, so it can be handed to someone who should create from the
//! snapshot (or overwrite or delete it) without handing them the sandbox.
//! Both proofs lead to one *scope*, a further hash, under which the
//! snapshot's objects live (`controllers::api::owned_snapshot_path`): the
//! bucket holds neither token, and a request naming a snapshot with another
//! owner's name looks under its own scope and finds nothing, exactly like an
//! unknown name.
//!
//! The earlier clients send only `filesystem_snapshot_name` at create; they
//! can carry the proof in it as `NAME@TOKEN`. A deployment that sets
//! `SANDBOXD_SHARED_SNAPSHOTS` (one team) keeps the earlier server's
//! deployment-wide names and asks for no proof.

use sha2::{Digest, Sha256};

/// Prefix of snapshot tokens (sandbox tokens are bare hex).
const SNAPSHOT_TOKEN_PREFIX: &str = "sst-";

/// A proof of ownership as a client sent it: a sandbox token or a snapshot
/// token. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SnapshotProof(String);

impl std::fmt::Debug for SnapshotProof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SnapshotProof(..)")
    }
}

impl SnapshotProof {
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// The proof of nobody: its scope is one no token opens (every snapshot
    /// token starts with the prefix, this one does not), so a create that
    /// names a snapshot without a proof is refused like an unknown name.
    pub fn nobody() -> Self {
        Self(String::new())
    }

    /// The snapshot token this proof stands for.
    pub fn snapshot_token(&self) -> String {
        if self.0.is_empty() {
            "sandboxd: owned by nobody".to_owned()
        } else if self.0.starts_with(SNAPSHOT_TOKEN_PREFIX) {
            self.0.clone()
        } else {
            snapshot_token(&self.0)
        }
    }

    /// The owner scope this proof opens.
    pub fn scope(&self) -> String {
        let digest = hex::encode(Sha256::digest(self.snapshot_token().as_bytes()));
        digest[..controllers::api::OWNER_SCOPE_LEN].to_owned()
    }

    /// The path of snapshot `name` owned by this proof's owner.
    pub fn path(&self, name: &str) -> String {
        controllers::api::owned_snapshot_path(&self.scope(), name)
    }
}

/// The snapshot token of the sandbox whose token is `sandbox_token`.
pub fn snapshot_token(sandbox_token: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"sandboxd filesystem snapshot owner\0");
    hasher.update(sandbox_token.as_bytes());
    format!("{SNAPSHOT_TOKEN_PREFIX}{}", hex::encode(hasher.finalize()))
}

/// A snapshot name as the init message gave it: `NAME` or `NAME@TOKEN`
/// (the earlier clients' way to carry the proof), and the proof.
pub fn split_name_and_proof(name: &str, token: Option<&str>) -> (String, Option<SnapshotProof>) {
    match (name.split_once('@'), token) {
        (_, Some(token)) if !token.is_empty() => (name.to_owned(), Some(SnapshotProof::new(token))),
        (Some((name, token)), None) if !token.is_empty() => {
            (name.to_owned(), Some(SnapshotProof::new(token)))
        }
        _ => (name.to_owned(), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_token_and_its_snapshot_token_open_the_same_scope_and_others_do_not() {
        let sandbox_token = crate::token::generate();
        let by_sandbox = SnapshotProof::new(sandbox_token.clone());
        let snapshot = snapshot_token(&sandbox_token);
        let by_snapshot = SnapshotProof::new(snapshot.clone());
        assert_eq!(by_sandbox.scope(), by_snapshot.scope());
        assert!(controllers::api::is_owner_scope(&by_sandbox.scope()));
        assert_ne!(
            by_sandbox.scope(),
            SnapshotProof::new(crate::token::generate()).scope()
        );
        // Neither token appears in what is stored.
        let path = by_sandbox.path("base");
        assert!(!path.contains(&sandbox_token) && !path.contains(&snapshot[4..]));
        assert!(controllers::api::is_snapshot_path(&path));
        assert_eq!(format!("{by_sandbox:?}"), "SnapshotProof(..)");
    }

    #[test]
    fn no_proof_opens_the_scope_of_nobody() {
        let nobody = SnapshotProof::nobody().scope();
        for token in ["sst-", "sandboxd: owned by nobody", "x"] {
            assert_ne!(SnapshotProof::new(token).scope(), nobody, "{token:?}");
        }
        assert_eq!(split_name_and_proof("base", Some("")).1, None);
    }

    #[test]
    fn the_proof_can_ride_in_the_name_for_the_earlier_clients() {
        let (name, proof) = split_name_and_proof("base@abc", None);
        assert_eq!(name, "base");
        assert_eq!(proof, Some(SnapshotProof::new("abc")));
        let (name, proof) = split_name_and_proof("base", None);
        assert_eq!((name.as_str(), proof), ("base", None));
        let (name, proof) = split_name_and_proof("base", Some("t"));
        assert_eq!(
            (name.as_str(), proof),
            ("base", Some(SnapshotProof::new("t")))
        );
    }
}
