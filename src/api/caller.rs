//! Who is calling, and what one caller may hold of an instance.
//!
//! The caller is the identity Cloud Run's IAM verified, when the operator
//! says one was (`--caller-identity-verified`, for a service whose invokers
//! must present an ID token): the subject (its `email`, else its `sub`) of
//! the bearer ID token the platform checked, which is the one in
//! `X-Serverless-Authorization` when a client sends that header (Cloud Run
//! then checks it and passes `Authorization` on untouched), else the one in
//! `Authorization`. The platform checked the token's signature before the
//! request reached the server, so the payload is only decoded here. Without
//! that setting (a local run, a service open to `allUsers`) nobody checked
//! a token, and anyone could name any identity: every request is known by
//! its client address ([`ClientAddr`]), without the port.
//!
//! [`CallerQuota`] counts the sandboxes each caller created that this
//! instance holds (and the creates in progress): a create past
//! `--max-sandboxes-per-caller` is refused naming the setting, and other
//! callers' creates go on being served.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use axum::http::{HeaderMap, header};
use base64::Engine as _;
use controllers::api::SandboxId;

/// The peer address of a request's connection (Cloud Run's front end, or
/// the client itself without a proxy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

impl ClientAddr {
    /// The address of `extension`, or "unknown" without one (a router
    /// driven without the server's connection layer).
    pub fn describe(extension: Option<&Self>) -> String {
        extension.map_or_else(|| "unknown".to_owned(), |addr| addr.0.to_string())
    }
}

/// A caller, as limits count them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Caller {
    /// The verified identity of the bearer ID token (`email` or `sub`).
    Identity(String),
    /// The client's address (no identity was forwarded).
    Address(std::net::IpAddr),
    /// Neither (a router driven without the connection layer).
    Unknown,
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Identity(identity) => write!(f, "{identity}"),
            Self::Address(addr) => write!(f, "address {addr}"),
            Self::Unknown => f.write_str("an unknown caller"),
        }
    }
}

impl Caller {
    /// The caller of a request with `headers` from `client`; its token's
    /// identity counts only when `identity_verified` (see the module docs).
    pub fn of_request(
        headers: &HeaderMap,
        client: Option<&ClientAddr>,
        identity_verified: bool,
    ) -> Self {
        if identity_verified && let Some(identity) = bearer_identity(headers) {
            return Self::Identity(identity);
        }
        client.map_or(Self::Unknown, |addr| Self::Address(addr.0.ip()))
    }
}

/// The header Cloud Run checks instead of `Authorization` when a client
/// sends both.
const SERVERLESS_AUTHORIZATION: &str = "x-serverless-authorization";

/// The `email` (else `sub`) of the bearer JWT Cloud Run checked (in
/// `X-Serverless-Authorization` if sent, else in `Authorization`), decoded
/// without verification; `None` when there is no such token.
fn bearer_identity(headers: &HeaderMap) -> Option<String> {
    let value = headers
        .get(SERVERLESS_AUTHORIZATION)
        .or_else(|| headers.get(header::AUTHORIZATION))?
        .to_str()
        .ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut parts = token.trim().split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&payload).ok()?;
    ["email", "sub"]
        .iter()
        .find_map(|claim| claims[*claim].as_str())
        .filter(|identity| !identity.is_empty())
        .map(|identity| identity.chars().take(256).collect())
}

/// A create refused because its caller holds its quota here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{caller} holds {held} sandboxes on this instance, the most one caller may \
     (--max-sandboxes-per-caller {max}); end one or wait for one to go idle"
)]
pub struct QuotaExceeded {
    pub caller: String,
    pub held: usize,
    pub max: usize,
}

/// The sandboxes each caller created that this instance holds.
#[derive(Debug, Default)]
pub struct CallerQuota {
    /// Sandboxes one caller may hold here; `None`: no limit.
    max: Option<usize>,
    /// Whether a bearer token's identity was verified by the platform
    /// (`--caller-identity-verified`); else callers are their addresses.
    identity_verified: bool,
    held: Mutex<HashMap<Caller, Vec<SandboxId>>>,
}

impl CallerQuota {
    pub fn new(max: Option<usize>, identity_verified: bool) -> Self {
        Self {
            max,
            identity_verified,
            held: Mutex::default(),
        }
    }

    /// The caller of a request with `headers` from `client`, as this
    /// deployment knows callers ([`Caller::of_request`]).
    pub fn caller(&self, headers: &HeaderMap, client: Option<&ClientAddr>) -> Caller {
        Caller::of_request(headers, client, self.identity_verified)
    }

