//! What one owner may keep in filesystem snapshots: at most
//! `--max-snapshots-per-owner` names and `--max-snapshot-mb-per-owner` of
//! objects (archives, superseded ones until `sandboxctl gc` removes them,
//! and manifests) under its scope. A snapshot under a new name past the
//! count, or any snapshot once the owner's bytes reach the cap, is refused
//! with a message naming the setting; overwriting a name it has is always
//! allowed by the count. Shared snapshots (`SANDBOXD_SHARED_SNAPSHOTS`,
//! one team) have no owner and no quota.

use controllers::layout::SNAPSHOTS_PREFIX;
use controllers::store::{Store, StoreError};

/// Default of [`SnapshotQuota::max_count`].
pub const DEFAULT_MAX_SNAPSHOTS_PER_OWNER: u64 = 100;
/// Default of [`SnapshotQuota::max_bytes`]: 10 GiB.
pub const DEFAULT_MAX_SNAPSHOT_BYTES_PER_OWNER: u64 = 10 << 30;

/// One owner's snapshot quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotQuota {
    pub max_count: u64,
    pub max_bytes: u64,
}

impl Default for SnapshotQuota {
    fn default() -> Self {
        Self {
            max_count: DEFAULT_MAX_SNAPSHOTS_PER_OWNER,
            max_bytes: DEFAULT_MAX_SNAPSHOT_BYTES_PER_OWNER,
        }
    }
}

/// Why a snapshot was refused.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "the owner already keeps {count} filesystem snapshots, the most allowed \
         (--max-snapshots-per-owner {max}); overwrite one of them instead"
    )]
    Count { count: u64, max: u64 },
    #[error(
        "the owner's filesystem snapshots take {bytes} bytes, the most allowed is {max} \
         (--max-snapshot-mb-per-owner); overwrite one of them, or let `sandboxctl gc` remove old ones"
    )]
    Bytes { bytes: u64, max: u64 },
    #[error("cannot read the owner's snapshots: {0}")]
    Store(#[from] StoreError),
}

impl SnapshotQuota {
    /// Checks that the owner of snapshot `path` (`owner.<scope>/<name>`)
    /// may take it; a path without an owner passes.
    pub async fn check(&self, store: &dyn Store, path: &str) -> Result<(), QuotaError> {
        let Some((owner, name)) = path.split_once('/') else {
            return Ok(());
        };
        let prefix = format!("{SNAPSHOTS_PREFIX}{owner}/");
        let objects = store.list_all(&prefix).await?;
        let mut names = std::collections::BTreeSet::new();
        let mut bytes: u64 = 0;
        for object in &objects {
            bytes = bytes.saturating_add(object.size);
            if let Some(held) = object
                .key
                .as_str()
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix("/manifest.json"))
            {
                names.insert(held.to_owned());
            }
        }
        let count = names.len() as u64;
        if !names.contains(name) && count >= self.max_count {
            return Err(QuotaError::Count {
                count,
                max: self.max_count,
            });
        }
        if bytes >= self.max_bytes {
            return Err(QuotaError::Bytes {
                bytes,
                max: self.max_bytes,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use controllers::store::{ObjectKey, PutMode};
    use controllers::testing::MemoryStore;

    use super::*;

    async fn put(store: &MemoryStore, key: &str, bytes: usize) {
        store
            .put(
                &ObjectKey::new(key).unwrap(),
                vec![0u8; bytes].into(),
                PutMode::Overwrite,
            )
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn an_owner_keeps_at_most_its_count_and_bytes() {
        let store = Arc::new(MemoryStore::new());
        let quota = SnapshotQuota {
            max_count: 2,
            max_bytes: 1000,
        };
        for name in ["a", "b"] {
            put(
                &store,
                &format!("filesystem_snapshots/owner.x/{name}/manifest.json"),
                10,
            )
            .await;
            put(
                &store,
                &format!("filesystem_snapshots/owner.x/{name}/1.tar.gz"),
                100,
            )
            .await;
        }
        let refused = quota.check(store.as_ref(), "owner.x/c").await.unwrap_err();
        assert!(
            refused.to_string().contains("--max-snapshots-per-owner 2"),
            "{refused}"
        );
        quota.check(store.as_ref(), "owner.x/a").await.unwrap();
        quota.check(store.as_ref(), "owner.y/c").await.unwrap();
        quota.check(store.as_ref(), "shared-name").await.unwrap();
        put(&store, "filesystem_snapshots/owner.x/a/2.tar.gz", 800).await;
        let refused = quota.check(store.as_ref(), "owner.x/a").await.unwrap_err();
        assert!(
            refused.to_string().contains("--max-snapshot-mb-per-owner"),
            "{refused}"
        );
    }
}
