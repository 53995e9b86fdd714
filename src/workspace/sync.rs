//! One sync of one sandbox's workspace against the store.
//!
//! Objects under `workspaces/<path>/` (the path is `owner.<scope>/<name>`,
//! see [`super::owner`], or an earlier workspace's `<name>`): `files/<md5>` holds each distinct content
//! once (write-once: a name is its checksum), `sandbox-state` names the files.
//! A sync up uploads missing contents first, then commits the new state with
//! a conditional write, then deletes contents nothing references any more; a
//! sync down reads the state and fetches only what the sandbox lacks. Any
//! interruption leaves the last committed state whole and every content it
//! names present; the worst left behind is an unreferenced object, which the
//! next sync up of that content reuses.
//!
//! Two sandboxes writing one workspace at once do not corrupt it (the state
//! write is a compare-and-swap; the loser re-plans against the winner's state),
//! but the last writer decides each file: a workspace is meant for one
//! sandbox at a time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use controllers::api::SandboxId;
use controllers::clock::Clock;
use controllers::layout::{workspace_blob_key, workspace_owner_key, workspace_state_key};
use controllers::store::{BlobSource, Generation, PutMode, Store, StoreError};

use super::files::{FilesError, LocalScan, ScanRequest, WorkspaceFiles};
use super::metrics::WorkspaceMetrics;
use super::spool::{SPOOL_PREFIX, SpoolFile, sweep_spool};
use super::state::{FileEntry, StateError, StateFile, plan_down, plan_up};

/// Bounds on what a sync moves and how long it may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncLimits {
    pub max_file_bytes: u64,
    pub max_total_bytes: u64,
    /// Most files a workspace may hold (bounds a scan's reply).
    pub max_files: u64,
    /// One whole sync (down or up).
    pub timeout: Duration,
    /// `SANDBOX_SYNC_STALE_THRESHOLD`: checksums a sandbox's state file recorded
    /// more than this long ago are recomputed instead of trusted.
    pub stale_threshold_s: u64,
}

impl Default for SyncLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: 100 << 20,
            max_total_bytes: 1 << 30,
            max_files: 100_000,
            timeout: Duration::from_secs(120),
            stale_threshold_s: 3600,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("invalid workspace name {0:?}")]
    InvalidName(String),
    #[error("the workspace state in the store is invalid ({key}): {source}; nothing was changed")]
    InvalidState {
        key: String,
        #[source]
        source: StateError,
    },
    #[error(
        "the workspace state names {path:?}, whose content {checksum} is missing from the store"
    )]
    MissingContent { path: String, checksum: String },
    #[error("workspace storage: {0}")]
    Store(#[from] StoreError),
    #[error("workspace files: {0}")]
    Files(#[from] FilesError),
    #[error("the workspace sync did not finish within {0:?}")]
    Timeout(Duration),
    #[error("the workspace state kept changing under this sync (another sandbox writes it)")]
    Contended,
}

/// The store's state as this host last saw it, with its generation (`None`:
/// no state stored yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteState {
    pub state: StateFile,
    pub generation: Option<Generation>,
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub uploaded: u64,
    pub downloaded: u64,
    pub deleted: u64,
    pub unchanged: u64,
    pub refused: u64,
}

/// Syncs workspaces between sandboxes and the store.
#[derive(Debug)]
pub struct WorkspaceSync {
    store: Arc<dyn Store>,
    files: Arc<dyn WorkspaceFiles>,
    limits: SyncLimits,
    /// Host directory for contents in transit.
    spool_dir: PathBuf,
    metrics: Arc<WorkspaceMetrics>,
    /// The instance's clock: the timestamps of states and owners.
    clock: Arc<dyn Clock>,
}

/// Attempts at committing a state against concurrent writers.
const COMMIT_ATTEMPTS: usize = 4;

