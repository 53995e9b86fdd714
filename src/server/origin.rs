//! Browsers: a request that carries an `Origin` header (every WebSocket
//! handshake a browser makes, and its cross-site HTTP requests) is served
//! only when that origin is allowed (`--allowed-origins`, and the server's
//! own origin unless `--allow-same-origin false`). Requests without an
//! `Origin` (the Python and TypeScript clients, `sandboxctl`, curl) are not
//! browsers' and pass. A refusal is `403` with a body naming the setting.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Which browser origins may call the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OriginPolicy {
    /// Origins allowed besides the server's own (`scheme://host[:port]`,
    /// compared without case and without a trailing slash).
    pub allowed: Vec<String>,
    /// The server's own origin (the `Origin` names the request's `Host`).
    pub same_origin: bool,
}

impl OriginPolicy {
    /// True when a request with these headers may be served.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return true;
        };
        let Ok(origin) = origin.to_str() else {
            return false;
        };
        let origin = normalize(origin);
        if self
            .allowed
            .iter()
            .any(|allowed| normalize(allowed) == origin)
        {
            return true;
        }
        if !self.same_origin {
            return false;
        }
        let Some(host) = headers
            .get(header::HOST)
            .and_then(|host| host.to_str().ok())
        else {
            return false;
        };
        let host = host.to_ascii_lowercase();
        ["http://", "https://"]
            .iter()
            .any(|scheme| origin == format!("{scheme}{host}"))
    }
}

fn normalize(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// Middleware: refuses a request whose `Origin` the policy does not allow.
pub async fn check_origin(
    State(policy): State<Arc<OriginPolicy>>,
    request: Request,
    next: Next,
) -> Response {
    if policy.allows(request.headers()) {
        return next.run(request).await;
    }
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("(not text)")
        .chars()
        .take(200)
        .collect::<String>();
    tracing::warn!(%origin, path = %request.uri().path(), "refused a request from a browser origin not allowed");
    (
        StatusCode::FORBIDDEN,
        format!("requests from origin {origin:?} are not allowed (--allowed-origins)"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, host.parse().unwrap());
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, origin.parse().unwrap());
        }
        headers
    }

    #[test]
    fn only_listed_origins_and_the_servers_own_are_allowed() {
        let policy = OriginPolicy {
            allowed: vec!["https://app.example/".to_owned()],
            same_origin: true,
        };
        assert!(policy.allows(&headers(None, "s:8080")));
        assert!(policy.allows(&headers(Some("https://APP.example"), "s:8080")));
        assert!(policy.allows(&headers(Some("http://s:8080"), "s:8080")));
        assert!(!policy.allows(&headers(Some("http://evil.example"), "s:8080")));
        assert!(!policy.allows(&headers(Some("null"), "s:8080")));
        let strict = OriginPolicy::default();
        assert!(!strict.allows(&headers(Some("http://s:8080"), "s:8080")));
        assert!(strict.allows(&headers(None, "s:8080")));
    }
}
