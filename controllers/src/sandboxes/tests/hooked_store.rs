//! The memory store with a hook before every request, to slow, pause, fail or
//! race one of the reconciler's. The hook sees the request and the store (to
//! change the bucket first, as another instance would); an error is the answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use async_trait::async_trait;
use bytes::Bytes;

use crate::api::{ApiObject, SandboxId, decode, encode};
use crate::store::{
    BlobReader, BlobSource, Generation, ListPage, ObjectInfo, ObjectKey, Operation, PutMode, Store,
    StoreError, Versioned,
};
use crate::testing::MemoryStore;

/// A request about to reach the memory store: its operation and object (a listing names none).
#[derive(Debug, Clone, Copy)]
pub(in crate::sandboxes) struct Request<'a> {
    pub(super) operation: Operation,
    pub(super) key: Option<&'a ObjectKey>,
}

impl Request<'_> {
    fn names(&self, suffix: &str) -> bool {
        self.key.is_some_and(|key| key.as_str().ends_with(suffix))
    }

    /// A read of the object whose key ends with `suffix`.
    pub(super) fn reads(&self, suffix: &str) -> bool {
        self.operation == Operation::Get && self.names(suffix)
    }

    /// A write (of a document) of the object whose key ends with `suffix`.
    pub(super) fn writes(&self, suffix: &str) -> bool {
        self.operation == Operation::Put && self.names(suffix)
    }
}

#[async_trait]
pub(in crate::sandboxes) trait BeforeRequest:
    Send + Sync + std::fmt::Debug
{
    async fn before(&self, request: Request<'_>, store: &MemoryStore) -> Result<(), StoreError>;
}

/// [`MemoryStore`] behind a [`BeforeRequest`] hook.
#[derive(Debug)]
pub(in crate::sandboxes) struct HookedStore<H> {
    pub(in crate::sandboxes) store: Arc<MemoryStore>,
    pub(in crate::sandboxes) hook: H,
}

impl<H> HookedStore<H> {
    pub(in crate::sandboxes) fn new(store: Arc<MemoryStore>, hook: H) -> Self {
        Self { store, hook }
    }
}

/// Each [`Store`] method of [`HookedStore`] asks the hook, then the store.
macro_rules! hooked {
    ($($method:ident($($arg:ident: $type:ty),*) -> $answer:ty => $kind:ident, $key:expr;)*) => {
        #[async_trait]
        impl<H: BeforeRequest> Store for HookedStore<H> {
            $(async fn $method(&self, $($arg: $type),*) -> Result<$answer, StoreError> {
                let request = Request { operation: Operation::$kind, key: $key };
                self.hook.before(request, &self.store).await?;
                self.store.$method($($arg),*).await
            })*
        }
    };
}

hooked! {
    get(key: &ObjectKey) -> Versioned => Get, Some(key);
    put(key: &ObjectKey, data: Bytes, mode: PutMode) -> Generation => Put, Some(key);
    list_page(prefix: &str, page_token: Option<String>) -> ListPage => List, None;
    delete(key: &ObjectKey) -> () => Delete, Some(key);
    upload_blob(key: &ObjectKey, source: BlobSource) -> ObjectInfo => Upload, Some(key);
    download_blob(key: &ObjectKey) -> BlobReader => Download, Some(key);
}

/// Counts the requests `counts` picks, and lets every one through.
#[derive(Debug)]
pub(super) struct Counted {
    counts: fn(&Request<'_>) -> bool,
    seen: AtomicUsize,
}

impl Counted {
    pub(super) fn seen(&self) -> usize {
        self.seen.load(SeqCst)
    }
}

#[async_trait]
impl BeforeRequest for Counted {
    async fn before(&self, request: Request<'_>, _store: &MemoryStore) -> Result<(), StoreError> {
        self.seen
            .fetch_add(usize::from((self.counts)(&request)), SeqCst);
        Ok(())
    }
}

/// A world whose instances' requests `counts` picks are counted.
pub(super) fn counted_world(
    counts: fn(&Request<'_>) -> bool,
) -> (super::World, Arc<HookedStore<Counted>>) {
    let seen = AtomicUsize::new(0);
    super::World::hooked(Counted { counts, seen })
}

/// Once armed with a sandbox, `edit`s its object (at `object`'s key) just
/// before the next write ending with `before`: another's write, mid-pass.
#[derive(Debug)]
pub(super) struct EditBeforeWrite<T> {
    pub(super) before: &'static str,
    pub(super) object: fn(&SandboxId) -> ObjectKey,
    pub(super) edit: fn(&mut T),
    pub(super) armed: std::sync::Mutex<Option<SandboxId>>,
}

impl<T> EditBeforeWrite<T> {
    /// Edits `id`'s object before the next write of `before`.
    pub(super) fn arm(&self, id: &SandboxId) {
        *self.armed.lock().unwrap() = Some(id.clone());
    }
}

#[async_trait]
impl<T: ApiObject + std::fmt::Debug + Send + Sync> BeforeRequest for EditBeforeWrite<T> {
    async fn before(&self, request: Request<'_>, store: &MemoryStore) -> Result<(), StoreError> {
        let armed = request
            .writes(self.before)
            .then(|| self.armed.lock().unwrap().take());
        if let Some(id) = armed.flatten() {
            let key = (self.object)(&id);
            let mut object: T = decode(&store.get(&key).await.unwrap().data).unwrap();
            (self.edit)(&mut object);
            let written = store.put(&key, encode(&object), PutMode::Overwrite).await;
            written.unwrap();
        }
        Ok(())
    }
}
