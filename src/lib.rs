//! The sandbox server: adapters for the controllers' ports and the binaries'
//! building blocks.
//!
//! `controllers` owns the API objects, the ports and the reconcile logic; this
//! crate plugs real things into the ports (GCS, a local directory, gVisor) and
//! serves HTTP. Dependencies point one way, from here to `controllers`.

// Time comes from the injected clock (`controllers::clock`, clippy.toml's
// `disallowed-methods`); unit tests may read the host's.
#![cfg_attr(
    test,
    allow(
        clippy::disallowed_methods,
        reason = "unit tests measure real waits with the host's clock"
    )
)]

pub mod api;
pub mod boot;
pub mod client;
pub mod config;
pub mod ctl;
pub mod metrics;
pub mod runtime;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod token;
pub mod workspace;
