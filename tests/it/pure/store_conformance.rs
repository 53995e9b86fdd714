//! The Store conformance suite on the in-process backends: in-memory and
//! local directory (GCS on fake-gcs-server is `store::conformance`).

use crate::support::conformance::conformance_suite;

conformance_suite!(memory, crate::support::memory_fixture);
conformance_suite!(local, crate::support::local_fixture);
