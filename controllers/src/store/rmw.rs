//! The one read-modify-write loop over a [`Store`]: read the object with its
//! generation, let a pure `decide` say what to write, write it under that
//! generation (or only if absent), and on a lost race read again, at most
//! [`MAX_CONFLICT_RETRIES`] times.
//!
//! Every compare-and-swap writer goes through it: the lease operations, the
//! fenced status writes, spec intents and doorbell rings. `decide` must be
//! idempotent (set fields, do not increment them): after a lost response the
//! store may report a precondition failure for this loop's own write, and the
//! retry then decides again on a document that already has it.

use bytes::Bytes;

use super::{Generation, ObjectKey, PutMode, Store, StoreError, Versioned};

/// How many times a write is retried after losing a compare-and-swap race.
pub const MAX_CONFLICT_RETRIES: usize = 8;

/// What `decide` wants done with the object it was shown.
#[derive(Debug)]
pub enum Decision<T> {
    /// Write these bytes (under the generation read, or only if absent),
    /// then return `T`.
    Write(Bytes, T),
    /// Write nothing; return `T`.
    Keep(T),
}

/// Why a read-modify-write did not complete.
#[derive(Debug, thiserror::Error)]
pub enum RmwError<E> {
    #[error(transparent)]
    Store(StoreError),
    /// `decide` refused.
    #[error("{0}")]
    Rejected(E),
    #[error("{key} kept changing under {attempts} attempts to update it")]
    Contended { key: String, attempts: usize },
}

/// Runs the loop on `key`. `decide` sees the current object (`None`: absent)
/// and returns what to do. Returns what `decide` returned with the
/// generation now stored (`None` if the object is absent and nothing was
/// written).
pub async fn read_modify_write<T, E>(
    store: &dyn Store,
    key: &ObjectKey,
    decide: impl FnMut(Option<&Versioned>) -> Result<Decision<T>, E>,
) -> Result<(T, Option<Generation>), RmwError<E>> {
    read_modify_write_from(store, key, None, decide).await
}

/// [`read_modify_write`] starting from an object the caller read moments
/// ago (`known`, with its generation) instead of reading it again: one round
/// trip less when nobody wrote in between, and exactly the same outcome when
/// somebody did (the write's precondition fails and the loop reads afresh).
pub async fn read_modify_write_from<T, E>(
    store: &dyn Store,
    key: &ObjectKey,
    mut known: Option<Versioned>,
    mut decide: impl FnMut(Option<&Versioned>) -> Result<Decision<T>, E>,
) -> Result<(T, Option<Generation>), RmwError<E>> {
    for _ in 0..MAX_CONFLICT_RETRIES {
        let current = match known.take() {
            Some(known) => Some(known),
            None => match store.get(key).await {
                Ok(current) => Some(current),
                Err(StoreError::NotFound { .. }) => None,
                Err(err) => return Err(RmwError::Store(err)),
            },
        };
        let read = current.as_ref().map(|c| c.generation);
        match decide(current.as_ref()).map_err(RmwError::Rejected)? {
            Decision::Keep(value) => return Ok((value, read)),
            Decision::Write(data, value) => {
                let mode = read.map_or(PutMode::Create, PutMode::Update);
                match store.put(key, data, mode).await {
                    Ok(generation) => return Ok((value, Some(generation))),
                    Err(StoreError::PreconditionFailed { .. }) => continue,
                    Err(err) => return Err(RmwError::Store(err)),
                }
            }
        }
    }
    Err(RmwError::Contended {
        key: key.to_string(),
        attempts: MAX_CONFLICT_RETRIES,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::testing::MemoryStore;

    fn key() -> ObjectKey {
        ObjectKey::new("sandboxes/x/counter.json").unwrap()
    }

    /// Adds one to a decimal counter, creating it at 1.
    async fn increment(store: &dyn Store) -> Result<u64, RmwError<String>> {
        read_modify_write(store, &key(), |current| {
            let next = match current {
                None => 1,
                Some(object) => {
                    let text = std::str::from_utf8(&object.data).map_err(|e| e.to_string())?;
                    text.parse::<u64>().map_err(|e| e.to_string())? + 1
                }
            };
            Ok(Decision::Write(Bytes::from(next.to_string()), next))
        })
        .await
        .map(|(value, _)| value)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_lose_no_update() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let mut done = 0;
                    while done < 25 {
                        match increment(store.as_ref()).await {
                            Ok(_) => done += 1,
                            Err(RmwError::Contended { .. }) => {}
                            Err(err) => panic!("{err}"),
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let stored = store.get(&key()).await.unwrap();
        assert_eq!(stored.data.as_ref(), b"100");
    }

    #[tokio::test]
    async fn keep_writes_nothing_and_rejected_is_passed_through() {
        let store = MemoryStore::new();
        let (value, generation) = read_modify_write(&store, &key(), |current| {
            assert!(current.is_none());
            Ok::<_, String>(Decision::Keep(7))
        })
        .await
        .unwrap();
        assert_eq!((value, generation), (7, None));
        assert!(store.get(&key()).await.is_err(), "Keep wrote nothing");
        store
            .put(&key(), Bytes::from_static(b"not a number"), PutMode::Create)
            .await
            .unwrap();
        match increment(&store).await {
            Err(RmwError::Rejected(message)) => assert!(message.contains("invalid digit")),
            other => panic!("expected the refusal, got {other:?}"),
        }
        assert_eq!(
            store.get(&key()).await.unwrap().data.as_ref(),
            b"not a number",
            "a refused decision leaves the object as it was"
        );
    }
}
