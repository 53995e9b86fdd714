//! The Store conformance suite on GCS: a real fake-gcs-server (the
//! in-process backends run it in `pure::store_conformance`).

use crate::support::conformance::conformance_suite;

conformance_suite!(gcs, crate::support::gcs_fixture);
