//! TLS for every HTTPS client the server and its tools build (the GCS
//! clients, `sandboxctl`'s HTTP calls): rustls with the `ring` crypto
//! provider, installed once per process before the first client.
//!
//! The google-cloud crates and reqwest default to `aws-lc-rs`, whose C
//! library alone took about 90 s of a clean two-core build; `ring` does the
//! same job here for a fraction of that. Without a provider installed, a
//! reqwest client panics when it is built, so clients are built only through
//! [`http_client_builder`] (clippy's `disallowed-methods` refuses
//! `reqwest::Client::new`, `reqwest::Client::builder` and `reqwest::get`),
//! and the GCS store installs the provider before its clients.

use std::sync::Once;

/// Installs `ring` as the process's rustls crypto provider (once; a provider
/// installed before, by whoever, is kept).
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // An `Err` means a provider is installed already: that one serves.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A reqwest client builder whose TLS has its crypto provider.
pub fn http_client_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    #[allow(
        clippy::disallowed_methods,
        reason = "the one place a reqwest client is begun: after the provider"
    )]
    reqwest::Client::builder()
}
