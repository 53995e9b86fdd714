//! The Store conformance suite on every backend: in-memory, local directory, and
//! GCS on a real fake-gcs-server.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]

mod conformance;
mod support;

macro_rules! conformance_suite {
    ($backend:ident, $fixture:path) => {
        mod $backend {
            macro_rules! case {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let fixture = $fixture().await;
                        crate::conformance::$name(fixture.store.clone()).await;
                    }
                };
            }
            case!(create_if_absent);
            case!(compare_and_swap);
            case!(concurrent_creates_have_one_winner);
            case!(concurrent_updates_lose_nothing);
            case!(list_paginates);
            case!(delete_removes);
            case!(missing_objects);
            case!(invalid_keys_rejected);
            case!(blob_from_a_stream);
            case!(adopted_blob);
            case!(copied_blob);
        }
    };
}

conformance_suite!(memory, crate::support::memory_fixture);
conformance_suite!(local, crate::support::local_fixture);
conformance_suite!(gcs, crate::support::gcs_fixture);
