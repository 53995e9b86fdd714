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
//! for the very checkpoint it restored (the manifests equal) and only if
//! its agent still answers.
//!
//! **Bounded.** [`MAX_STAGED`] at once; one not taken within [`KEEP_FOR`]
//! is destroyed, as is every one at shutdown. An ended one is remembered
//! for [`REMEMBER_FOR`] (as long as the prefetch keeps a download), so a
//! waiting taker's passes neither stage nor fetch that image again.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use controllers::api::{CheckpointManifest, SandboxId, decode};
use controllers::layout::{checkpoint_id_of_image, checkpoint_manifest_key};
use controllers::store::{ObjectKey, Store, StoreError};
use tokio::sync::watch;

use super::GvisorRuntime;
use super::launch::check_agent_version;
use super::local::{Local, Locals};
use crate::runtime::agent::AgentConnection;
use crate::runtime::agent::protocol::Request;
use crate::runtime::checkpoint::transfer::check_cpu_features;
use crate::runtime::images::catalog::Image;

/// Staged restores at once, per server (each costs a sandbox's memory).
const MAX_STAGED: usize = 2;
/// How long a staged restore waits for the transfer.
const KEEP_FOR: Duration = Duration::from_secs(20);
/// How long an ended staged restore is remembered.
const REMEMBER_FOR: Duration = Duration::from_secs(60);
/// A staged container's agent must answer within this when it is taken up
/// (it may have died while it waited).
const TAKE_UP_PING: Duration = Duration::from_secs(2);
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
    /// `fetched`: a launch took the prefetched download (a new prefetch
    /// would download it again).
    Over {
        fetched: bool,
    },
}

impl Phase {
    fn is_over(&self) -> bool {
        matches!(self, Self::Over { .. })
    }
}

/// One sandbox's staged restore: its state in the runtime's map
/// ([`Local::Staged`]) until a restore under the hold takes it.
pub(super) struct Stage {
    /// The image it restores: asked again for the same one (every pass of
    /// a waiting taker asks), nothing new starts, even after a refusal.
    image: ObjectKey,
    since: Instant,
    phase: Arc<Mutex<Phase>>,
    /// Ticks when a launch ends.
    launched: watch::Receiver<bool>,
}

impl Stage {
    fn is_over(&self) -> bool {
        lock(&self.phase).is_over()
    }

    /// Ends it: what it restored, if it was ready (the caller destroys it).
    pub(super) fn end(&self) -> Option<Box<Restored>> {
        end(&self.phase)
    }
}

