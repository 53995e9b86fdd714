//! Who is calling: the client's address, as the server's connection layer
//! saw it (a request extension, [`ClientAddr`]).

use std::net::SocketAddr;

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
