//! `SandboxRuntime` on gVisor through the `runsc` CLI: [`GvisorRuntime`],
//! what it holds (each sandbox's state here in one map, `local`; background
//! deletions) and its lifecycle (start, networking, settle).
//!
//! Each sandbox is one runsc container whose init is the agent; executions go
//! through the agent's stdio channel, never through `runsc exec`, so an
//! execution costs a fork inside the sandbox (about 15–20 ms here) instead of a
//! runsc process (about 40 ms). Container ids are fixed-length and fresh for
//! every create and restore (`sbx` + 32 hex digits): runsc mixes up ids that are
//! prefixes of each other, and its control socket is named after the id.
//!
//! `runsc delete` takes about 2 s here; nobody waits for it: it runs in the
//! background after a checkpoint or a destroy.
//!
//! The rest, by concept: `launch` (containers up and the agent connected),
//! `executions`, `checkpoint`, `snapshots` (and images for a create), `pool`
//! (warm sandboxes booted ahead of demand), and `port` (the `SandboxRuntime`
//! trait, delegating to those).

mod checkpoint;
mod executions;
mod housekeeping;
mod launch;
mod local;
mod owner;
mod pool;
mod port;
mod prefetch;
mod ready;
mod snapshots;
mod staged;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use controllers::api::{NetworkMode, SandboxId};
use controllers::runtime::{RuntimeError, SandboxRuntime};
use controllers::store::Store;

use super::agent::AgentConnection;
use super::bundle::{BundleSpec, SANDBOX_HOME, WORKSPACE_DIR};
use super::network::{HostNetwork, NetworkConfig, SandboxNetwork};
use super::runsc::Runsc;
use crate::runtime::agent::delivery::DeliveryGate;
use crate::runtime::checkpoint::transfer::{check_cpu_features, host_cpu_features};
use crate::runtime::images::catalog::{Image, ImageCatalog};
use housekeeping::{owners_dir, prune_orphaned_checkpoints, sweep_temporaries};
use local::{Ahead, Local, Locals};
use owner::Owner;

pub use controllers::runtime::WarmPoolStats;

/// How long a new or restored agent may take to answer.
const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Who may use a sandbox's processes right now.
#[derive(Debug, Default)]
struct ExecSlot {
    /// The id of the running execution, if any.
    exec: Option<String>,
    /// A checkpoint is being taken: no execution may start (one started
    /// between the agent's preparation and `runsc checkpoint` would be frozen
    /// half-way into the image).
    checkpointing: bool,
    /// The checkpoint under way kills the running execution (forced, not
    /// keeping it): its relay reports the end as forced. Written under the
    /// same lock as `exec`, before the agent is asked to kill.
    forced_kill: bool,
}
/// Directories a filesystem snapshot saves: everything user code (uid 1000)
/// can write.
const SNAPSHOT_PATHS: [&str; 4] = [SANDBOX_HOME, WORKSPACE_DIR, "/tmp", "/var/tmp"];

/// Everything the gVisor runtime needs to know.
#[derive(Debug, Clone)]
pub struct GvisorConfig {
    pub runsc: Runsc,
    /// Bundles, logs and images in transit live here (local disk).
    pub state_dir: PathBuf,
    pub bundle: BundleSpec,
    /// The sandbox images of this host (root filesystems).
    pub images: ImageCatalog,
    /// Bucket name recorded in checkpoint references.
    pub checkpoint_bucket: String,
    /// Local disk the images of failed checkpoint uploads may hold, in all.
    pub orphaned_checkpoints_budget: u64,
}

/// Default of `--orphaned-checkpoints-max-mb`, in bytes.
pub const DEFAULT_ORPHANED_CHECKPOINTS_BUDGET: u64 = 4 << 30;

/// A sandbox running on this host.
#[derive(Debug)]
struct LocalSandbox {
    container_id: String,
    dir: PathBuf,
    agent: Arc<AgentConnection>,
    /// The running execution and whether a checkpoint is being taken.
    current_exec: Arc<Mutex<ExecSlot>>,
    /// `egress` sandboxes: their namespace, veth, address and rules here.
    network: Option<SandboxNetwork>,
    /// The image it runs on (checkpoints and snapshots record its digest).
    image: Image,
    /// The newest resumable execution's delivery gate (running, or ended
    /// with output the agent still journals).
    gate: Mutex<Option<Arc<DeliveryGate>>>,
}

