//! A handoff's restore run before its transfer lands
//! (`docs/decisions/0026-the-taker-restores-before-the-transfer.md`).
//!
//! A taker knows the image a handoff will restore before the holder takes
//! it, and downloads it the moment the holder's upload lands (decision 24,
//! `prefetch`). The holder then writes the transfer and the taker's next
//! poll finds it: 100–150 ms under GCS's latency in which the taker had the
//! image and waited, before runsc's restore (200–300 ms) began. Staged, the
//! restore runs in that time: once the image is downloaded and the
//! checkpoint's manifest read, runsc restores it into a container nothing
//! reaches, and when the transfer names this instance the restore under the
//! hold takes that container up instead of running runsc.
//!
//! **What makes it safe.** A staged container is not registered: no client,
//! execution, checkpoint, hook or `/metrics` series sees it until a restore
//! under the hold takes it, so nothing is acknowledged from it before the
//! hold is fenced. Its agent comes back paused (a checkpoint's executions
//! hold their events until the restore's resume). Only sandboxes of network
//! `none` are staged: their processes reach nothing outside the container,
//! so a copy that runs for a moment and is thrown away (the transfer went
//! elsewhere, the checkpoint differs) changes nothing anyone can see; an
//! `egress` sandbox's copy could talk to the world twice. It is taken only
//! for the very checkpoint it restored (id, image key, digest and size).
//!
//! **Bounded.** [`MAX_STAGED`] at once; one not taken within [`KEEP_FOR`]
//! is destroyed, as is every one at shutdown.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use controllers::api::{CheckpointManifest, SandboxId, decode};
use controllers::layout::{checkpoint_id_of_image, checkpoint_manifest_key};
use controllers::store::{ObjectKey, Store, StoreError};
use tokio::sync::watch;

use super::GvisorRuntime;
use super::launch::check_agent_version;
use crate::runtime::agent::AgentConnection;
use crate::runtime::catalog::Image;
use crate::runtime::images::check_cpu_features;

/// Staged restores at once, per server (each costs a sandbox's memory).
const MAX_STAGED: usize = 2;
/// How long a staged restore waits for the transfer.
const KEEP_FOR: Duration = Duration::from_secs(20);
/// How often the manifest is looked for while the image is watched (it is
/// written beside the image and usually lands first: read by the time the
/// image is downloaded, it costs the restore no round trip).
const MANIFEST_POLL: Duration = Duration::from_millis(50);
/// How long the manifest is looked for (the prefetch's watch is as long).
const MANIFEST_WATCH_FOR: Duration = Duration::from_secs(20);

/// Tells a waiting [`StagedRestores::take`] that the launch ended (when
/// dropped, whichever way the task ends).
struct LaunchEnds(watch::Sender<bool>);

impl Drop for LaunchEnds {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// A container restored ahead of its hold.
pub(super) struct Restored {
    pub manifest: CheckpointManifest,
    pub container_id: String,
    pub dir: PathBuf,
    pub agent: Arc<AgentConnection>,
    pub image: Image,
}

/// Where one staged restore is.
enum Phase {
    /// Waiting for the image and the manifest; may still launch.
    Waiting,
    /// runsc restores it.
    Launching,
    Ready(Box<Restored>),
    /// Taken, refused, expired or failed: whatever it launches is destroyed.
    Over,
}

struct Entry {
    serial: u64,
    /// The image it restores: asked again for the same one (every pass of
    /// a waiting taker asks), nothing new starts, even after a refusal.
    image: ObjectKey,
    phase: Arc<Mutex<Phase>>,
    /// Ticks when a launch ends.
    launched: watch::Receiver<bool>,
}

/// The staged restores of one runtime, by sandbox.
#[derive(Default)]
pub(super) struct StagedRestores {
    entries: Mutex<HashMap<SandboxId, Entry>>,
    /// Set by [`GvisorRuntime::enable_staged_restores`]: unset, nothing is
    /// staged.
    runtime: OnceLock<Weak<GvisorRuntime>>,
    serial: AtomicU64,
    /// Taken by a restore under the hold (for tests and operators).
    taken: AtomicUsize,
}

impl std::fmt::Debug for StagedRestores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedRestores").finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StagedRestores {
    /// Stages the restore of `image` of `sandbox`, whose download the
    /// prefetch has started watching for, unless staging is off, one is
    /// staged for it already or [`MAX_STAGED`] are.
    pub(super) fn start(&self, sandbox: &SandboxId, image: &ObjectKey) {
        let Some(runtime) = self.runtime.get().cloned() else {
            return;
        };
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let (phase, sender) = {
            let mut entries = lock(&self.entries);
            let live = entries
                .values()
                .filter(|entry| !matches!(*lock(&entry.phase), Phase::Over))
                .count();
            if entries
                .get(sandbox)
                .is_some_and(|entry| &entry.image == image)
                || live >= MAX_STAGED
            {
                return;
            }
            let phase = Arc::new(Mutex::new(Phase::Waiting));
            let (sender, launched) = watch::channel(false);
            entries.insert(
                sandbox.clone(),
                Entry {
                    serial,
                    image: image.clone(),
                    phase: phase.clone(),
                    launched,
                },
            );
            (phase, sender)
        };
        let sandbox = sandbox.clone();
        let image = image.clone();
        tokio::spawn(async move {
            stage(
                runtime,
                &sandbox,
                &image,
                &phase,
                LaunchEnds(sender),
                serial,
            )
            .await;
        });
    }

