//! Fenced writes: a read-check-write that refuses to overwrite state recorded by
//! a newer lease holder.
//!
//! A lease alone cannot stop a holder that was paused (GC, a frozen VM) past its
//! expiry: it wakes up still believing it holds the sandbox. So every write a
//! holder makes to `metadata.json` goes through [`fenced_update_from`]: it reads the
//! object with its generation, refuses if the recorded epoch is higher than the
//! writer's, applies the change, stamps the writer's epoch, and writes with the
//! generation as precondition. A zombie can waste work but never roll state back.
//!
//! # Errors
//! Invalid JSON in the object (an operator's typo) is reported, never overwritten.

use std::fmt;

use crate::api::{ApiObject, DecodeError, SandboxMetadata, decode, encode};
use crate::store::{
    Decision, Generation, ObjectKey, RmwError, Store, StoreError, Versioned, read_modify_write_from,
};

/// An API object that records the epoch of its last writer.
pub trait Fenced: ApiObject {
    fn fence_epoch(&self) -> u64;
    fn set_fence_epoch(&mut self, epoch: u64);
}

impl Fenced for SandboxMetadata {
    fn fence_epoch(&self) -> u64 {
        self.status.epoch
    }
    fn set_fence_epoch(&mut self, epoch: u64) {
        self.status.epoch = epoch;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FenceError<E: fmt::Debug + fmt::Display> {
    /// A newer holder has written: the writer must stop acting on this sandbox.
    #[error("{key} was written at epoch {recorded}, newer than this writer's epoch {writer}")]
    Fenced {
        key: String,
        recorded: u64,
        writer: u64,
    },
    #[error("{key}: {source}")]
    Invalid { key: String, source: DecodeError },
    #[error("{key} kept changing under {attempts} attempts to update it")]
    Contended { key: String, attempts: usize },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The caller's change refused to apply.
    #[error("{0}")]
    Rejected(E),
}

/// Reads `key`, checks the fence, applies `change`, stamps `writer_epoch` and
/// writes it back under the read generation. Retries on a lost race, re-checking
/// the fence each time. Returns the written object and its new generation.
///
/// `known` is the object as the caller read (or wrote) it moments ago, with
/// its generation, if it has it: the first try starts from it instead of a
/// read. The fence is checked on exactly that content, and a write in
/// between fails the precondition and sends the loop back to a fresh read,
/// so the guarantee is the same with one round trip less.
///
/// `change` must be idempotent (set fields, do not increment them): after a lost
/// response the store may report a precondition failure for this call's own
/// write, and the retry then applies `change` to a document that already has it.
pub async fn fenced_update_from<T, E, F>(
    store: &dyn Store,
    key: &ObjectKey,
    known: Option<Versioned>,
    writer_epoch: u64,
    mut change: F,
) -> Result<(T, Generation), FenceError<E>>
where
    T: Fenced,
    E: fmt::Debug + fmt::Display,
    F: FnMut(&mut T) -> Result<(), E>,
{
    let outcome = read_modify_write_from(store, key, known, |current| {
        let current = current.ok_or_else(|| FenceError::Store(StoreError::not_found(key)))?;
        let mut object: T = decode(&current.data).map_err(|source| FenceError::Invalid {
            key: key.to_string(),
            source,
        })?;
        let recorded = object.fence_epoch();
        if recorded > writer_epoch {
            return Err(FenceError::Fenced {
                key: key.to_string(),
                recorded,
                writer: writer_epoch,
            });
        }
        change(&mut object).map_err(FenceError::Rejected)?;
        object.set_fence_epoch(writer_epoch);
        Ok(Decision::Write(encode(&object), object))
    })
    .await;
    match outcome {
        Ok((object, Some(generation))) => Ok((object, generation)),
        Ok((_, None)) => Err(FenceError::Store(StoreError::not_found(key))),
        Err(RmwError::Rejected(err)) => Err(err),
        Err(RmwError::Store(err)) => Err(FenceError::Store(err)),
        Err(RmwError::Contended { key, attempts }) => Err(FenceError::Contended { key, attempts }),
    }
}
