//! A `Store` wrapper that counts operations, by kind and by sandbox: storage
//! operations cost money on GCS, and the reconcile loop's economy (how many an
//! idle sandbox costs per hour) is a target the benchmarks check.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    BlobReader, BlobSource, Generation, ListPage, ObjectInfo, ObjectKey, PutMode, Store,
    StoreError, Versioned,
};
use crate::layout::SANDBOXES_PREFIX;

/// Operation kinds, as GCS bills them roughly: reads, writes, lists, deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Get,
    Put,
    List,
    Delete,
    Upload,
    Download,
}

impl Operation {
    pub const ALL: [Self; 6] = [
        Self::Get,
        Self::Put,
        Self::List,
        Self::Delete,
        Self::Upload,
        Self::Download,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Put => "put",
            Self::List => "list",
            Self::Delete => "delete",
            Self::Upload => "upload",
            Self::Download => "download",
        }
    }
}

/// GCS list price of a Class A operation (writes, lists, uploads), in
/// dollars per 1,000 (Standard storage, one region).
pub const CLASS_A_DOLLARS_PER_1000: f64 = 0.005;
/// GCS list price of a Class B operation (reads, downloads), in dollars per
/// 1,000. Deletes are free.
pub const CLASS_B_DOLLARS_PER_1000: f64 = 0.0004;

/// Operations by billing class, and what they cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageBill {
    pub class_a: u64,
    pub class_b: u64,
}

impl StorageBill {
    pub fn dollars(&self) -> f64 {
        self.class_a as f64 * CLASS_A_DOLLARS_PER_1000 / 1000.0
            + self.class_b as f64 * CLASS_B_DOLLARS_PER_1000 / 1000.0
    }

    /// What was spent between `earlier` and `self`.
    pub fn since(&self, earlier: &StorageBill) -> StorageBill {
        StorageBill {
            class_a: self.class_a.saturating_sub(earlier.class_a),
            class_b: self.class_b.saturating_sub(earlier.class_b),
        }
    }
}

/// The counters, shareable between stores (metadata and checkpoints).
#[derive(Debug, Default)]
pub struct OperationCounts {
    by_kind: [AtomicU64; 6],
    /// Operations by the sandbox id in the object's key. Not in the
    /// controllers' slot: this decorator sits under every store user (the
    /// reconciler, the API's fork and snapshot reads, `sandboxctl`) and sees
    /// keys, not sandboxes; it also counts sandboxes no pass here owns.
    by_sandbox: Mutex<HashMap<String, u64>>,
}

impl OperationCounts {
    fn record(&self, operation: Operation, key: Option<&str>) {
        let index = Operation::ALL
            .iter()
            .position(|o| *o == operation)
            .unwrap_or(0);
        self.by_kind[index].fetch_add(1, Ordering::Relaxed);
        if let Some(sandbox) = key
            .and_then(|key| key.strip_prefix(SANDBOXES_PREFIX))
            .and_then(|rest| rest.split('/').next())
        {
            *self
                .by_sandbox
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(sandbox.to_owned())
                .or_insert(0) += 1;
        }
    }

    pub fn count(&self, operation: Operation) -> u64 {
        let index = Operation::ALL
            .iter()
            .position(|o| *o == operation)
            .unwrap_or(0);
        self.by_kind[index].load(Ordering::Relaxed)
    }

    /// The operations so far, by billing class.
    pub fn bill(&self) -> StorageBill {
        StorageBill {
            class_a: self.count(Operation::Put)
                + self.count(Operation::List)
                + self.count(Operation::Upload),
            class_b: self.count(Operation::Get) + self.count(Operation::Download),
        }
    }

    pub fn total(&self) -> u64 {
        Operation::ALL.iter().map(|o| self.count(*o)).sum()
    }

    /// Operations on `sandboxes/<id>/…` objects for one sandbox.
    pub fn for_sandbox(&self, sandbox: &str) -> u64 {
        self.by_sandbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(sandbox)
            .copied()
            .unwrap_or(0)
    }
}

/// Counts every operation on `inner`.
#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn Store>,
    counts: Arc<OperationCounts>,
}

impl CountingStore {
    pub fn new(inner: Arc<dyn Store>, counts: Arc<OperationCounts>) -> Self {
        Self { inner, counts }
    }
}

#[async_trait]
impl Store for CountingStore {
    async fn get(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        self.counts.record(Operation::Get, Some(key.as_str()));
        self.inner.get(key).await
    }

    async fn put(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        self.counts.record(Operation::Put, Some(key.as_str()));
        self.inner.put(key, data, mode).await
    }

    async fn list_page(
        &self,
        prefix: &str,
        page_token: Option<String>,
    ) -> Result<ListPage, StoreError> {
        self.counts.record(Operation::List, None);
        self.inner.list_page(prefix, page_token).await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        self.counts.record(Operation::Delete, Some(key.as_str()));
        self.inner.delete(key).await
    }

    async fn upload_blob(
        &self,
        key: &ObjectKey,
        source: BlobSource,
    ) -> Result<ObjectInfo, StoreError> {
        self.counts.record(Operation::Upload, Some(key.as_str()));
        self.inner.upload_blob(key, source).await
    }

    async fn download_blob(&self, key: &ObjectKey) -> Result<BlobReader, StoreError> {
        self.counts.record(Operation::Download, Some(key.as_str()));
        self.inner.download_blob(key).await
    }

    async fn adopt_blob(
        &self,
        key: &ObjectKey,
        path: std::path::PathBuf,
    ) -> Result<ObjectInfo, StoreError> {
        self.counts.record(Operation::Upload, Some(key.as_str()));
        self.inner.adopt_blob(key, path).await
    }

    /// A server-side copy is billed as one write (Class A).
    async fn copy_blob(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectInfo, StoreError> {
        self.counts.record(Operation::Upload, Some(to.as_str()));
        self.inner.copy_blob(from, to).await
    }

    fn local_path(&self, key: &ObjectKey) -> Option<std::path::PathBuf> {
        self.inner.local_path(key)
    }

    fn staging_dir(&self) -> Option<std::path::PathBuf> {
        self.inner.staging_dir()
    }
}