impl LocalSandbox {
    fn gate(&self) -> Option<Arc<DeliveryGate>> {
        self.gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set_gate(&self, gate: Option<Arc<DeliveryGate>>) {
        *self.gate.lock().unwrap_or_else(PoisonError::into_inner) = gate;
    }
}

/// The gVisor runtime.
#[derive(Debug)]
pub struct GvisorRuntime {
    config: GvisorConfig,
    checkpoints: Arc<dyn Store>,
    snapshots: Arc<dyn Store>,
    /// Each sandbox's state here (`local`): prepared for its create, staged
    /// ahead of its handoff, being created or restored, or running.
    locals: Locals,
    /// Background `runsc delete`s still running; [`GvisorRuntime::settle`] waits for them.
    deletions: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    runsc_version: String,
    cpu_features: Vec<String>,
    /// Set by [`GvisorRuntime::with_network`]: `egress` sandboxes allowed.
    network: Option<Arc<HostNetwork>>,
    /// This runtime's tag on the containers it starts, held while it lives.
    owner: Owner,
    /// One image fetch at a time (two restores needing it fetch it once).
    image_fetch: tokio::sync::Mutex<()>,
    /// Sandboxes booted ahead of demand (`pool`).
    pool: Arc<pool::WarmPool>,
    /// Ready templates' checkpoints made here (`ready`).
    ready: ready::ReadyTemplates,
    /// Handoffs' images fetched before their restores (`prefetch`).
    prefetches: prefetch::Prefetches,
    /// Handoffs' restores run before their transfers (`staged`).
    staged: staged::StagedRestores,
    /// `runsc checkpoint`s that may run at once ([`checkpoint_permits`]).
    checkpoint_permits: tokio::sync::Semaphore,
}

/// How many `runsc checkpoint`s run at once: two per core this process may
/// use. Each sentry compresses its memory on every core it may use (its
/// quota lifted for the call), so many at once share the cores and all
/// finish late together: a mass reconnect's thirty handoffs from one holder
/// had every client wait for the last image. In turns the first images
/// land early and their takers restore while the rest are taken (measured
/// on 2 cores on 2026-11-27: the median attach 8.1 s unbounded,
/// 5.9–6.4 s at four, the last one the same; at two the last came a second
/// later: a checkpoint also waits on runsc's own steps, not only on CPU).
fn checkpoint_permits() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .saturating_mul(2)
        .max(2)
}

