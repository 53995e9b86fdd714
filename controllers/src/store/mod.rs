//! The `Store` port: the bucket as the controllers see it.
//!
//! Every piece of shared state (sandbox metadata, leases, checkpoint images) lives
//! in an object store with GCS semantics: each object has a *generation* that
//! changes on every write, and a write may carry a precondition on it. That one
//! primitive, compare-and-swap on the generation, is what the leases and the
//! fenced writes of the controllers are built on, so every backend must honour it
//! exactly; the shared conformance suite (`testing::conformance`) checks that.
//!
//! Large objects (checkpoint images, snapshot archives) go through the blob half
//! of the port, which streams: a backend must never hold a whole blob in memory
//! (the in-memory test backend excepted, by its nature).
//!
//! Nothing here relies on a conditional delete, because fake-gcs-server ignores
//! the precondition on DELETE: callers release and tombstone by writing instead.

mod counting;
mod key;
mod rmw;

pub use counting::{
    CLASS_A_DOLLARS_PER_1000, CLASS_B_DOLLARS_PER_1000, CountingStore, Operation, OperationCounts,
    StorageBill,
};
pub use key::{InvalidKey, ObjectKey};
pub use rmw::{
    Decision, MAX_CONFLICT_RETRIES, RmwError, read_modify_write, read_modify_write_from,
};

use std::fmt;
use std::path::PathBuf;
use std::pin::Pin;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::AsyncRead;

/// The version of one object, as GCS reports it (`x-goog-generation`).
///
/// A later version of one object has a greater generation: GCS's are
/// increasing per object name (even across a delete and re-create), and
/// every store here keeps that (the local store's are at least the last
/// plus one, the in-memory store's a counter). Only versions of the same
/// object are ever compared for order (to start from the newer of two
/// reads); otherwise generations are compared for equality. Generation 0
/// never names an existing object (GCS uses `ifGenerationMatch=0` for "must
/// not exist").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub i64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// How a write treats what is already stored under the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Write unconditionally. The generation it answers may not be the
    /// object's latest when the request was sent twice (a retry, or GCS's
    /// hedge of a slow write): start no conditional write from it.
    Overwrite,
    /// Write only if no object exists (`ifGenerationMatch=0`).
    Create,
    /// Write only if the object still has this generation (compare-and-swap).
    Update(Generation),
}

impl PutMode {
    /// Checks this precondition against the generation currently stored under
    /// `key` (`None`: no object). Backends that evaluate preconditions
    /// themselves (the in-memory and local ones) share this.
    pub fn check(self, key: &ObjectKey, current: Option<Generation>) -> Result<(), StoreError> {
        match (self, current) {
            (Self::Create, Some(existing)) => Err(StoreError::precondition(
                key,
                format!("expected no object, found generation {existing}"),
            )),
            (Self::Update(expected), Some(existing)) if expected != existing => {
                Err(StoreError::precondition(
                    key,
                    format!("expected generation {expected}, found {existing}"),
                ))
            }
            (Self::Update(expected), None) => Err(StoreError::precondition(
                key,
                format!("expected generation {expected}, found no object"),
            )),
            _ => Ok(()),
        }
    }
}

/// An object's bytes together with the generation they were read at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub data: Bytes,
    pub generation: Generation,
}

/// What a listing reports of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: ObjectKey,
    pub size: u64,
    pub generation: Generation,
}

/// One page of a listing; `next_page_token` is `None` on the last page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListPage {
    pub objects: Vec<ObjectInfo>,
    pub next_page_token: Option<String>,
}

impl ListPage {
    /// A page from key-ordered objects that start after the page token: the
    /// first [`LIST_PAGE_SIZE`] of them, with a token if more follow. Backends
    /// that list by themselves (in-memory, local) share this.
    pub fn from_sorted(mut objects: Vec<ObjectInfo>) -> Self {
        let next_page_token = if objects.len() > LIST_PAGE_SIZE {
            objects.truncate(LIST_PAGE_SIZE);
            objects.last().map(|last| last.key.to_string())
        } else {
            None
        };
        Self {
            objects,
            next_page_token,
        }
    }
}

/// A boxed byte stream, as blob downloads return it.
pub type BlobReader = Pin<Box<dyn AsyncRead + Send>>;

/// Where the bytes of a blob upload come from.
pub enum BlobSource {
    /// A file on local disk: the fast path (a checkpoint image, an archive).
    File(PathBuf),
    /// Any byte stream of unknown length.
    Reader(BlobReader),
}

impl fmt::Debug for BlobSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => f.debug_tuple("File").field(path).finish(),
            Self::Reader(_) => f.debug_tuple("Reader").finish_non_exhaustive(),
        }
    }
}

/// Errors a caller can act on. Each names the key it concerns.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object does not exist.
    #[error("object {key} not found")]
    NotFound { key: String },
    /// The write's precondition failed: someone else wrote (or created) the
    /// object since it was read. Re-read and decide again.
    #[error("precondition failed on {key}: it was written concurrently ({detail})")]
    PreconditionFailed { key: String, detail: String },
    /// A temporary failure (throttling, 5xx, connection loss) that outlasted the
    /// backend's own retries. Retrying later may succeed.
    #[error("transient storage error on {key}: {detail}")]
    Transient { key: String, detail: String },
    /// The key is not acceptable as an object name.
    #[error(transparent)]
    InvalidKey(#[from] InvalidKey),
    /// Anything else: permissions, a missing bucket, a corrupt local file.
    #[error("storage error on {key}: {detail}")]
    Other { key: String, detail: String },
}

