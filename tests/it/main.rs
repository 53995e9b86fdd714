//! The integration tests: one binary, one module per area, grouped by what
//! the tests need (docs/testing.md):
//!
//! - [`pure`] needs nothing outside the process (no root, no runsc): the
//!   quick tier;
//! - [`store`] needs fake-gcs-server;
//! - [`gvisor`] needs runsc, the sandbox images and root;
//! - [`cluster`] runs several server processes on one bucket.
//!
//! `cargo nextest run --test it -E 'test(/^pure::/)'` runs one tier;
//! `cargo test --test it gvisor::files` one module. [`support`] holds the
//! fixtures they share.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]
#![allow(
    clippy::disallowed_methods,
    reason = "the tests measure real waits and stamp their fixtures with the host's clock; the server they test reads its injected one"
)]

mod cluster;
mod gvisor;
mod pure;
mod store;
mod support;