    /// True when a staged restore of `image` of `sandbox` is under way,
    /// ready, or was refused lately.
    pub(super) fn covers(&self, sandbox: &SandboxId, image: &ObjectKey) -> bool {
        lock(&self.entries)
            .get(sandbox)
            .is_some_and(|entry| &entry.image == image)
    }

    /// The container staged for exactly `manifest`'s checkpoint of
    /// `sandbox`, waiting for a launch under way; `None` (and whatever was
    /// staged destroyed) otherwise.
    pub(super) async fn take(
        &self,
        runtime: &GvisorRuntime,
        sandbox: &SandboxId,
        manifest: &CheckpointManifest,
    ) -> Option<Restored> {
        let mut entry = lock(&self.entries).remove(sandbox)?;
        loop {
            let over = {
                let mut phase = lock(&entry.phase);
                match std::mem::replace(&mut *phase, Phase::Over) {
                    Phase::Launching => {
                        *phase = Phase::Launching;
                        None
                    }
                    Phase::Ready(restored) => Some(Some(restored)),
                    Phase::Waiting | Phase::Over => Some(None),
                }
            };
            match over {
                Some(Some(restored)) if same_checkpoint(&restored.manifest, manifest) => {
                    self.taken.fetch_add(1, Ordering::Relaxed);
                    return Some(*restored);
                }
                Some(Some(restored)) => {
                    tracing::info!(%sandbox, "a staged restore is not the transfer's checkpoint: destroyed");
                    runtime.delete_in_background(restored.container_id, restored.dir);
                    return None;
                }
                Some(None) => return None,
                None => {
                    if entry.launched.changed().await.is_err() {
                        return None;
                    }
                }
            }
        }
    }

    /// Staged restores restored and not taken yet.
    pub(super) fn ready(&self) -> usize {
        lock(&self.entries)
            .values()
            .filter(|entry| matches!(*lock(&entry.phase), Phase::Ready(_)))
            .count()
    }

    /// Restores taken up by a restore under the hold since the start.
    pub(super) fn taken(&self) -> usize {
        self.taken.load(Ordering::Relaxed)
    }

    /// Ends every staged restore (shutdown): ready ones are destroyed now,
    /// launches under way when they end.
    pub(super) fn close(&self, runtime: &GvisorRuntime) {
        let entries: Vec<Entry> = lock(&self.entries)
            .drain()
            .map(|(_, entry)| entry)
            .collect();
        for entry in entries {
            if let Phase::Ready(restored) = std::mem::replace(&mut *lock(&entry.phase), Phase::Over)
            {
                runtime.delete_in_background(restored.container_id, restored.dir);
            }
        }
    }

    /// Removes `sandbox`'s entry if it is still the one of `serial`.
    fn forget(&self, sandbox: &SandboxId, serial: u64) {
        let mut entries = lock(&self.entries);
        if entries
            .get(sandbox)
            .is_some_and(|entry| entry.serial == serial)
        {
            entries.remove(sandbox);
        }
    }
}

impl GvisorRuntime {
    /// Lets a handoff's restore run before its transfer lands (`staged`).
    /// Call once, on the runtime the server uses.
    pub fn enable_staged_restores(self: &Arc<Self>) {
        let _ = self.staged.runtime.set(Arc::downgrade(self));
    }

    /// Staged restores now: restored and waiting for their transfer, and
    /// how many a restore under the hold has taken up since the start.
    pub fn staged_restores(&self) -> (usize, usize) {
        (self.staged.ready(), self.staged.taken())
    }
}

/// True when `staged` restored the checkpoint `wanted` describes.
fn same_checkpoint(staged: &CheckpointManifest, wanted: &CheckpointManifest) -> bool {
    staged.checkpoint_id == wanted.checkpoint_id
        && staged.sandbox_id == wanted.sandbox_id
        && staged.image == wanted.image
        && staged.sandbox_image == wanted.sandbox_image
        && staged.network == wanted.network
        && staged.agent_version == wanted.agent_version
}