impl WorkspaceSync {
    pub fn new(
        store: Arc<dyn Store>,
        files: Arc<dyn WorkspaceFiles>,
        limits: SyncLimits,
        spool_dir: PathBuf,
        metrics: Arc<WorkspaceMetrics>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        sweep_spool(&spool_dir);
        Self {
            store,
            files,
            limits,
            spool_dir,
            metrics,
            clock,
        }
    }

    pub fn metrics(&self) -> &Arc<WorkspaceMetrics> {
        &self.metrics
    }

    /// Now, in seconds since the epoch (a state's `last_synced_at`).
    fn now(&self) -> i64 {
        self.clock.now().timestamp()
    }

    fn scan_request(&self) -> ScanRequest {
        ScanRequest {
            max_file_bytes: self.limits.max_file_bytes,
            max_total_bytes: self.limits.max_total_bytes,
            max_files: self.limits.max_files,
            stale_threshold_s: self.limits.stale_threshold_s,
        }
    }

    /// The path (`spec.workspace.id`) of workspace `name` as `token` opens
    /// it: the token's own scope (`super::owner`), or the earlier unscoped
    /// `workspaces/<name>/` when its `owner.json` records this token. Never
    /// refuses a token: one that does not own the earlier workspace gets a
    /// workspace of its own, so a create learns nothing of other owners.
    pub async fn resolve(&self, name: &str, token: &str) -> Result<String, SyncError> {
        let key =
            workspace_owner_key(name).ok_or_else(|| SyncError::InvalidName(name.to_owned()))?;
        match self.store.get(&key).await {
            Ok(object) => {
                let owner: serde_json::Value =
                    serde_json::from_slice(&object.data).unwrap_or_default();
                match owner["token_sha256"].as_str() {
                    Some(expected) if crate::token::matches(token, expected) => {
                        return Ok(name.to_owned());
                    }
                    Some(_) => {}
                    None => tracing::warn!(%key, "invalid workspace owner record ignored"),
                }
            }
            Err(StoreError::NotFound { .. }) => {}
            Err(err) => return Err(err.into()),
        }
        Ok(super::owner::owned_path(token, name))
    }

    /// Reads the store's state (one GET).
    pub async fn read_remote(&self, workspace: &str) -> Result<RemoteState, SyncError> {
        let key = workspace_state_key(workspace)
            .ok_or_else(|| SyncError::InvalidName(workspace.to_owned()))?;
        match self.store.get(&key).await {
            Ok(object) => {
                let state = StateFile::parse(&object.data, self.limits.max_file_bytes).map_err(
                    |source| SyncError::InvalidState {
                        key: key.to_string(),
                        source,
                    },
                )?;
                Ok(RemoteState {
                    state,
                    generation: Some(object.generation),
                })
            }
            Err(StoreError::NotFound { .. }) => Ok(RemoteState {
                state: StateFile::empty(),
                generation: None,
            }),
            Err(err) => Err(err.into()),
        }
    }

    async fn scan(&self, sandbox: &SandboxId) -> Result<(StateFile, LocalScan), SyncError> {
        let scan = self.files.scan(sandbox, self.scan_request()).await?;
        WorkspaceMetrics::add(&self.metrics.files_hashed, scan.hashed);
        for refused in &scan.refused {
            tracing::warn!(%sandbox, path = %refused.path, reason = %refused.reason, "workspace file not synced");
        }
        WorkspaceMetrics::add(&self.metrics.files_refused, scan.refused.len() as u64);
        Ok((StateFile::new(self.now(), scan.files.clone()), scan))
    }

    /// Brings the store's files into the sandbox (cold start).
    #[tracing::instrument(skip(self), fields(%sandbox, workspace))]
    pub async fn sync_down(
        &self,
        sandbox: &SandboxId,
        workspace: &str,
    ) -> Result<(RemoteState, SyncReport), SyncError> {
        let limit = self.limits.timeout;
        tokio::time::timeout(limit, self.sync_down_inner(sandbox, workspace))
            .await
            .map_err(|_| SyncError::Timeout(limit))?
    }

