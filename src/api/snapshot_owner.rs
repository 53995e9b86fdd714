//! Who owns a filesystem snapshot, and what proves it (docs/security.md; the threat
//! model is in docs/security.md).
//!
//! A snapshot belongs to the sandbox that made it. Its owner proves itself
//! with either that sandbox's token or the snapshot token the server returns
//! with `SANDBOX_FILESYSTEM_SNAPSHOT_CREATED` (an extra field the earlier
//! clients ignore). The snapshot token is derived from the sandbox token by
//! a one-way hash, so it can be handed to someone who should create from the
//! snapshots and overwrite them without handing them the sandbox. The
//! *read-only* token (`filesystem_snapshot_read_token`, a further one-way
//! hash) is for consumers: it creates from the snapshots and overwrites
//! none, so a consumer cannot poison a template. All three lead to one
//! *scope*, a hash of the read-only token, under which the snapshot's
//! objects live (`controllers::api::owned_snapshot_path`): the
//! bucket holds neither token, and a request naming a snapshot with another
//! owner's name looks under its own scope and finds nothing, exactly like an
//! unknown name.
//!
//! The earlier clients send only `filesystem_snapshot_name` at create; they
//! can carry the proof in it as `NAME@TOKEN`. A deployment that sets
//! `SANDBOXD_SHARED_SNAPSHOTS` (one team) keeps the earlier server's
//! deployment-wide names and asks for no proof.
//!
//! Snapshots taken before read-only tokens live under the *earlier scope*, a
//! hash of the snapshot token: the owner's proofs still open them (a create
//! looks there when the current scope has no such name), read-only tokens
//! do not, and the owner's next snapshot of the name goes to the current
//! scope.

use sha2::{Digest, Sha256};

/// Prefix of snapshot tokens (sandbox tokens are bare hex).
const SNAPSHOT_TOKEN_PREFIX: &str = "sst-";
/// Prefix of read-only snapshot tokens.
const READ_TOKEN_PREFIX: &str = "ssr-";

/// A proof of ownership as a client sent it: a sandbox token, a snapshot
/// token (both the owner's), or a read-only snapshot token. Never printed.
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

    /// Whether this proof is the owner's (a sandbox or snapshot token), which
    /// may overwrite; a read-only token may only create from the snapshots.
    pub fn is_owner(&self) -> bool {
        !self.0.is_empty() && !self.0.starts_with(READ_TOKEN_PREFIX)
    }

    /// The owner's snapshot token this proof stands for (`None`: a
    /// read-only token, from which it cannot be derived).
    fn owner_token(&self) -> Option<String> {
        if self.0.is_empty() {
            Some("sandboxd: owned by nobody".to_owned())
        } else if self.0.starts_with(READ_TOKEN_PREFIX) {
            None
        } else if self.0.starts_with(SNAPSHOT_TOKEN_PREFIX) {
            Some(self.0.clone())
        } else {
            Some(snapshot_token(&self.0))
        }
    }

    /// The owner's snapshot token (what `SANDBOX_FILESYSTEM_SNAPSHOT_CREATED`
    /// hands out); for a read-only proof, the proof itself.
    pub fn snapshot_token(&self) -> String {
        self.owner_token().unwrap_or_else(|| self.0.clone())
    }

    /// The read-only token of this proof's owner.
    pub fn read_token(&self) -> String {
        match self.owner_token() {
            Some(owner) => read_token(&owner),
            None => self.0.clone(),
        }
    }

    /// The owner scope this proof opens: a hash of the read-only token, so
    /// every proof of one owner opens it and the bucket holds no token.
    pub fn scope(&self) -> String {
        scope_of(&self.read_token())
    }

    /// The scope of snapshots taken before read-only tokens (a hash of the
    /// snapshot token): the owner's proofs still open it; `None` for a
    /// read-only proof.
    pub fn earlier_scope(&self) -> Option<String> {
        self.owner_token().map(|owner| scope_of(&owner))
    }

    /// The path of snapshot `name` owned by this proof's owner.
    pub fn path(&self, name: &str) -> String {
        controllers::api::owned_snapshot_path(&self.scope(), name)
    }

    /// The path of snapshot `name` under [`Self::earlier_scope`].
    pub fn earlier_path(&self, name: &str) -> Option<String> {
        self.earlier_scope()
            .map(|scope| controllers::api::owned_snapshot_path(&scope, name))
    }
}

fn scope_of(token: &str) -> String {
    let digest = hex::encode(Sha256::digest(token.as_bytes()));
    digest[..controllers::api::OWNER_SCOPE_LEN].to_owned()
}

/// The snapshot token of the sandbox whose token is `sandbox_token`.
pub fn snapshot_token(sandbox_token: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"sandboxd filesystem snapshot owner\0");
    hasher.update(sandbox_token.as_bytes());
    format!("{SNAPSHOT_TOKEN_PREFIX}{}", hex::encode(hasher.finalize()))
}

/// The read-only token of the owner whose snapshot token is `snapshot_token`:
/// a one-way hash, so a consumer given it cannot derive the owner's.
pub fn read_token(snapshot_token: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"sandboxd filesystem snapshot reader\0");
    hasher.update(snapshot_token.as_bytes());
    format!("{READ_TOKEN_PREFIX}{}", hex::encode(hasher.finalize()))
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
    fn a_read_only_token_opens_the_owners_scope_and_owns_nothing() {
        let owner = SnapshotProof::new(crate::token::generate());
        let reader = SnapshotProof::new(owner.read_token());
        assert!(reader.read_token().starts_with("ssr-"));
        assert_eq!(reader.scope(), owner.scope());
        assert_eq!(
            SnapshotProof::new(owner.snapshot_token()).read_token(),
            reader.read_token()
        );
        assert!(owner.is_owner() && !reader.is_owner());
        assert!(!SnapshotProof::nobody().is_owner());
        // The earlier scope is the owner's alone, and is not the current one.
        assert_eq!(reader.earlier_scope(), None);
        assert_ne!(owner.earlier_scope(), Some(owner.scope()));
        let token = owner.snapshot_token();
        let earlier = hex::encode(Sha256::digest(token.as_bytes()));
        assert_eq!(owner.earlier_scope().unwrap(), earlier[..32]);
        // Neither owner secret is in the reader's token or the scope.
        assert!(!reader.read_token().contains(&token[4..]));
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
