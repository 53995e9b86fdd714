//! Tests against fake-gcs-server: the shared emulator (nextest's setup
//! script starts one per run; `cargo test` starts one per binary) or one of
//! their own. No root beyond port 80 of a loopback address.

mod blobs;
mod conformance;
mod ctl_cli;
mod faults;
mod gcs;
mod storage_model;
