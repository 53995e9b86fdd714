//! Workspaces lose nothing acknowledged (docs/security.md): a sync up that
//! committed a state no longer naming a content re-reads the stored state
//! before deleting it, so a second writer that committed meanwhile (having
//! uploaded that same content for a file of its own) keeps its file. The
//! writers race at a chosen moment: the store runs writer B's whole sync
//! right after writer A's commit lands, before A deletes anything. No
//! sandbox needed: the sandboxes' files are an in-memory `WorkspaceFiles`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;
use controllers::api::SandboxId;
use controllers::layout::{workspace_blob_key, workspace_state_key};
use controllers::store::{
    BlobReader, BlobSource, Generation, ListPage, ObjectInfo, ObjectKey, PutMode, Store,
    StoreError, Versioned,
};
use futures::future::BoxFuture;
use sandboxd::store::LocalStore;
use sandboxd::workspace::files::{Copied, FilesError, LocalScan, ScanRequest};
use sandboxd::workspace::state::{FileEntry, StateFile};
use sandboxd::workspace::{SyncLimits, WorkspaceFiles, WorkspaceSync};

const WORKSPACE: &str = "shared";

fn md5_hex(data: &[u8]) -> String {
    format!("{:x}", md5::compute(data))
}

/// One sandbox's `/workspace` files and its `.sandbox-state`.
type Tree = (BTreeMap<String, Vec<u8>>, Option<String>);

/// Each sandbox's tree, in memory.
#[derive(Debug, Default)]
struct Trees(Mutex<HashMap<SandboxId, Tree>>);

impl Trees {
    fn set(&self, sandbox: &SandboxId, path: &str, data: Option<&[u8]>) {
        let mut trees = self.0.lock().unwrap();
        let (files, _) = trees.entry(sandbox.clone()).or_default();
        match data {
            Some(data) => files.insert(path.to_owned(), data.to_vec()),
            None => files.remove(path),
        };
    }
}

#[async_trait]
impl WorkspaceFiles for Trees {
    async fn scan(&self, sandbox: &SandboxId, _: ScanRequest) -> Result<LocalScan, FilesError> {
        let trees = self.0.lock().unwrap();
        let (files, state) = trees.get(sandbox).cloned().unwrap_or_default();
        let synced = state
            .map(|s| StateFile::parse(s.as_bytes(), u64::MAX).unwrap().files)
            .unwrap_or_default();
        let files: Vec<FileEntry> = files
            .iter()
            .map(|(path, data)| FileEntry {
                path: path.clone(),
                checksum: md5_hex(data),
                size: data.len() as u64,
                modified_at: 0,
            })
            .collect();
        Ok(LocalScan {
            hashed: files.len() as u64,
            files,
            synced,
            ..LocalScan::default()
        })
    }

    async fn read_file(
        &self,
        sandbox: &SandboxId,
        path: &str,
        _max_bytes: u64,
        dest: &Path,
    ) -> Result<Copied, FilesError> {
        let data = self.0.lock().unwrap()[sandbox].0[path].clone();
        std::fs::write(dest, &data).unwrap();
        Ok(Copied {
            checksum: md5_hex(&data),
            size: data.len() as u64,
        })
    }

    async fn write_file(
        &self,
        _: &SandboxId,
        _: &FileEntry,
        _: BlobReader,
    ) -> Result<(), FilesError> {
        Err(FilesError::Refused("this test syncs up only".into()))
    }

    async fn delete_files(&self, _: &SandboxId, _: &[String]) -> Result<u64, FilesError> {
        Err(FilesError::Refused("this test syncs up only".into()))
    }

    async fn write_state(&self, sandbox: &SandboxId, content: String) -> Result<(), FilesError> {
        self.0.lock().unwrap().entry(sandbox.clone()).or_default().1 = Some(content);
        Ok(())
    }
}

type Race = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

/// A store that runs `race` right after the next successful write of the
/// workspace's state, before that write returns.
#[derive(Default)]
struct RacingStore {
    inner: Option<Arc<dyn Store>>,
    race: Mutex<Option<Race>>,
}

impl std::fmt::Debug for RacingStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RacingStore")
    }
}

impl RacingStore {
    fn inner(&self) -> &dyn Store {
        self.inner.as_deref().unwrap()
    }
}

#[async_trait]
impl Store for RacingStore {
    async fn get(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        self.inner().get(key).await
    }
    async fn put(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        let written = self.inner().put(key, data, mode).await?;
        if Some(key) == workspace_state_key(WORKSPACE).as_ref() {
            let race = self.race.lock().unwrap().take();
            if let Some(race) = race {
                race().await;
            }
        }
        Ok(written)
    }
    async fn list_page(&self, prefix: &str, token: Option<String>) -> Result<ListPage, StoreError> {
        self.inner().list_page(prefix, token).await
    }
    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        self.inner().delete(key).await
    }
    async fn upload_blob(
        &self,
        key: &ObjectKey,
        source: BlobSource,
    ) -> Result<ObjectInfo, StoreError> {
        self.inner().upload_blob(key, source).await
    }
    async fn download_blob(&self, key: &ObjectKey) -> Result<BlobReader, StoreError> {
        self.inner().download_blob(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writers_upload_survives_the_first_writers_release() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(RacingStore {
        inner: Some(Arc::new(
            LocalStore::open(dir.path().join("store")).unwrap(),
        )),
        race: Mutex::new(None),
    });
    let trees = Arc::new(Trees::default());
    let sync = Arc::new(WorkspaceSync::new(
        Arc::clone(&store) as Arc<dyn Store>,
        Arc::clone(&trees) as Arc<dyn WorkspaceFiles>,
        SyncLimits::default(),
        PathBuf::from(dir.path()),
        Arc::default(),
        Arc::new(controllers::clock::SystemClock),
    ));
    let (a, b) = (SandboxId::random(), SandboxId::random());
    let shared = b"the same bytes in two sandboxes";
    let checksum = md5_hex(shared);

    // A stores `f`, then deletes it: its next sync no longer names the content.
    trees.set(&a, "keep", Some(b"kept"));
    trees.set(&a, "f", Some(shared));
    sync.sync_up(&a, WORKSPACE, None).await.unwrap();
    trees.set(&a, "f", None);

    // Right after A's commit, B stores its `g`, with the same bytes.
    trees.set(&b, "g", Some(shared));
    let racer = Arc::clone(&sync);
    let b_id = b.clone();
    let done = Arc::new(OnceLock::new());
    let b_done = Arc::clone(&done);
    *store.race.lock().unwrap() = Some(Box::new(move || {
        Box::pin(async move {
            let (state, _) = racer.sync_up(&b_id, WORKSPACE, None).await.unwrap();
            b_done.set(state.state).unwrap();
        })
    }));
    sync.sync_up(&a, WORKSPACE, None).await.unwrap();

    let b_committed = done
        .get()
        .expect("B's sync ran between A's commit and release");
    assert!(
        b_committed.files.iter().any(|f| f.path == "g"),
        "{b_committed:?}"
    );
    let stored = StateFile::parse(
        &store
            .get(&workspace_state_key(WORKSPACE).unwrap())
            .await
            .unwrap()
            .data,
        u64::MAX,
    )
    .unwrap();
    let paths: Vec<&str> = stored.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["g", "keep"]);
    assert!(
        store
            .get(&workspace_blob_key(WORKSPACE, &checksum).unwrap())
            .await
            .is_ok(),
        "A's release deleted the content B's committed state names: B's file is lost"
    );
    assert_eq!(
        sandboxd::workspace::WorkspaceMetrics::get(&sync.metrics().releases_kept),
        1
    );
}
