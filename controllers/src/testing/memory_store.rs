//! An in-memory Store with GCS semantics, and faults on demand for simulations.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use tokio::io::AsyncReadExt;

use crate::store::{
    BlobReader, BlobSource, Generation, LIST_PAGE_SIZE, ListPage, ObjectInfo, ObjectKey, PutMode,
    Store, StoreError, Versioned, validate_prefix,
};

/// A fault to inject into the next operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No fault for this operation (to aim a later fault at a later operation).
    Pass,
    /// The operation fails with `Transient` and changes nothing.
    Transient,
    /// The write lands but the caller is told it failed with `Transient`
    /// (a lost response), as happens with real networks.
    LostResponse,
}

#[derive(Debug, Default)]
struct State {
    objects: BTreeMap<ObjectKey, Versioned>,
    next_generation: i64,
    faults: VecDeque<Fault>,
    operations: u64,
}

/// Objects in a map, generations from a counter.
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues faults for the next operations, in order.
    pub fn inject(&self, faults: impl IntoIterator<Item = Fault>) {
        self.lock().faults.extend(faults);
    }

    /// Removes and returns the faults not yet used.
    pub fn take_faults(&self) -> Vec<Fault> {
        self.lock().faults.drain(..).collect()
    }

    /// How many operations were attempted so far.
    pub fn operations(&self) -> u64 {
        self.lock().operations
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, key: &ObjectKey, data: Bytes, mode: PutMode) -> Result<Generation, StoreError> {
        let mut state = self.lock();
        state.operations += 1;
        let fault = state.faults.pop_front();
        if fault == Some(Fault::Transient) {
            return Err(StoreError::transient(key, "injected fault"));
        }
        let current = state.objects.get(key).map(|object| object.generation);
        mode.check(key, current)?;
        state.next_generation += 1;
        let generation = Generation(state.next_generation);
        state
            .objects
            .insert(key.clone(), Versioned { data, generation });
        match fault {
            Some(Fault::LostResponse) => Err(StoreError::transient(key, "injected lost response")),
            _ => Ok(generation),
        }
    }

    fn read_op(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        let mut state = self.lock();
        state.operations += 1;
        if state
            .faults
            .pop_front()
            .is_some_and(|fault| fault != Fault::Pass)
        {
            return Err(StoreError::transient(key, "injected fault"));
        }
        state
            .objects
            .get(key)
            .cloned()
            .ok_or_else(|| StoreError::not_found(key))
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn get(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        self.read_op(key)
    }

    async fn put(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        self.write(key, data, mode)
    }

    async fn list_page(
        &self,
        prefix: &str,
        page_token: Option<String>,
    ) -> Result<ListPage, StoreError> {
        validate_prefix(prefix)?;
        let mut state = self.lock();
        state.operations += 1;
        if state
            .faults
            .pop_front()
            .is_some_and(|fault| fault != Fault::Pass)
        {
            return Err(StoreError::transient(prefix, "injected fault"));
        }
        let objects: Vec<ObjectInfo> = state
            .objects
            .iter()
            .filter(|(key, _)| key.as_str().starts_with(prefix))
            .filter(|(key, _)| {
                page_token
                    .as_deref()
                    .is_none_or(|after| key.as_str() > after)
            })
            .take(LIST_PAGE_SIZE + 1)
            .map(|(key, object)| ObjectInfo {
                key: key.clone(),
                size: object.data.len() as u64,
                generation: object.generation,
            })
            .collect();
        Ok(ListPage::from_sorted(objects))
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let mut state = self.lock();
        state.operations += 1;
        if state
            .faults
            .pop_front()
            .is_some_and(|fault| fault != Fault::Pass)
        {
            return Err(StoreError::transient(key, "injected fault"));
        }
        state
            .objects
            .remove(key)
            .map(|_| ())
            .ok_or_else(|| StoreError::not_found(key))
    }

    async fn upload_blob(
        &self,
        key: &ObjectKey,
        source: BlobSource,
    ) -> Result<ObjectInfo, StoreError> {
        let mut buffer = BytesMut::new();
        let io_error = |err: std::io::Error| StoreError::other(key, err);
        match source {
            BlobSource::File(path) => {
                let data = tokio::fs::read(&path).await.map_err(io_error)?;
                buffer.extend_from_slice(&data);
            }
            BlobSource::Reader(mut reader) => {
                let mut data = Vec::new();
                reader.read_to_end(&mut data).await.map_err(io_error)?;
                buffer.extend_from_slice(&data);
            }
        }
        let data = buffer.freeze();
        let size = data.len() as u64;
        let generation = self.write(key, data, PutMode::Overwrite)?;
        Ok(ObjectInfo {
            key: key.clone(),
            size,
            generation,
        })
    }

    async fn download_blob(&self, key: &ObjectKey) -> Result<BlobReader, StoreError> {
        let object = self.read_op(key)?;
        Ok(Box::pin(std::io::Cursor::new(object.data)))
    }
}
