//! 200 MB blobs streamed both ways on every backend, with peak memory checked on
//! the local and GCS stores. One test at a time in this binary, so the peak-RSS
//! measurement sees only its own allocations.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]

mod conformance;
mod support;

use conformance::{MemoryLimit, large_blob_round_trip};
use tokio::sync::Mutex;

const SIZE: u64 = 200_000_000;
/// Streaming keeps a few buffers; holding the blob would add 200 MB.
const MAX_GROWTH: u64 = 64 << 20;

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_round_trips_a_200mb_blob() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let fixture = support::memory_fixture().await;
    // The in-memory store holds blobs in memory by nature: content only.
    large_blob_round_trip(fixture.store.clone(), SIZE, MemoryLimit(None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_store_streams_a_200mb_blob_in_flat_memory() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let fixture = support::local_fixture().await;
    large_blob_round_trip(fixture.store.clone(), SIZE, MemoryLimit(Some(MAX_GROWTH))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcs_store_streams_a_200mb_blob_in_flat_memory() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let fixture = support::gcs_fixture().await;
    large_blob_round_trip(fixture.store.clone(), SIZE, MemoryLimit(Some(MAX_GROWTH))).await;
}