/// What the staged restores of one runtime share; each one is its
/// sandbox's state in the runtime's map (`local`).
#[derive(Default)]
pub(super) struct StagedRestores {
    /// Set by [`GvisorRuntime::enable_staged_restores`]: unset, nothing is
    /// staged.
    runtime: OnceLock<Weak<GvisorRuntime>>,
    /// Taken by a restore under the hold (for tests and operators).
    taken: AtomicUsize,
    /// Set at shutdown: nothing is staged or taken any more.
    closed: AtomicBool,
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
    pub(super) fn start(&self, locals: &Locals, sandbox: &SandboxId, image: &ObjectKey) {
        let Some(runtime) = self.runtime.get().cloned() else {
            return;
        };
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let mut replaced = None;
        let started = {
            let mut entries = locals.all();
            entries.retain(|_, local| {
                !matches!(local, Local::Staged(stage)
                    if stage.is_over() && stage.since.elapsed() > REMEMBER_FOR)
            });
            match entries.get(sandbox) {
                Some(Local::Staged(stage)) if &stage.image == image => return,
                Some(Local::Staged(_)) => {
                    // Another handoff of the sandbox (a new epoch): the old
                    // stage ends, and whatever it restored goes.
                    if let Some(Local::Staged(old)) = entries.remove(sandbox) {
                        replaced = Some(old.end());
                    }
                }
                // Prepared for a create, being created or restored, or
                // running here: nothing to stage.
                Some(_) => return,
                None => {}
            }
            let live = entries
                .values()
                .filter(|local| matches!(local, Local::Staged(stage) if !stage.is_over()))
                .count();
            if live >= MAX_STAGED {
                None
            } else {
                let phase = Arc::new(Mutex::new(Phase::Waiting));
                let (sender, launched) = watch::channel(false);
                entries.insert(
                    sandbox.clone(),
                    Local::Staged(Stage {
                        image: image.clone(),
                        #[allow(
                            clippy::disallowed_methods,
                            reason = "how long a staged runsc restore has been kept on this host; no simulation runs runsc"
                        )]
                        since: Instant::now(),
                        phase: phase.clone(),
                        launched,
                    }),
                );
                Some((phase, sender))
            }
        };
        if let Some(Some(restored)) = replaced
            && let Some(strong) = runtime.upgrade()
        {
            strong.delete_in_background(restored.container_id, restored.dir);
        }
        let Some((phase, sender)) = started else {
            return;
        };
        let sandbox = sandbox.clone();
        let image = image.clone();
        tokio::spawn(async move {
            stage(runtime, &sandbox, &image, &phase, LaunchEnds(sender)).await;
        });
    }

    /// True when a staged restore of `image` of `sandbox` has the
    /// prefetch's download, or will take it: waiting, under way, ready, or
    /// ended after it took it (lately).
    pub(super) fn covers(&self, locals: &Locals, sandbox: &SandboxId, image: &ObjectKey) -> bool {
        matches!(locals.all().get(sandbox), Some(Local::Staged(stage))
            if &stage.image == image
                && !matches!(*lock(&stage.phase), Phase::Over { fetched: false }))
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
        let mut entry = runtime.locals.step(sandbox, Local::take_staged)?;
        if self.closed.load(Ordering::Acquire) || entry.image.as_str() != manifest.image.key {
            // Staged for another checkpoint (or shutting down): not waited for.
            if let Some(restored) = end(&entry.phase) {
                runtime.delete_in_background(restored.container_id, restored.dir);
            }
            return None;
        }
        let restored = loop {
            let now = {
                let mut phase = lock(&entry.phase);
                if matches!(*phase, Phase::Launching) {
                    None
                } else {
                    Some(std::mem::replace(
                        &mut *phase,
                        Phase::Over { fetched: true },
                    ))
                }
            };
            match now {
                Some(Phase::Ready(restored)) => break *restored,
                Some(_) => return None,
                None => {
                    if entry.launched.changed().await.is_err() {
                        return None;
                    }
                }
            }
        };
        if restored.manifest != *manifest {
            tracing::info!(%sandbox, "a staged restore is not the transfer's checkpoint: destroyed");
            runtime.delete_in_background(restored.container_id, restored.dir);
            return None;
        }
        // It waited up to KEEP_FOR: it must still answer.
        if let Err(err) = restored.agent.request(Request::Ping, TAKE_UP_PING).await {
            tracing::info!(%sandbox, %err, "a staged restore does not answer: destroyed");
            runtime.delete_in_background(restored.container_id, restored.dir);
            return None;
        }
        self.taken.fetch_add(1, Ordering::Relaxed);
        Some(restored)
    }

    /// Staged restores restored and not taken yet.
    pub(super) fn ready(&self, locals: &Locals) -> usize {
        locals
            .all()
            .values()
            .filter(|local| {
                matches!(local, Local::Staged(stage) if matches!(*lock(&stage.phase), Phase::Ready(_)))
            })
            .count()
    }

    /// Restores taken up by a restore under the hold since the start.
    pub(super) fn taken(&self) -> usize {
        self.taken.load(Ordering::Relaxed)
    }

    /// Ends every staged restore (shutdown): ready ones are destroyed now,
    /// launches under way when they end, and nothing is staged after.
    pub(super) fn close(&self, runtime: &GvisorRuntime) {
        self.closed.store(true, Ordering::Release);
        let stages: Vec<Stage> = {
            let mut entries = runtime.locals.all();
            let staged: Vec<SandboxId> = entries
                .iter()
                .filter(|(_, local)| matches!(local, Local::Staged(_)))
                .map(|(sandbox, _)| sandbox.clone())
                .collect();
            staged
                .iter()
                .filter_map(|sandbox| match entries.remove(sandbox) {
                    Some(Local::Staged(stage)) => Some(stage),
                    _ => None,
                })
                .collect()
        };
        for stage in stages {
            if let Some(restored) = stage.end() {
                runtime.delete_in_background(restored.container_id, restored.dir);
            }
        }
    }
}

/// Ends a stage: what it restored, if it was ready (the caller destroys it).
fn end(phase: &Mutex<Phase>) -> Option<Box<Restored>> {
    match std::mem::replace(&mut *lock(phase), Phase::Over { fetched: true }) {
        Phase::Ready(restored) => Some(restored),
        _ => None,
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
        (self.staged.ready(&self.locals), self.staged.taken())
    }
}

/// The staged restore's task: waits for the image and the manifest,
/// restores, and keeps the container for [`KEEP_FOR`].
async fn stage(
    runtime: Weak<GvisorRuntime>,
    sandbox: &SandboxId,
    image: &ObjectKey,
    phase: &Mutex<Phase>,
    launch_ends: LaunchEnds,
) {
    let restored = launch(&runtime, sandbox, image, phase).await;
    let restored = match restored {
        Ok(Some(restored)) => restored,
        // Taken or closed before the launch.
        Ok(None) => return,
        Err(reason) => {
            tracing::debug!(%sandbox, %reason, "no staged restore");
            let mut current = lock(phase);
            let fetched = !matches!(*current, Phase::Waiting);
            *current = Phase::Over { fetched };
            return;
        }
    };
    {
        let mut current = lock(phase);
        if matches!(*current, Phase::Launching) {
            tracing::debug!(%sandbox, container = %restored.container_id, "restored ahead of the transfer");
            *current = Phase::Ready(Box::new(restored));
        } else {
            // Taken too early, replaced or closed meanwhile.
            drop(current);
            if let Some(strong) = runtime.upgrade() {
                strong.delete_in_background(restored.container_id, restored.dir);
            }
            return;
        }
    }
    drop(launch_ends);
    tokio::time::sleep(KEEP_FOR).await;
    if let Some(restored) = end(phase) {
        tracing::debug!(%sandbox, "a staged restore was not taken: destroyed");
        if let Some(strong) = runtime.upgrade() {
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
#[allow(
    clippy::disallowed_methods,
    reason = "waits on runsc and the store on this host for a bounded time (tokio's clock, which a paused runtime moves); no simulation runs the gVisor runtime"
)]
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
