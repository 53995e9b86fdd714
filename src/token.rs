//! Sandbox tokens: 32 random bytes, hex-encoded, handed to the client once;
//! only their SHA-256 is stored (`spec.token_sha256`), and checks compare
//! digests in constant time.
//!
//! A module of its own, below the API layer and workspace sync, which both
//! check tokens (and the operator credential, checked the same way).

use std::collections::HashMap;

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};

/// The header that carries a sandbox token (so that it stays out of URLs,
/// which proxies and access logs keep).
pub const TOKEN_HEADER: &str = "x-sandbox-token";

/// Where a request's sandbox token came from (logged with a refusal; the
/// token itself never is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// `X-Sandbox-Token`.
    Header,
    /// `Authorization: Bearer` (the file API's earlier form).
    Bearer,
    /// `?sandbox_token=`.
    Query,
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Header => "x-sandbox-token header",
            Self::Bearer => "authorization header",
            Self::Query => "sandbox_token query parameter",
        })
    }
}

/// The sandbox token of a request and where it came from: the
/// `X-Sandbox-Token` header, else (when `bearer`) `Authorization: Bearer`
/// (the scheme in any case), else the `sandbox_token` query parameter.
/// An empty value counts as absent.
pub fn of_request(
    headers: &HeaderMap,
    query: &HashMap<String, String>,
    bearer: bool,
) -> Option<(String, TokenSource)> {
    let header_value = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(|value| value.trim().to_owned())
    };
    let from_header = header_value(TOKEN_HEADER).map(|token| (token, TokenSource::Header));
    let from_bearer = || {
        bearer
            .then(|| header_value(header::AUTHORIZATION.as_str()))
            .flatten()
            .and_then(|value| {
                let (scheme, token) = value.split_once(' ')?;
                scheme
                    .eq_ignore_ascii_case("bearer")
                    .then(|| (token.trim().to_owned(), TokenSource::Bearer))
            })
    };
    let from_query = || {
        query
            .get("sandbox_token")
            .map(|token| (token.clone(), TokenSource::Query))
    };
    from_header
        .or_else(from_bearer)
        .or_else(from_query)
        .filter(|(token, _)| !token.is_empty())
}

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
    fn the_token_comes_from_the_header_then_the_bearer_then_the_query() {
        let mut headers = HeaderMap::new();
        let mut query = HashMap::new();
        assert_eq!(of_request(&headers, &query, true), None);
        query.insert("sandbox_token".to_owned(), "q".to_owned());
        assert_eq!(
            of_request(&headers, &query, true),
            Some(("q".to_owned(), TokenSource::Query))
        );
        headers.insert(header::AUTHORIZATION, "bearer b".parse().unwrap());
        assert_eq!(
            of_request(&headers, &query, true),
            Some(("b".to_owned(), TokenSource::Bearer))
        );
        assert_eq!(
            of_request(&headers, &query, false),
            Some(("q".to_owned(), TokenSource::Query))
        );
        headers.insert(TOKEN_HEADER, "h".parse().unwrap());
        assert_eq!(
            of_request(&headers, &query, true),
            Some(("h".to_owned(), TokenSource::Header))
        );
    }

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
