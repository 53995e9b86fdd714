//! Store adapters: the local directory (the embedded default) and GCS.
//!
//! Both implement `controllers::store::Store` and pass the same conformance
//! suite (`tests/it/pure/store_conformance.rs`) as the in-memory test store.

mod gcs;
mod gcs_json;
mod local;
mod pacing;

pub use gcs::{GCS_ENDPOINT, GcsConfig, GcsStore, RetrySettings, emulator_endpoint};
pub use local::LocalStore;

use std::path::PathBuf;
use std::sync::Arc;

use controllers::store::{Store, StoreError};

/// Where one kind of artifact is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A directory: a mount path, or the embedded default.
    Directory(PathBuf),
    /// A GCS bucket, possibly on an emulator.
    Bucket {
        bucket: String,
        emulator_host: Option<String>,
    },
}

/// Opens the store at `location`.
pub async fn open(location: &StoreLocation) -> Result<Arc<dyn Store>, StoreError> {
    Ok(match location {
        StoreLocation::Directory(path) => Arc::new(LocalStore::open(path.clone())?),
        StoreLocation::Bucket {
            bucket,
            emulator_host,
        } => {
            let mut config = GcsConfig::new(bucket.clone());
            if let Some(host) = emulator_host {
                config = config.with_emulator_host(host);
            }
            Arc::new(GcsStore::connect(config).await?)
        }
    })
}