impl StoreError {
    /// True for errors worth retrying with backoff.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient { .. })
    }

    /// A short, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::NotFound { .. } => "not_found",
            Self::PreconditionFailed { .. } => "precondition_failed",
            Self::Transient { .. } => "transient",
            Self::InvalidKey(_) => "invalid_key",
            Self::Other { .. } => "other",
        }
    }

    pub fn not_found(key: impl fmt::Display) -> Self {
        Self::NotFound {
            key: key.to_string(),
        }
    }

    pub fn precondition(key: impl fmt::Display, detail: impl Into<String>) -> Self {
        Self::PreconditionFailed {
            key: key.to_string(),
            detail: detail.into(),
        }
    }

    pub fn transient(key: impl fmt::Display, detail: impl fmt::Display) -> Self {
        Self::Transient {
            key: key.to_string(),
            detail: detail.to_string(),
        }
    }

    pub fn other(key: impl fmt::Display, detail: impl fmt::Display) -> Self {
        Self::Other {
            key: key.to_string(),
            detail: detail.to_string(),
        }
    }
}

/// The object store port. Implementations: in-memory (feature `testing`), a local
/// directory and GCS (both in the server crate).
///
/// # Guarantees every backend gives
/// - A successful `put` returns the new generation; a later `get` returns exactly
///   those bytes with that generation until the next write.
/// - `PutMode::Create` and `PutMode::Update` are atomic compare-and-swaps: of N
///   concurrent conditional writers against one generation, exactly one wins and
///   the others get [`StoreError::PreconditionFailed`].
/// - Listing is strongly consistent and ordered by key.
///
/// # The read-modify-write loop
/// ```text
/// loop {
///     let current = store.get(&key).await?;              // bytes + generation
///     let next = decide(current.data)?;                  // pure
///     match store.put(&key, next, PutMode::Update(current.generation)).await {
///         Err(StoreError::PreconditionFailed { .. }) => continue, // re-read, decide again
///         other => break other,
///     }
/// }
/// ```
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Reads a small object whole, with its generation.
    async fn get(&self, key: &ObjectKey) -> Result<Versioned, StoreError>;

    /// Writes a small object (JSON documents) under a precondition.
    async fn put(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Generation, StoreError>;

    /// Lists objects whose key starts with `prefix`, one page at a time.
    async fn list_page(
        &self,
        prefix: &str,
        page_token: Option<String>,
    ) -> Result<ListPage, StoreError>;

    /// Deletes an object unconditionally. Missing objects give `NotFound`.
    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError>;

    /// Streams a large object in. Blob names are write-once by convention (fresh
    /// names), so there is no precondition; memory stays flat in the blob's size.
    /// The generation returned is one landing of these bytes: an upload sent
    /// twice (retried, or hedged on a slow tail) may land again, leaving the
    /// same bytes at a later generation, so callers record a blob's size and
    /// digest, never its generation.
    async fn upload_blob(
        &self,
        key: &ObjectKey,
        source: BlobSource,
    ) -> Result<ObjectInfo, StoreError>;

    /// Streams a large object out.
    async fn download_blob(&self, key: &ObjectKey) -> Result<BlobReader, StoreError>;

    /// Like [`Self::upload_blob`] of a file the caller gives up: a store on
    /// the same filesystem moves it into place instead of copying it (a
    /// 200 MB checkpoint image is then never copied). The file is gone on
    /// success and may be gone on failure.
    async fn adopt_blob(&self, key: &ObjectKey, path: PathBuf) -> Result<ObjectInfo, StoreError> {
        self.upload_blob(key, BlobSource::File(path)).await
    }

    /// Copies a stored blob to a fresh key (a fork's own checkpoint image).
    /// Remote stores copy server-side (one request, no bytes through this
    /// host); a directory store links the file. The default streams it
    /// through this host, memory flat in its size. Missing source: `NotFound`.
    async fn copy_blob(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectInfo, StoreError> {
        let reader = self.download_blob(from).await?;
        self.upload_blob(to, BlobSource::Reader(reader)).await
    }

    /// Where a stored blob can be read directly on this host (a directory
    /// store), so a reader can use it in place instead of downloading a copy.
    /// `None` for remote stores.
    fn local_path(&self, _key: &ObjectKey) -> Option<PathBuf> {
        None
    }

    /// A directory on the store's own filesystem where a file meant for
    /// [`Store::adopt_blob`] can be written, so that adopting it is a rename
    /// and its writer's flushes are the store's (a directory store). `None`
    /// for remote stores.
    fn staging_dir(&self) -> Option<PathBuf> {
        None
    }

    /// Lists every object under `prefix`, following the pages.
    async fn list_all(&self, prefix: &str) -> Result<Vec<ObjectInfo>, StoreError> {
        let mut objects = Vec::new();
        let mut page_token = None;
        loop {
            let page = self.list_page(prefix, page_token).await?;
            objects.extend(page.objects);
            match page.next_page_token {
                Some(token) => page_token = Some(token),
                None => return Ok(objects),
            }
        }
    }
}

/// The largest page a listing returns, as GCS does by default.
pub const LIST_PAGE_SIZE: usize = 1000;

/// Checks a listing prefix: empty, or key characters with `/` separators whose
/// segments (all but a trailing partial one) would be valid in a key.
pub fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix.is_empty() {
        return Ok(());
    }
    // A prefix is valid if completing it with one character gives a valid key.
    ObjectKey::new(format!("{prefix}x"))
        .map(|_| ())
        .map_err(|err| {
            StoreError::InvalidKey(InvalidKey {
                key: prefix.to_owned(),
                reason: err.reason,
            })
        })
}
