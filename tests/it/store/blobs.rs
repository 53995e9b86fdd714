//! 200 MB blobs streamed both ways on every backend, with peak memory checked on
//! the local and GCS stores. The peak-RSS measurement is the process's: under
//! nextest each test has a process of its own; under `cargo test` run this
//! module alone with `--test-threads 1`.

use crate::support;
use crate::support::conformance;

use conformance::{MemoryLimit, large_blob_round_trip};

const SIZE: u64 = 200_000_000;
/// Streaming keeps a few buffers; holding the blob would add 200 MB.
const MAX_GROWTH: u64 = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_round_trips_a_200mb_blob() {
    let fixture = support::memory_fixture().await;
    // The in-memory store holds blobs in memory by nature: content only.
    large_blob_round_trip(fixture.store.clone(), SIZE, MemoryLimit(None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_store_streams_a_200mb_blob_in_flat_memory() {
    let fixture = support::local_fixture().await;
    large_blob_round_trip(fixture.store.clone(), SIZE, MemoryLimit(Some(MAX_GROWTH))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcs_store_streams_a_200mb_blob_in_flat_memory() {
    let fixture = support::gcs_fixture().await;
    large_blob_round_trip(fixture.store.clone(), SIZE, MemoryLimit(Some(MAX_GROWTH))).await;
}