    async fn sync_down_inner(
        &self,
        sandbox: &SandboxId,
        workspace: &str,
    ) -> Result<(RemoteState, SyncReport), SyncError> {
        let mut remote = self.read_remote(workspace).await?;
        let (actual, scan) = self.scan(sandbox).await?;
        let plan = plan_down(&remote.state, &scan.synced, &actual);
        let mut report = SyncReport {
            unchanged: plan.unchanged as u64,
            refused: scan.refused.len() as u64,
            ..SyncReport::default()
        };
        // Deletions first: a path may turn from a file into a directory.
        if !plan.delete.is_empty() {
            report.deleted = self.files.delete_files(sandbox, &plan.delete).await?;
            WorkspaceMetrics::add(&self.metrics.files_deleted, report.deleted);
        }
        let mut missing = Vec::new();
        for entry in &plan.download {
            match self.download(sandbox, workspace, entry).await {
                Ok(()) => {
                    report.downloaded += 1;
                    WorkspaceMetrics::add(&self.metrics.files_downloaded, 1);
                    WorkspaceMetrics::add(&self.metrics.bytes_downloaded, entry.size);
                }
                Err(SyncError::MissingContent { path, checksum }) => {
                    tracing::warn!(%path, %checksum, "workspace content missing from the store; the file is skipped");
                    missing.push(path);
                }
                Err(err) => return Err(err),
            }
        }
        let mut local_after = plan.local_after;
        if !missing.is_empty() {
            WorkspaceMetrics::add(&self.metrics.missing_contents, missing.len() as u64);
            local_after.retain(|f| !missing.contains(&f.path));
            remote = self.repair(workspace, remote, &missing).await;
        }
        let local = StateFile::new(scan.scanned_at, local_after);
        self.files.write_state(sandbox, local.to_json()).await?;
        WorkspaceMetrics::add(&self.metrics.syncs_down, 1);
        tracing::info!(
            downloaded = report.downloaded,
            deleted = report.deleted,
            unchanged = report.unchanged,
            kept_local = plan.kept_local.len(),
            "workspace synced down"
        );
        Ok((remote, report))
    }

    /// Drops entries whose content is missing from the stored state, so a
    /// sandbox that still has those files uploads them again at its next sync
    /// (they are then new to the store). Best effort: a conflict leaves it to
    /// the next sync down.
    async fn repair(
        &self,
        workspace: &str,
        remote: RemoteState,
        missing: &[String],
    ) -> RemoteState {
        let Some(key) = workspace_state_key(workspace) else {
            return remote;
        };
        let Some(generation) = remote.generation else {
            return remote;
        };
        let files = remote
            .state
            .files
            .iter()
            .filter(|f| !missing.contains(&f.path))
            .cloned()
            .collect();
        let repaired = StateFile::new(remote.state.last_synced_at, files);
        match self
            .store
            .put(&key, repaired.to_json().into(), PutMode::Update(generation))
            .await
        {
            Ok(generation) => {
                tracing::warn!(
                    workspace,
                    ?missing,
                    "workspace state repaired: entries without content dropped"
                );
                RemoteState {
                    state: repaired,
                    generation: Some(generation),
                }
            }
            Err(err) => {
                tracing::warn!(workspace, %err, "cannot repair the workspace state");
                remote
            }
        }
    }

    async fn download(
        &self,
        sandbox: &SandboxId,
        workspace: &str,
        entry: &FileEntry,
    ) -> Result<(), SyncError> {
        let key = workspace_blob_key(workspace, &entry.checksum)
            .ok_or_else(|| SyncError::InvalidName(workspace.to_owned()))?;
        let reader = match self.store.download_blob(&key).await {
            Ok(reader) => reader,
            Err(StoreError::NotFound { .. }) => {
                return Err(SyncError::MissingContent {
                    path: entry.path.clone(),
                    checksum: entry.checksum.clone(),
                });
            }
            Err(err) => return Err(err.into()),
        };
        self.files.write_file(sandbox, entry, reader).await?;
        Ok(())
    }