/// The staged restore's task: waits for the image and the manifest,
/// restores, and keeps the container for [`KEEP_FOR`].
async fn stage(
    runtime: Weak<GvisorRuntime>,
    sandbox: &SandboxId,
    image: &ObjectKey,
    phase: &Mutex<Phase>,
    launch_ends: LaunchEnds,
    serial: u64,
) {
    let restored = launch(&runtime, sandbox, image, phase).await;
    let Some(strong) = runtime.upgrade() else {
        return;
    };
    let restored = match restored {
        Ok(Some(restored)) => restored,
        Ok(None) => {
            strong.staged.forget(sandbox, serial);
            return;
        }
        Err(reason) => {
            // Remembered (over) for a while, so the taker's next passes do
            // not stage it again.
            tracing::debug!(%sandbox, %reason, "no staged restore");
            *lock(phase) = Phase::Over;
            drop(launch_ends);
            drop(strong);
            tokio::time::sleep(KEEP_FOR).await;
            if let Some(strong) = runtime.upgrade() {
                strong.staged.forget(sandbox, serial);
            }
            return;
        }
    };
    {
        let mut current = lock(phase);
        if !matches!(*current, Phase::Launching) {
            // Taken too early, or closed meanwhile.
            drop(current);
            strong.delete_in_background(restored.container_id, restored.dir);
            return;
        }
        tracing::debug!(%sandbox, container = %restored.container_id, "restored ahead of the transfer");
        *current = Phase::Ready(Box::new(restored));
    }
    drop(launch_ends);
    drop(strong);
    tokio::time::sleep(KEEP_FOR).await;
    let expired = std::mem::replace(&mut *lock(phase), Phase::Over);
    if let Some(strong) = runtime.upgrade() {
        strong.staged.forget(sandbox, serial);
        if let Phase::Ready(restored) = expired {
            tracing::debug!(%sandbox, "a staged restore was not taken: destroyed");
            strong.delete_in_background(restored.container_id, restored.dir);
        }
    }
}

/// Waits for the image and the manifest, then restores: `Ok(None)` when it
/// was taken or closed before the launch, `Err` with why it is not staged.
async fn launch(
    runtime: &Weak<GvisorRuntime>,
    sandbox: &SandboxId,
    image: &ObjectKey,
    phase: &Mutex<Phase>,
) -> Result<Option<Restored>, String> {
    let gone = || "the runtime is gone".to_owned();
    let manifest_key = checkpoint_id_of_image(image.as_str())
        .map(|id| checkpoint_manifest_key(&id))
        .ok_or_else(|| format!("{image} is no checkpoint image"))?;
    let (found, store) = {
        let runtime = runtime.upgrade().ok_or_else(gone)?;
        (runtime.prefetches.found(image), runtime.checkpoints.clone())
    };
    // The image's watch and the manifest's at once; either failing ends both.
    let image_found = async {
        if found.await {
            Ok(())
        } else {
            Err("the image was not found".to_owned())
        }
    };
    let ((), manifest) =
        tokio::try_join!(image_found, watch_manifest(store.as_ref(), &manifest_key))?;
    let runtime = runtime.upgrade().ok_or_else(gone)?;
    if &manifest.sandbox_id != sandbox || manifest.image.key != image.as_str() {
        return Err(format!("{manifest_key} is not of this sandbox's image"));
    }
    if !manifest.network.is_none() {
        return Err("the sandbox has a network of its own".to_owned());
    }
    check_cpu_features(&manifest.cpu_features, &runtime.cpu_features)
        .map_err(|err| err.to_string())?;
    check_agent_version(&manifest).map_err(|err| err.to_string())?;
    let sandbox_image = runtime
        .image_for_restore(&manifest)
        .await
        .map_err(|err| err.to_string())?;
    {
        let mut current = lock(phase);
        if !matches!(*current, Phase::Waiting) {
            return Ok(None);
        }
        *current = Phase::Launching;
    }
    match runtime
        .restore_into(sandbox, &manifest, image, None, &sandbox_image)
        .await
    {
        Ok((container_id, dir, agent)) => Ok(Some(Restored {
            manifest,
            container_id,
            dir,
            agent,
            image: sandbox_image,
        })),
        Err(err) => Err(format!("the restore failed: {err}")),
    }
}

/// The checkpoint's manifest, looked for every [`MANIFEST_POLL`] until it
/// appears (within [`MANIFEST_WATCH_FOR`]).
async fn watch_manifest(store: &dyn Store, key: &ObjectKey) -> Result<CheckpointManifest, String> {
    let deadline = tokio::time::Instant::now() + MANIFEST_WATCH_FOR;
    loop {
        match store.get(key).await {
            Ok(read) => return decode(&read.data).map_err(|err| format!("{key}: {err}")),
            Err(StoreError::NotFound { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(MANIFEST_POLL).await;
            }
            Err(err) => return Err(format!("{key}: {err}")),
        }
    }
}
