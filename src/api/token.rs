//! Sandbox tokens: 32 random bytes, hex-encoded, handed to the client once;
//! only their SHA-256 is stored (`spec.token_sha256`), and checks compare
//! digests in constant time.

use sha2::{Digest, Sha256};

/// A fresh token (64 hex digits, 256 bits from the OS-seeded CSPRNG).
pub fn generate() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

/// The digest stored in `metadata.json`.
pub fn digest(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// True when `token` hashes to `expected_sha256`; the time taken does not
/// depend on where the digests differ.
pub fn matches(token: &str, expected_sha256: &str) -> bool {
    let actual = digest(token);
    let (actual, expected) = (actual.as_bytes(), expected_sha256.as_bytes());
    if actual.len() != expected.len() {
        return false;
    }
    actual
        .iter()
        .zip(expected)
        .fold(0u8, |diff, (a, b)| diff | (a ^ b))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_its_digest_and_nothing_else() {
        let token = generate();
        assert_eq!(token.len(), 64);
        let stored = digest(&token);
        assert!(matches(&token, &stored));
        assert!(!matches(&generate(), &stored));
        assert!(!matches("", &stored));
        assert!(!matches(&token, "short"));
        assert_ne!(stored, token, "the token itself is never what is stored");
    }
}