    /// Sends the sandbox's changes to the store (after an execution, on
    /// terminate). `known` is the store's state as last seen here: when the
    /// sandbox's files match it, the sync makes no storage request at all.
    #[tracing::instrument(skip(self, known), fields(%sandbox, workspace))]
    pub async fn sync_up(
        &self,
        sandbox: &SandboxId,
        workspace: &str,
        known: Option<RemoteState>,
    ) -> Result<(RemoteState, SyncReport), SyncError> {
        let limit = self.limits.timeout;
        tokio::time::timeout(limit, self.sync_up_inner(sandbox, workspace, known))
            .await
            .map_err(|_| SyncError::Timeout(limit))?
    }

    async fn sync_up_inner(
        &self,
        sandbox: &SandboxId,
        workspace: &str,
        known: Option<RemoteState>,
    ) -> Result<(RemoteState, SyncReport), SyncError> {
        let state_key = workspace_state_key(workspace)
            .ok_or_else(|| SyncError::InvalidName(workspace.to_owned()))?;
        let (mut actual, scan) = self.scan(sandbox).await?;
        let mut remote = match known {
            Some(known) => known,
            None => self.read_remote(workspace).await?,
        };
        let mut report = SyncReport {
            refused: scan.refused.len() as u64,
            ..SyncReport::default()
        };
        let refused: std::collections::BTreeSet<String> =
            scan.refused.iter().map(|r| r.path.clone()).collect();
        for _ in 0..COMMIT_ATTEMPTS {
            let plan = plan_up(&actual, &remote.state, &scan.synced, &refused);
            report.unchanged = plan.unchanged as u64;
            if plan.is_noop() {
                WorkspaceMetrics::add(&self.metrics.syncs_unchanged, 1);
                return Ok((remote, report));
            }
            let mut stored: std::collections::BTreeSet<String> = remote
                .state
                .files
                .iter()
                .map(|f| f.checksum.clone())
                .collect();
            let mut next_files = plan.next.clone();
            for entry in &plan.upload {
                let uploaded = self.upload(sandbox, workspace, entry).await?;
                stored.insert(uploaded.checksum.clone());
                if uploaded.checksum != entry.checksum || uploaded.size != entry.size {
                    // Changed between the scan and the read: record what was sent.
                    for listed in actual.files.iter_mut().chain(next_files.iter_mut()) {
                        if listed.path == entry.path {
                            listed.checksum.clone_from(&uploaded.checksum);
                            listed.size = uploaded.size;
                        }
                    }
                }
                report.uploaded += 1;
            }
            if next_files.iter().any(|f| !stored.contains(&f.checksum)) {
                // A file changed between the scan and its upload, and another
                // path still names the old content: plan again.
                continue;
            }
            let next = StateFile::new(self.now(), next_files);
            let mode = match remote.generation {
                Some(generation) => PutMode::Update(generation),
                None => PutMode::Create,
            };
            match self
                .store
                .put(&state_key, next.to_json().into(), mode)
                .await
            {
                Ok(generation) => {
                    report.deleted = plan.removed.len() as u64;
                    let committed = RemoteState {
                        state: next,
                        generation: Some(generation),
                    };
                    self.release(workspace, &plan.unreferenced, &committed.state)
                        .await;
                    // The sandbox's own state records what it has, as of the scan.
                    let local = StateFile::new(scan.scanned_at, actual.files.clone());
                    self.files.write_state(sandbox, local.to_json()).await?;
                    WorkspaceMetrics::add(&self.metrics.syncs_up, 1);
                    tracing::info!(
                        uploaded = report.uploaded,
                        removed = report.deleted,
                        unchanged = report.unchanged,
                        "workspace synced up"
                    );
                    return Ok((committed, report));
                }
                Err(StoreError::PreconditionFailed { .. }) => {
                    // Someone else committed meanwhile: plan again on theirs.
                    remote = self.read_remote(workspace).await?;
                }
                Err(err) => return Err(err.into()),
            }
        }
        Err(SyncError::Contended)
    }

