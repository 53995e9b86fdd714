//! The control plane of the sandbox service, with no I/O of its own.
//!
//! This crate holds what the instances agree on and how they converge: the API
//! objects stored in the bucket ([`api`]), the ports the controllers need
//! ([`store::Store`], [`clock::Clock`]), and the coordination built on them
//! ([`leasing`], [`fencing`]). Adapters (GCS, local directory, gVisor) live in
//! the server crate, which depends on this one and never the other way round:
//! the compiler then enforces that the API layer reaches storage and runtimes
//! only through these ports.

// Every reading of time goes through the injected clock (`clock`,
// clippy.toml's `disallowed-methods`); unit tests may read the host's.
#![cfg_attr(
    test,
    allow(
        clippy::disallowed_methods,
        reason = "unit tests measure real waits with the host's clock"
    )
)]

pub mod api;
pub mod clock;
pub mod fencing;
pub mod files;
pub mod hooks;
pub mod layout;
pub mod leasing;
pub mod runtime;
pub mod sandboxes;
pub mod store;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