impl GvisorRuntime {
    /// Prepares the state directory and removes whatever a crashed server left
    /// under this runsc root (containers and their directories).
    pub async fn start(
        config: GvisorConfig,
        checkpoints: Arc<dyn Store>,
        snapshots: Arc<dyn Store>,
    ) -> Result<Self, RuntimeError> {
        let failed = |what: &str, err: &dyn std::fmt::Display| {
            RuntimeError::Failed(format!("{what}: {err}"))
        };
        let runsc_version = config
            .runsc
            .version()
            .await
            .map_err(|err| failed("runsc is not usable", &err))?;
        // No image, no sandboxes: refuse to start rather than fail every create.
        let default_image = config
            .images
            .default_image()
            .map_err(|err| failed("the default sandbox image", &err))?;
        tracing::info!(image = %default_image.name, digest = %default_image.digest, "default sandbox image");
        for dir in [&config.runsc.root, &config.state_dir] {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|err| failed(&format!("cannot create {}", dir.display()), &err))?;
        }
        // Other servers may share this root: only containers no live server
        // owns are leftovers (`owner.rs`).
        let owners = owners_dir(&config.runsc.root);
        let owner = Owner::claim(&owners).map_err(|err| {
            failed(
                &format!("cannot claim an owner tag in {}", owners.display()),
                &err,
            )
        })?;
        let leftovers: Vec<String> = config
            .runsc
            .list()
            .await
            .map_err(|err| failed("runsc list", &err))?
            .into_iter()
            .filter(|id| owner.is_orphan(id))
            .collect();
        let deletes = leftovers.iter().map(|id| {
            tracing::warn!(container = %id, "deleting a container left by an earlier run");
            config.runsc.delete_force(id)
        });
        for result in futures::future::join_all(deletes).await {
            if let Err(err) = result {
                tracing::warn!(%err, "could not delete a leftover container");
            }
        }
        let containers = config.state_dir.join("containers");
        // Ready templates' checkpoints: this run's own directory; those of
        // servers gone are removed (made again by whatever runsc comes next).
        let ready = ready::ReadyTemplates::under(&config.state_dir, &owner).await;
        tokio::fs::create_dir_all(&containers)
            .await
            .map_err(|err| failed("cannot create the containers directory", &err))?;
        if let Ok(mut entries) = tokio::fs::read_dir(&containers).await {
            while let Ok(Some(entry)) = entries.next_entry().await {
                if owner.is_orphan(&entry.file_name().to_string_lossy()) {
                    let _ = tokio::fs::remove_dir_all(entry.path()).await;
                }
            }
        }
        sweep_temporaries(&config.state_dir, &owner).await;
        prune_orphaned_checkpoints(&config.state_dir, config.orphaned_checkpoints_budget).await;
        // With pinned features, checkpoints record the pinned set (what the
        // sandbox saw); this host must have all of it.
        let cpu_features = match &config.bundle.cpu_features {
            Some(pinned) => {
                let mut pinned = pinned.clone();
                pinned.sort();
                pinned.dedup();
                check_cpu_features(&pinned, &host_cpu_features())
                    .map_err(|err| RuntimeError::Failed(format!("SANDBOXD_CPU_FEATURES: {err}")))?;
                pinned
            }
            None => host_cpu_features(),
        };
        Ok(Self {
            config,
            checkpoints,
            snapshots,
            locals: Locals::default(),
            deletions: Mutex::new(Vec::new()),
            runsc_version,
            cpu_features,
            network: None,
            owner,
            image_fetch: tokio::sync::Mutex::new(()),
            pool: Arc::default(),
            ready,
            prefetches: prefetch::Prefetches::default(),
            staged: staged::StagedRestores::default(),
            checkpoint_permits: tokio::sync::Semaphore::new(checkpoint_permits()),
        })
    }

    /// Enables `egress` sandboxes (`src/runtime/network/`): removes the
    /// networking a crashed run left and prepares the host.
    pub async fn with_network(mut self, config: NetworkConfig) -> Result<Self, RuntimeError> {
        let network = HostNetwork::start(config, &self.config.state_dir, &self.runsc_version)
            .await
            .map_err(|err| RuntimeError::Failed(format!("sandbox networking: {err}")))?;
        self.network = Some(Arc::new(network));
        Ok(self)
    }

    /// Sets up the host side of a sandbox's network (`None` for `none`).
    async fn attach_network(
        &self,
        mode: NetworkMode,
    ) -> Result<Option<SandboxNetwork>, RuntimeError> {
        match (mode, &self.network) {
            (NetworkMode::None, _) => Ok(None),
            (NetworkMode::Egress, None) => Err(RuntimeError::Invalid(
                "network mode egress is not enabled on this server".to_owned(),
            )),
            (NetworkMode::Egress, Some(host)) => host
                .attach()
                .await
                .map(Some)
                .map_err(|err| RuntimeError::Failed(err.to_string())),
        }
    }

    async fn detach_network(&self, network: Option<SandboxNetwork>) {
        if let (Some(network), Some(host)) = (network, &self.network) {
            host.detach(&network).await;
        }
    }

    pub fn runsc_version(&self) -> &str {
        &self.runsc_version
    }

    /// The agent of a sandbox running here.
    pub(in crate::runtime) fn agent_of(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Arc<AgentConnection>, RuntimeError> {
        Ok(Arc::clone(&self.get(sandbox)?.agent))
    }

    fn get(&self, sandbox: &SandboxId) -> Result<Arc<LocalSandbox>, RuntimeError> {
        self.locals
            .running(sandbox)
            .ok_or_else(|| RuntimeError::NotFound(sandbox.clone()))
    }

    /// The images of this host.
    pub fn images(&self) -> &ImageCatalog {
        &self.config.images
    }

    /// The sandbox runs: its reservation ends in the running state, and
    /// whatever was ready ahead for it and not taken is discarded.
    fn register(
        &self,
        sandbox: &SandboxId,
        container_id: String,
        dir: PathBuf,
        agent: Arc<AgentConnection>,
        network: Option<SandboxNetwork>,
        image: Image,
    ) -> Arc<LocalSandbox> {
        let local = Arc::new(LocalSandbox {
            container_id,
            dir,
            agent,
            current_exec: Arc::new(Mutex::new(ExecSlot::default())),
            network,
            image,
            gate: Mutex::new(None),
        });
        let left = self
            .locals
            .step(sandbox, |state| Local::run(state, Arc::clone(&local)));
        if let Some(left) = left {
            self.discard_ahead(left);
        }
        local
    }

    /// Discards what was ready ahead of a create or restore nobody took.
    fn discard_ahead(&self, ahead: Ahead) {
        match ahead {
            Ahead::Prepared(booted) => self.discard_warm(booted),
            Ahead::Staged(stage) => {
                if let Some(restored) = stage.end() {
                    self.delete_in_background(restored.container_id, restored.dir);
                }
            }
        }
    }

    /// Reserves `sandbox` for a create or restore; the reservation ends when the
    /// returned guard drops (after `register` on success).
    fn claim(&self, sandbox: &SandboxId) -> Result<Reservation<'_>, RuntimeError> {
        let ticket = self.locals.ticket();
        if !self
            .locals
            .step(sandbox, |state| Local::reserve(state, ticket))
        {
            return Err(RuntimeError::AlreadyExists(sandbox.clone()));
        }
        Ok(Reservation {
            runtime: self,
            sandbox: sandbox.clone(),
            ticket,
        })
    }

    /// `runsc delete --force` and directory removal, not awaited.
    fn delete_in_background(&self, container_id: String, dir: PathBuf) {
        self.delete_and_detach_in_background(container_id, dir, None);
    }

    /// Like [`Self::delete_in_background`], then removes the sandbox's network
    /// and frees its address.
    fn delete_and_detach_in_background(
        &self,
        container_id: String,
        dir: PathBuf,
        network: Option<SandboxNetwork>,
    ) {
        let runsc = self.config.runsc.clone();
        let host = self.network.clone();
        let handle = tokio::spawn(async move {
            if let Err(err) = runsc.delete_force(&container_id).await {
                tracing::warn!(container = %container_id, %err, "runsc delete failed");
            }
            let _ = tokio::fs::remove_dir_all(&dir).await;
            if let (Some(network), Some(host)) = (network, host) {
                host.detach(&network).await;
            }
        });
        let mut deletions = self
            .deletions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        deletions.retain(|task| !task.is_finished());
        deletions.push(handle);
    }

    /// Destroys every sandbox still running here and waits until all
    /// background deletions are done: for a clean shutdown (a process that
    /// exits with deletions in flight leaves containers behind until the next
    /// start under the same runsc root cleans them up).
    pub async fn settle(&self) {
        self.close_warm_pool().await;
        self.staged.close(self);
        let running: Vec<SandboxId> = self
            .locals
            .all()
            .iter()
            .filter(|(_, local)| local.running().is_some())
            .map(|(sandbox, _)| sandbox.clone())
            .collect();
        for sandbox in running {
            let _ = self.destroy(&sandbox).await;
        }
        let pending = std::mem::take(
            &mut *self
                .deletions
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for task in pending {
            let _ = task.await;
        }
    }
}

/// A create or restore in progress for one sandbox id; dropped before the
/// sandbox runs, its state goes back to what was ready ahead, or is
/// forgotten.
struct Reservation<'a> {
    runtime: &'a GvisorRuntime,
    sandbox: SandboxId,
    ticket: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let ticket = self.ticket;
        self.runtime
            .locals
            .step(&self.sandbox, |state| Local::unreserve(state, ticket));
    }
}