    /// Uploads one file's content under its checksum (the one of the bytes
    /// actually read, returned).
    async fn upload(
        &self,
        sandbox: &SandboxId,
        workspace: &str,
        entry: &FileEntry,
    ) -> Result<super::files::Copied, SyncError> {
        let spool = SpoolFile(
            self.spool_dir
                .join(format!("{SPOOL_PREFIX}{}", uuid::Uuid::new_v4().simple())),
        );
        let spool = &spool.0;
        async {
            let copied = self
                .files
                .read_file(sandbox, &entry.path, self.limits.max_file_bytes, spool)
                .await?;
            let key = workspace_blob_key(workspace, &copied.checksum).ok_or_else(|| {
                SyncError::Files(FilesError::Refused(format!(
                    "invalid checksum {:?} for {:?}",
                    copied.checksum, entry.path
                )))
            })?;
            self.store
                .upload_blob(&key, BlobSource::File(spool.to_path_buf()))
                .await?;
            WorkspaceMetrics::add(&self.metrics.files_uploaded, 1);
            WorkspaceMetrics::add(&self.metrics.bytes_uploaded, copied.size);
            Ok::<_, SyncError>(copied)
        }
        .await
    }

    /// Deletes contents the committed state no longer references, and that
    /// the state stored *now* does not reference either: another writer may
    /// have committed since (having uploaded one of those contents again),
    /// and its commit must not lose a file. The state is read again before
    /// the deletes (no deletes when it cannot be read: garbage is harmless,
    /// a missing content is not) and once more after them: a commit that
    /// slipped in between and names a deleted content gets that entry
    /// dropped (`repair`), so its writer, which still has the file, uploads
    /// it again at its next sync instead of the state naming nothing.
    /// Failures only leave garbage behind: logged, never fatal.
    async fn release(&self, workspace: &str, unreferenced: &[String], committed: &StateFile) {
        let names =
            |state: &StateFile, checksum: &str| state.files.iter().any(|f| f.checksum == checksum);
        let candidates: Vec<&String> = unreferenced
            .iter()
            .filter(|checksum| !names(committed, checksum))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let current = match self.read_remote(workspace).await {
            Ok(current) => current,
            Err(err) => {
                tracing::warn!(workspace, %err, "cannot re-read the workspace state: unreferenced contents are kept");
                return;
            }
        };
        let mut deleted = Vec::new();
        for checksum in candidates {
            if names(&current.state, checksum) {
                WorkspaceMetrics::add(&self.metrics.releases_kept, 1);
                continue;
            }
            let Some(key) = workspace_blob_key(workspace, checksum) else {
                continue;
            };
            match self.store.delete(&key).await {
                Ok(()) | Err(StoreError::NotFound { .. }) => {
                    WorkspaceMetrics::add(&self.metrics.objects_deleted, 1);
                    deleted.push(checksum.clone());
                }
                Err(err) => {
                    tracing::warn!(%key, %err, "cannot delete an unreferenced workspace object")
                }
            }
        }
        if deleted.is_empty() {
            return;
        }
        let Ok(after) = self.read_remote(workspace).await else {
            return;
        };
        let lost: Vec<String> = after
            .state
            .files
            .iter()
            .filter(|f| deleted.contains(&f.checksum))
            .map(|f| f.path.clone())
            .collect();
        if !lost.is_empty() {
            tracing::warn!(
                workspace,
                ?lost,
                "a concurrent commit named contents released meanwhile: its entries are dropped for its writer to upload again"
            );
            WorkspaceMetrics::add(&self.metrics.missing_contents, lost.len() as u64);
            self.repair(workspace, after, &lost).await;
        }
    }
}