    /// Counts `sandbox` against `caller`, unless the caller already holds
    /// its quota of sandboxes for which `still_here` is true (the others
    /// are forgotten). A sandbox counts against one caller at a time: the
    /// last that created or restored it here. True when it was not counted
    /// against `caller` already (the caller's to [`Self::release`] if its
    /// start fails).
    pub fn reserve(
        &self,
        caller: &Caller,
        sandbox: &SandboxId,
        still_here: impl Fn(&SandboxId) -> bool,
    ) -> Result<bool, QuotaExceeded> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let ids = held.entry(caller.clone()).or_default();
        ids.retain(|id| still_here(id));
        if ids.contains(sandbox) {
            return Ok(false);
        }
        if let Some(max) = self.max
            && ids.len() >= max
        {
            return Err(QuotaExceeded {
                caller: caller.to_string(),
                held: ids.len(),
                max,
            });
        }
        ids.push(sandbox.clone());
        for (other, ids) in held.iter_mut() {
            if other != caller {
                ids.retain(|id| id != sandbox);
            }
        }
        held.retain(|_, ids| !ids.is_empty());
        Ok(true)
    }

    /// Forgets `sandbox` (its create failed).
    pub fn release(&self, caller: &Caller, sandbox: &SandboxId) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(ids) = held.get_mut(caller) {
            ids.retain(|id| id != sandbox);
            if ids.is_empty() {
                held.remove(caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(claims: serde_json::Value) -> String {
        let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        format!(
            "Bearer {}.{}.c2ln",
            encode(br#"{"alg":"RS256"}"#),
            encode(claims.to_string().as_bytes())
        )
    }

    #[test]
    fn an_unverified_token_names_nobody_and_the_checked_header_wins() {
        let client = ClientAddr("10.0.0.7:5555".parse().unwrap());
        let address = Caller::Address("10.0.0.7".parse().unwrap());
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            jwt(serde_json::json!({"email": "victim@example.com"}))
                .parse()
                .unwrap(),
        );
        // Nobody checked the token: its identity is anyone's to claim.
        assert_eq!(Caller::of_request(&headers, Some(&client), false), address);
        let quota = CallerQuota::new(Some(1), false);
        assert_eq!(quota.caller(&headers, Some(&client)), address);
        // Cloud Run checks X-Serverless-Authorization when both are sent,
        // and passes Authorization on as the client wrote it.
        headers.insert(
            SERVERLESS_AUTHORIZATION,
            jwt(serde_json::json!({"email": "me@example.com"}))
                .parse()
                .unwrap(),
        );
        assert_eq!(
            Caller::of_request(&headers, Some(&client), true),
            Caller::Identity("me@example.com".to_owned())
        );
    }

    #[test]
    fn the_caller_is_the_tokens_identity_else_the_address() {
        let client = ClientAddr("10.0.0.7:5555".parse().unwrap());
        let mut headers = HeaderMap::new();
        assert_eq!(
            Caller::of_request(&headers, Some(&client), true),
            Caller::Address("10.0.0.7".parse().unwrap())
        );
        headers.insert(
            header::AUTHORIZATION,
            jwt(serde_json::json!({"sub": "1234", "email": "a@example.com"}))
                .parse()
                .unwrap(),
        );
        assert_eq!(
            Caller::of_request(&headers, Some(&client), true),
            Caller::Identity("a@example.com".to_owned())
        );
        headers.insert(
            header::AUTHORIZATION,
            jwt(serde_json::json!({"sub": "1234"})).parse().unwrap(),
        );
        assert_eq!(
            Caller::of_request(&headers, None, true),
            Caller::Identity("1234".to_owned())
        );
        headers.insert(header::AUTHORIZATION, "Bearer not-a-jwt".parse().unwrap());
        assert_eq!(Caller::of_request(&headers, None, true), Caller::Unknown);
    }

    #[test]
    fn a_caller_at_its_quota_is_refused_and_others_are_not() {
        let quota = CallerQuota::new(Some(2), true);
        let (a, b) = (Caller::Identity("a".into()), Caller::Identity("b".into()));
        let ids: Vec<SandboxId> = (0..4).map(|_| SandboxId::random()).collect();
        quota.reserve(&a, &ids[0], |_| true).unwrap();
        quota.reserve(&a, &ids[1], |_| true).unwrap();
        let refused = quota.reserve(&a, &ids[2], |_| true).unwrap_err();
        assert!(
            refused.to_string().contains("--max-sandboxes-per-caller 2"),
            "{refused}"
        );
        quota.reserve(&b, &ids[3], |_| true).unwrap();
        // One left the instance: room again.
        let gone = ids[0].clone();
        quota.reserve(&a, &ids[2], |id| *id != gone).unwrap();
        quota.release(&a, &ids[2]);
        quota.reserve(&a, &ids[2], |id| *id != gone).unwrap();
    }

    #[test]
    fn a_sandbox_counts_against_the_last_caller_that_brought_it_here() {
        let quota = CallerQuota::new(Some(1), true);
        let (a, b) = (Caller::Identity("a".into()), Caller::Identity("b".into()));
        let sandbox = SandboxId::random();
        assert!(quota.reserve(&a, &sandbox, |_| true).unwrap());
        assert!(
            !quota.reserve(&a, &sandbox, |_| true).unwrap(),
            "counted once"
        );
        // b restores it: it is b's now, and a has room again.
        assert!(quota.reserve(&b, &sandbox, |_| true).unwrap());
        assert!(quota.reserve(&a, &SandboxId::random(), |_| true).unwrap());
        assert!(quota.reserve(&b, &SandboxId::random(), |_| true).is_err());
    }
}
