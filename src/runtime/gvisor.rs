//! `SandboxRuntime` on gVisor through the `runsc` CLI.
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

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use chrono::Utc;
use controllers::api::{
    API_VERSION, BlobDigest, CheckpointManifest, ExtraFields, NetworkMode, SandboxId,
    SnapshotManifest, decode, encode, is_resource_name,
};
use controllers::layout::{
    checkpoint_image_key, checkpoint_manifest_key, snapshot_archive_key, snapshot_manifest_key,
};
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecControl, ExecEvent, ExecRequest, Execution,
    RuntimeError, SandboxRuntime,
};
use controllers::store::{BlobSource, PutMode, Store};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;

use super::agent::{AgentConnection, AgentError, Sequenced};
use super::bundle::{BundleNetwork, BundleSpec, SANDBOX_HOME, WORKSPACE_DIR};
use super::catalog::{Image, ImageCatalog};
use super::cpu_quota;
use super::delivery::DeliveryGate;
use super::image_follower::ImageFollower;
use super::images::{
    check_cpu_features, download_verified, host_cpu_features, mismatch, sha256_file, sha256_of,
};
use super::network::{self, HostNetwork, NetworkConfig, SandboxNetwork};
use super::runsc::{InitStdio, LaunchNetwork, Runsc};

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
}

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
    sandboxes: Mutex<HashMap<SandboxId, Arc<LocalSandbox>>>,
    /// Ids being created or restored right now, so two cannot race.
    reserved: Mutex<HashSet<SandboxId>>,
    /// Background `runsc delete`s still running; [`GvisorRuntime::settle`] waits for them.
    deletions: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    runsc_version: String,
    cpu_features: Vec<String>,
    /// Set by [`GvisorRuntime::with_network`]: `egress` sandboxes allowed.
    network: Option<Arc<HostNetwork>>,
    /// One image fetch at a time (two restores needing it fetch it once).
    image_fetch: tokio::sync::Mutex<()>,
    /// Executions restores brought back, until the API takes them.
    resumed: Mutex<HashMap<SandboxId, Execution>>,
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
        let leftovers = config
            .runsc
            .list()
            .await
            .map_err(|err| failed("runsc list", &err))?;
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
        let _ = tokio::fs::remove_dir_all(&containers).await;
        tokio::fs::create_dir_all(&containers)
            .await
            .map_err(|err| failed("cannot create the containers directory", &err))?;
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
            sandboxes: Mutex::new(HashMap::new()),
            reserved: Mutex::new(HashSet::new()),
            deletions: Mutex::new(Vec::new()),
            runsc_version,
            cpu_features,
            network: None,
            image_fetch: tokio::sync::Mutex::new(()),
            resumed: Mutex::new(HashMap::new()),
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

    fn sandboxes(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Arc<LocalSandbox>>> {
        self.sandboxes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The agent of a sandbox running here.
    pub(super) fn agent_of(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Arc<AgentConnection>, RuntimeError> {
        Ok(Arc::clone(&self.get(sandbox)?.agent))
    }

    fn get(&self, sandbox: &SandboxId) -> Result<Arc<LocalSandbox>, RuntimeError> {
        self.sandboxes()
            .get(sandbox)
            .cloned()
            .ok_or_else(|| RuntimeError::NotFound(sandbox.clone()))
    }

    /// The images of this host.
    pub fn images(&self) -> &ImageCatalog {
        &self.config.images
    }

    fn new_container(
        &self,
        network: Option<&SandboxNetwork>,
        image: &Image,
    ) -> Result<(String, PathBuf), RuntimeError> {
        let id = format!("sbx{}", uuid::Uuid::new_v4().simple());
        let dir = self.config.state_dir.join("containers").join(&id);
        let failed =
            |err: std::io::Error| RuntimeError::Failed(format!("cannot write the bundle: {err}"));
        let bundle_network = match (network, &self.network) {
            (Some(network), Some(host)) => {
                let resolv_conf = dir.join("resolv.conf");
                std::fs::create_dir_all(&dir).map_err(failed)?;
                std::fs::write(&resolv_conf, host.resolv_conf()).map_err(failed)?;
                Some(BundleNetwork {
                    netns: network.netns_path(),
                    resolv_conf,
                })
            }
            _ => None,
        };
        self.config
            .bundle
            .write_with(&dir.join("bundle"), &image.rootfs, bundle_network.as_ref())
            .map_err(failed)?;
        Ok((id, dir))
    }

    fn launch_network(&self, network: Option<&SandboxNetwork>) -> LaunchNetwork {
        match (network, &self.network) {
            (Some(_), Some(host)) => LaunchNetwork::Sandbox {
                wrap: host.wrap_runsc(),
            },
            _ => LaunchNetwork::None,
        }
    }

    /// Starts (`image_dir: None`) or restores a container and connects to its agent.
    async fn launch(
        &self,
        sandbox: &SandboxId,
        container_id: &str,
        dir: &Path,
        image_dir: Option<&Path>,
        network: Option<&SandboxNetwork>,
    ) -> Result<Arc<AgentConnection>, RuntimeError> {
        let launch_network = self.launch_network(network);
        let failed = |err: std::io::Error| {
            RuntimeError::Failed(format!("cannot set up the agent channel: {err}"))
        };
        let (command_reader, command_writer) = std::io::pipe().map_err(failed)?;
        let (event_reader, event_writer) = std::io::pipe().map_err(failed)?;
        let log = dir.join("init.log");
        let stdio = InitStdio {
            stdin: OwnedFd::from(command_reader),
            stdout: OwnedFd::from(event_writer),
            stderr: std::fs::File::create(&log).map_err(failed)?,
        };
        let bundle = dir.join("bundle");
        let launched = match image_dir {
            None => {
                self.config
                    .runsc
                    .run_detached(&bundle, container_id, launch_network, stdio, &log)
                    .await
            }
            Some(image) => {
                self.config
                    .runsc
                    .restore_detached(&bundle, image, container_id, launch_network, stdio, &log)
                    .await
            }
        };
        if let Err(err) = launched {
            self.delete_in_background(container_id.to_owned(), dir.to_owned());
            return Err(RuntimeError::Failed(err.to_string()));
        }
        let commands =
            pipe::Sender::from_owned_fd(OwnedFd::from(command_writer)).map_err(failed)?;
        let events = pipe::Receiver::from_owned_fd(OwnedFd::from(event_reader)).map_err(failed)?;
        let (agent, hello) = AgentConnection::start(commands, events);
        let ready = match image_dir {
            // A fresh agent says hello once it is up.
            None => match tokio::time::timeout(AGENT_READY_TIMEOUT, hello).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(_)) => Err(AgentError::Gone),
                Err(_) => Err(AgentError::Timeout(AGENT_READY_TIMEOUT)),
            },
            // A restored one is mid-loop: ask.
            Some(_) => agent
                .request(json!({"op": "ping"}), AGENT_READY_TIMEOUT)
                .await
                .map(drop),
        };
        if let Err(err) = ready {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            self.delete_in_background(container_id.to_owned(), dir.to_owned());
            return Err(RuntimeError::Failed(format!(
                "the agent of sandbox {sandbox} did not come up: {err}; init log: {}",
                log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
            )));
        }
        Ok(agent)
    }

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
        self.sandboxes().insert(sandbox.clone(), Arc::clone(&local));
        local
    }

    /// After a restore: takes up the execution the checkpoint kept (its
    /// journal), routes its events, and lets the agent go on (replaying what
    /// no client got). Nothing to take up is the usual case; an agent that
    /// cannot say (an image from before issue 17) has nothing either.
    async fn resume_executions(&self, sandbox: &SandboxId, local: &LocalSandbox) {
        let reply = match local
            .agent
            .request(json!({"op": "journals"}), Duration::from_secs(10))
            .await
        {
            Ok(reply) => reply,
            Err(err) => {
                tracing::debug!(%sandbox, %err, "no executions to resume");
                return;
            }
        };
        if !reply["paused"].as_bool().unwrap_or(false) {
            return;
        }
        let newest = reply["executions"]
            .as_array()
            .and_then(|executions| executions.last())
            .and_then(|execution| {
                Some((
                    execution["id"].as_str()?.to_owned(),
                    execution["acked"].as_u64().unwrap_or(0),
                    execution["running"].as_bool().unwrap_or(false),
                ))
            });
        if let Some((id, acked, running)) = newest {
            match local.agent.adopt_exec(&id) {
                Ok(events) => {
                    if running {
                        local
                            .current_exec
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .exec = Some(id.clone());
                    }
                    let gate = DeliveryGate::new(id.clone(), acked, local.agent.clone());
                    local.set_gate(Some(Arc::clone(&gate)));
                    let execution = relay_execution(local, id, events, Some(gate));
                    self.resumed
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(sandbox.clone(), execution);
                    tracing::info!(%sandbox, running, acked, "execution resumed with the sandbox");
                }
                Err(err) => tracing::warn!(%sandbox, %err, "cannot take up the kept execution"),
            }
        }
        if let Err(err) = local
            .agent
            .request(
                json!({"op": "resume", "replay": true}),
                Duration::from_secs(10),
            )
            .await
        {
            tracing::warn!(%sandbox, %err, "resuming the kept execution failed");
        }
    }

    /// A checkpoint that kept the execution failed, the sandbox still runs
    /// here: delivery and the agent go on where they stopped.
    async fn resume_after_failure(&self, local: &LocalSandbox) {
        if let Some(gate) = local.gate() {
            gate.thaw();
            local.agent.suspend(gate.exec(), false);
        }
        if let Err(err) = local
            .agent
            .request(
                json!({"op": "resume", "replay": false}),
                Duration::from_secs(10),
            )
            .await
        {
            tracing::warn!(%err, "resuming executions after a failed checkpoint failed");
        }
    }

    /// Reserves `sandbox` for a create or restore; the reservation ends when the
    /// returned guard drops (after `register` on success).
    fn claim(&self, sandbox: &SandboxId) -> Result<Reservation<'_>, RuntimeError> {
        let mut reserved = self.reserved.lock().unwrap_or_else(PoisonError::into_inner);
        if self.sandboxes().contains_key(sandbox) || !reserved.insert(sandbox.clone()) {
            return Err(RuntimeError::AlreadyExists(sandbox.clone()));
        }
        Ok(Reservation {
            runtime: self,
            sandbox: sandbox.clone(),
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
        let running: Vec<SandboxId> = self.sandboxes().keys().cloned().collect();
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

    /// The manifest of the filesystem snapshot `name`.
    async fn snapshot_manifest(&self, name: &str) -> Result<SnapshotManifest, RuntimeError> {
        let invalid = || RuntimeError::Invalid(format!("invalid snapshot name {name:?}"));
        let manifest_key = snapshot_manifest_key(name).ok_or_else(invalid)?;
        match self.snapshots.get(&manifest_key).await {
            Ok(object) => {
                decode(&object.data).map_err(|err| RuntimeError::Invalid(err.to_string()))
            }
            Err(controllers::store::StoreError::NotFound { .. }) => Err(RuntimeError::Invalid(
                format!("no filesystem snapshot named {name:?}"),
            )),
            Err(err) => Err(err.into()),
        }
    }

    /// The image a create asks for: `"image"` if given, else the image the
    /// snapshot it starts from was taken on (its files may need that image's
    /// programs), else the default.
    async fn image_for_create(
        &self,
        requested: Option<&str>,
        snapshot: Option<&SnapshotManifest>,
    ) -> Result<Image, RuntimeError> {
        let images = &self.config.images;
        let invalid = |err: super::catalog::ImageError| RuntimeError::Invalid(err.to_string());
        match (requested, snapshot.and_then(|s| s.sandbox_image.as_deref())) {
            (Some(name), _) => images.resolve(name).map_err(invalid),
            (None, Some(digest)) => self.image_by_digest(digest).await.map_err(|err| {
                RuntimeError::Invalid(format!(
                    "the filesystem snapshot was taken on sandbox image {digest}, which this \
                     server does not have ({err}); name an image with \"image\" to use another"
                ))
            }),
            (None, None) => images.default_image().map_err(invalid),
        }
    }

    /// The image `digest`: here, or fetched once from the checkpoint store.
    async fn image_by_digest(&self, digest: &str) -> Result<Image, String> {
        let images = &self.config.images;
        let missing = match images.resolve(digest) {
            Ok(image) => return Ok(image),
            Err(err) => err,
        };
        let _one_at_a_time = self.image_fetch.lock().await;
        super::image_store::fetch(
            images,
            self.checkpoints.as_ref(),
            digest,
            &self.config.state_dir.join("image-transfer"),
        )
        .await
        .map_err(|err| format!("{missing}; {err}"))
    }

    /// The image a checkpoint restores onto: the digest it recorded, which
    /// must be here.
    async fn image_for_restore(
        &self,
        manifest: &CheckpointManifest,
    ) -> Result<Image, RuntimeError> {
        let Some(digest) = manifest.sandbox_image.as_deref() else {
            return Err(RuntimeError::Incompatible(
                "the checkpoint records no sandbox image: it was taken on the host's root \
                 filesystem (before sandbox images) and cannot be restored onto an image"
                    .to_owned(),
            ));
        };
        self.image_by_digest(digest).await.map_err(|err| {
            let default = match self.config.images.default_image() {
                Ok(image) => format!("; this server's default image is {}", image.digest),
                Err(_) => String::new(),
            };
            RuntimeError::Incompatible(format!(
                "it was taken on sandbox image {digest}, which this server does not have \
                 ({err}){default}"
            ))
        })
    }

    /// Downloads a snapshot archive into a file under the state directory.
    async fn download_snapshot(
        &self,
        manifest: &SnapshotManifest,
    ) -> Result<PathBuf, RuntimeError> {
        let key = controllers::store::ObjectKey::new(manifest.archive.key.as_str())
            .map_err(|err| RuntimeError::Invalid(err.to_string()))?;
        let local = self
            .config
            .state_dir
            .join(format!("snapshot-{}.tar.gz", uuid::Uuid::new_v4().simple()));
        let downloaded = download_verified(
            self.snapshots.as_ref(),
            &key,
            &local,
            &manifest.archive.sha256,
            manifest.archive.size,
        )
        .await;
        if let Err(err) = downloaded {
            let _ = tokio::fs::remove_file(&local).await;
            return Err(err);
        }
        Ok(local)
    }

    /// Streams a snapshot archive into a fresh sandbox's agent, which unpacks it.
    async fn populate_from_snapshot(
        &self,
        agent: &AgentConnection,
        manifest: &SnapshotManifest,
    ) -> Result<(), RuntimeError> {
        let local = self.download_snapshot(manifest).await?;
        let result = self.send_archive(agent, &local).await;
        let _ = tokio::fs::remove_file(&local).await;
        result
    }

    async fn send_archive(&self, agent: &AgentConnection, path: &Path) -> Result<(), RuntimeError> {
        use tokio::io::AsyncReadExt;
        let agent_error =
            |err: AgentError| RuntimeError::Failed(format!("restoring the snapshot: {err}"));
        let read_error =
            |err: std::io::Error| RuntimeError::Failed(format!("reading the snapshot: {err}"));
        let mut file = tokio::fs::File::open(path).await.map_err(read_error)?;
        let id = agent.new_id("x");
        let mut buffer = vec![0u8; 256 * 1024];
        loop {
            let n = file.read(&mut buffer).await.map_err(read_error)?;
            if n == 0 {
                break;
            }
            agent
                .send(
                    &json!({"op": "extract_chunk", "id": id, "data": BASE64.encode(&buffer[..n])}),
                )
                .await
                .map_err(agent_error)?;
        }
        agent
            .request_with_id(&id, json!({"op": "extract_end"}), Duration::from_secs(300))
            .await
            .map_err(agent_error)?;
        Ok(())
    }

    /// Restores the image into a new container, verified: downloaded and
    /// hashed in one pass from a remote store; used in place (a hard link)
    /// from a directory store and hashed while runsc reads it, the container
    /// destroyed before anyone can use it if the digest is wrong.
    async fn restore_into(
        &self,
        sandbox: &SandboxId,
        manifest: &CheckpointManifest,
        key: &controllers::store::ObjectKey,
        network: Option<&SandboxNetwork>,
        image: &Image,
    ) -> Result<(String, PathBuf, Arc<AgentConnection>), RuntimeError> {
        let (container_id, dir) = self.new_container(network, image)?;
        let image_dir = dir.join("restore");
        tokio::fs::create_dir_all(&image_dir).await.map_err(|err| {
            RuntimeError::Failed(format!("cannot create {}: {err}", image_dir.display()))
        })?;
        let image = image_dir.join("checkpoint.img");
        let in_place = match self.checkpoints.local_path(key) {
            Some(stored) => link_stored_image(key, &stored, &image, manifest.image.size)
                .await
                .map(Some),
            None => download_verified(
                self.checkpoints.as_ref(),
                key,
                &image,
                &manifest.image.sha256,
                manifest.image.size,
            )
            .await
            .map(|()| None),
        };
        let hashing = match in_place {
            Ok(hashing) => hashing,
            Err(err) => {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                return Err(err);
            }
        };
        let quota_watch = cpu_quota::QuotaWatch::start(
            PathBuf::from(cpu_quota::CGROUP_ROOT),
            container_id.clone(),
        );
        let launching = self.launch(sandbox, &container_id, &dir, Some(&image_dir), network);
        let (launched, digest) = match hashing {
            Some(file) => {
                let (launched, digest) = tokio::join!(launching, sha256_of(file));
                (launched, Some(digest))
            }
            None => (launching.await, None),
        };
        quota_watch.end().await;
        let refused = match digest {
            Some(Ok(actual)) => mismatch(
                key.as_str(),
                (&actual.0, actual.1),
                &manifest.image.sha256,
                manifest.image.size,
            ),
            Some(Err(err)) => Some(RuntimeError::Failed(format!(
                "reading the checkpoint image {key}: {err}"
            ))),
            None => None,
        };
        if let Some(err) = refused {
            match launched {
                Ok(_) => self.delete_in_background(container_id, dir),
                Err(_) => {
                    let _ = tokio::fs::remove_dir_all(&dir).await;
                }
            }
            return Err(err);
        }
        let agent = match launched {
            Ok(agent) => agent,
            Err(RuntimeError::Failed(detail)) => {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                return Err(RuntimeError::Incompatible(detail));
            }
            Err(err) => return Err(err),
        };
        // runsc restores eagerly: the image (or its link) is no longer needed.
        let _ = tokio::fs::remove_dir_all(&image_dir).await;
        Ok((container_id, dir, agent))
    }

    /// The checkpoint proper, with the execution slot held.
    async fn checkpoint_held(
        &self,
        sandbox: &SandboxId,
        local: &LocalSandbox,
        request: CheckpointRequest,
    ) -> Result<CheckpointManifest, RuntimeError> {
        // A checkpoint the network guard would refuse anyway is refused before
        // the agent kills anything (a forced one kills the running execution).
        if let (Some(network), Some(host)) = (&local.network, &self.network) {
            network::checkpoint::refuse_if_hopeless(host, network)
                .await
                .map_err(|err| RuntimeError::Failed(format!("cannot checkpoint now: {err}")))?;
        }
        // Keeping executions: nothing more is delivered here; the agent drops
        // what was, pauses the rest and keeps it in the image.
        let keep = request.keep_executions;
        let mut prepare = json!({"op": "prepare_checkpoint", "force": request.force, "keep": keep});
        if keep && let Some(gate) = local.gate() {
            let delivered = gate.freeze().await;
            local.agent.suspend(gate.exec(), true);
            prepare["acked"] = json!({ gate.exec(): delivered });
        }
        let prepared = local.agent.request(prepare, Duration::from_secs(10)).await;
        match prepared {
            // Anything still listed as running would be frozen mid-way.
            Ok(reply)
                if reply["running"]
                    .as_array()
                    .is_some_and(|running| !running.is_empty()) =>
            {
                return Err(RuntimeError::ExecutionInProgress(sandbox.clone()));
            }
            Ok(_) => {}
            Err(AgentError::Refused(_)) => {
                return Err(RuntimeError::ExecutionInProgress(sandbox.clone()));
            }
            Err(err) => {
                return Err(RuntimeError::Failed(format!(
                    "preparing the checkpoint: {err}"
                )));
            }
        }

        if let (Some(network), Some(host)) = (&local.network, &self.network) {
            network::checkpoint::quiesce(host, network, &local.agent)
                .await
                .map_err(|err| RuntimeError::Failed(format!("cannot checkpoint now: {err}")))?;
        }
        // On a directory store runsc writes the image where the store keeps
        // its files (taking it is then a rename) and the follower flushes it
        // to disk as it goes; elsewhere into the sandbox's own directory.
        let staging = self.checkpoints.staging_dir();
        let image_dir = staging
            .as_deref()
            .unwrap_or(&local.dir)
            .join(format!("checkpoint-{}-{}", sandbox, request.checkpoint_id));
        let image = image_dir.join("checkpoint.img");
        let follower = ImageFollower::start(image.clone(), staging.is_some());
        // The sentry compresses the memory on every core it may use; no user
        // code runs meanwhile (see `cpu_quota`).
        let lifted_quota = cpu_quota::lift(Path::new(cpu_quota::CGROUP_ROOT), &local.container_id);
        let checkpointed = self
            .config
            .runsc
            .checkpoint(&local.container_id, &image_dir)
            .await;
        if let Err(err) = checkpointed {
            follower.abandon().await;
            let _ = tokio::fs::remove_dir_all(&image_dir).await;
            // A checkpoint that fails inside the sentry stops the container:
            // ask runsc whether it still runs.
            let still_running = matches!(
                self.config
                    .runsc
                    .state(&local.container_id)
                    .await
                    .as_deref(),
                Ok("running")
            );
            if !still_running {
                self.sandboxes().remove(sandbox);
                self.delete_and_detach_in_background(
                    local.container_id.clone(),
                    local.dir.clone(),
                    local.network.clone(),
                );
                return Err(RuntimeError::Lost {
                    sandbox: sandbox.clone(),
                    detail: format!("checkpoint failed and stopped the sandbox: {err}"),
                });
            }
            if let Some(quota) = lifted_quota {
                quota.restore();
            }
            if let Some(network) = &local.network {
                network::checkpoint::resume(network).await;
            }
            return Err(RuntimeError::Failed(format!(
                "checkpoint failed, sandbox still running: {err}"
            )));
        }
        // The container is stopped now: it no longer runs here.
        self.sandboxes().remove(sandbox);
        let upload = async {
            let (sha256, size) = follower.finish().await.map_err(|err| {
                RuntimeError::Failed(format!("hashing the checkpoint image: {err}"))
            })?;
            let key = checkpoint_image_key(&request.checkpoint_id);
            // A rename on a directory store; the upload, from the page cache,
            // to GCS.
            self.checkpoints.adopt_blob(&key, image.clone()).await?;
            let manifest = CheckpointManifest {
                api_version: API_VERSION.to_owned(),
                checkpoint_id: request.checkpoint_id.to_string(),
                sandbox_id: sandbox.clone(),
                epoch: request.epoch,
                name: request.name.clone(),
                created_at: Utc::now(),
                image: BlobDigest {
                    key: key.to_string(),
                    size,
                    sha256,
                },
                runsc_version: self.runsc_version.clone(),
                platform: self.config.runsc.platform.clone(),
                cpu_features: self.cpu_features.clone(),
                network: if local.network.is_some() {
                    NetworkMode::Egress
                } else {
                    NetworkMode::None
                },
                sandbox_image: Some(local.image.digest.clone()),
                extra: ExtraFields::new(),
            };
            create_idempotent(
                self.checkpoints.as_ref(),
                &checkpoint_manifest_key(&request.checkpoint_id),
                encode(&manifest),
            )
            .await?;
            Ok::<_, RuntimeError>(manifest)
        }
        .await;
        match upload {
            Ok(manifest) => {
                if staging.is_some() {
                    let _ = tokio::fs::remove_dir_all(&image_dir).await;
                }
                self.delete_and_detach_in_background(
                    local.container_id.clone(),
                    local.dir.clone(),
                    local.network.clone(),
                );
                Ok(manifest)
            }
            Err(err) => {
                // Keep the image: it is the only copy of the sandbox. It goes
                // where startup cleanup does not reach.
                let kept = self
                    .config
                    .state_dir
                    .join("orphaned-checkpoints")
                    .join(format!("{}-{}.img", sandbox, request.checkpoint_id));
                let moved = match kept.parent() {
                    Some(parent) => tokio::fs::create_dir_all(parent)
                        .await
                        .and(tokio::fs::rename(&image, &kept).await),
                    None => Err(std::io::Error::other("no parent directory")),
                };
                let kept_at = if moved.is_ok() { kept } else { image.clone() };
                tracing::error!(%err, image = %kept_at.display(), "checkpoint upload failed; image kept");
                self.delete_and_detach_in_background(
                    local.container_id.clone(),
                    local.dir.clone(),
                    local.network.clone(),
                );
                Err(RuntimeError::Lost {
                    sandbox: sandbox.clone(),
                    detail: format!(
                        "the checkpoint could not be stored ({err}); the image is kept at {}",
                        kept_at.display()
                    ),
                })
            }
        }
    }
}

/// Puts a directory store's image at `image` without copying it (a hard
/// link, or a symbolic link across filesystems) after checking its size, and
/// returns it open for hashing.
async fn link_stored_image(
    key: &controllers::store::ObjectKey,
    stored: &Path,
    image: &Path,
    expected_size: u64,
) -> Result<std::fs::File, RuntimeError> {
    let file = match std::fs::File::open(stored) {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(controllers::store::StoreError::not_found(key).into());
        }
        Err(err) => {
            return Err(RuntimeError::Failed(format!(
                "reading the checkpoint image {key}: {err}"
            )));
        }
    };
    let size = file
        .metadata()
        .map_err(|err| RuntimeError::Failed(format!("reading the checkpoint image {key}: {err}")))?
        .len();
    if let Some(err) = mismatch(key.as_str(), ("", size), "", expected_size) {
        return Err(err);
    }
    let linked = match tokio::fs::hard_link(stored, image).await {
        Err(err) if err.kind() == std::io::ErrorKind::CrossesDevices => {
            tokio::fs::symlink(stored, image).await
        }
        other => other,
    };
    linked.map_err(|err| {
        RuntimeError::Failed(format!(
            "cannot link the checkpoint image {} to {}: {err}",
            stored.display(),
            image.display()
        ))
    })?;
    Ok(file)
}

/// A create or restore in progress for one sandbox id.
struct Reservation<'a> {
    runtime: &'a GvisorRuntime,
    sandbox: SandboxId,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.runtime
            .reserved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.sandbox);
    }
}

/// Controls one execution through the agent.
#[derive(Debug)]
struct AgentExecControl {
    agent: Arc<AgentConnection>,
    id: String,
    /// Resumable executions only.
    gate: Option<Arc<DeliveryGate>>,
}

#[async_trait]
impl ExecControl for AgentExecControl {
    async fn write_stdin(&self, data: Bytes) -> Result<(), RuntimeError> {
        self.agent
            .send(&json!({"op": "stdin", "id": self.id, "data": BASE64.encode(&data)}))
            .await
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    async fn close_stdin(&self) -> Result<(), RuntimeError> {
        self.agent
            .send(&json!({"op": "stdin_close", "id": self.id}))
            .await
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    async fn kill(&self) -> Result<(), RuntimeError> {
        self.agent
            .send(&json!({"op": "kill", "id": self.id}))
            .await
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    fn begin_delivery(&self, _event: u64) -> bool {
        self.gate.as_ref().is_none_or(|gate| gate.begin())
    }

    fn end_delivery(&self, event: u64, delivered: bool) {
        if let Some(gate) = &self.gate {
            gate.end(event, delivered);
        }
    }

    fn dropped(&self, event: u64) {
        if let Some(gate) = &self.gate {
            gate.dropped(event);
        }
    }
}

/// Relays an execution's events from the agent to the returned
/// [`Execution`], freeing the execution slot the moment the exit is seen.
fn relay_execution(
    local: &LocalSandbox,
    id: String,
    mut agent_events: mpsc::UnboundedReceiver<Sequenced>,
    gate: Option<Arc<DeliveryGate>>,
) -> Execution {
    let (tx, rx) = mpsc::channel(64);
    let slot = local.current_exec.clone();
    let relay_id = id.clone();
    let numbering = gate.clone();
    tokio::spawn(async move {
        // Frees the slot only if it still names this execution.
        let release = || {
            let mut current = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if current.exec.as_deref() == Some(relay_id.as_str()) {
                current.exec = None;
            }
        };
        let mut count = 0;
        while let Some((seq, event)) = agent_events.recv().await {
            count += 1;
            if let Some(gate) = &numbering
                && seq != gate.seq(count)
            {
                // The API counts events; a gap would make it acknowledge
                // the wrong ones.
                tracing::warn!(execution = %relay_id, seq, expected = gate.seq(count), "resumable execution's events out of sequence");
            }
            let exited = matches!(event, ExecEvent::Exited(_));
            if exited {
                release();
            }
            let _ = tx.send(event).await;
            if exited {
                return;
            }
        }
        release();
    });
    Execution {
        events: rx,
        control: Box::new(AgentExecControl {
            agent: local.agent.clone(),
            id,
            gate,
        }),
    }
}

/// Creates an object that must not exist yet. A precondition failure whose
/// object holds exactly these bytes was this call's own write, retried after a
/// lost response: success.
async fn create_idempotent(
    store: &dyn Store,
    key: &controllers::store::ObjectKey,
    data: Bytes,
) -> Result<(), controllers::store::StoreError> {
    match store.put(key, data.clone(), PutMode::Create).await {
        Ok(_) => Ok(()),
        Err(err @ controllers::store::StoreError::PreconditionFailed { .. }) => {
            match store.get(key).await {
                Ok(existing) if existing.data == data => Ok(()),
                _ => Err(err),
            }
        }
        Err(err) => Err(err),
    }
}

fn exec_command(request: &ExecRequest, python: &str) -> Value {
    let mut command = match &request.command {
        Command::Bash(code) => json!({"op": "exec", "argv": ["bash", "-c", code]}),
        Command::Python(code) => json!({"op": "exec", "argv": [python, "-u", "-c", code]}),
        Command::PythonSession(code) => json!({"op": "exec", "session": true, "code": code}),
    };
    if !request.env.is_empty() {
        command["env"] = json!(request.env);
    }
    if let Some(cwd) = &request.cwd {
        command["cwd"] = json!(cwd);
    }
    if request.resumable {
        command["resumable"] = json!(true);
    }
    command
}

#[async_trait]
impl SandboxRuntime for GvisorRuntime {
    #[tracing::instrument(skip(self, options), fields(sandbox = %sandbox))]
    async fn create(
        &self,
        sandbox: &SandboxId,
        options: &CreateOptions,
    ) -> Result<(), RuntimeError> {
        let _reservation = self.claim(sandbox)?;
        // Refuse a bad image or snapshot before any container starts.
        let snapshot = match &options.snapshot_name {
            Some(name) => Some(self.snapshot_manifest(name).await?),
            None => None,
        };
        let image = self
            .image_for_create(options.image.as_deref(), snapshot.as_ref())
            .await?;
        let network = self.attach_network(options.network).await?;
        let started = async {
            let (container_id, dir) = self.new_container(network.as_ref(), &image)?;
            let agent = self
                .launch(sandbox, &container_id, &dir, None, network.as_ref())
                .await?;
            Ok::<_, RuntimeError>((container_id, dir, agent))
        }
        .await;
        let (container_id, dir, agent) = match started {
            Ok(started) => started,
            Err(err) => {
                self.detach_network(network).await;
                return Err(err);
            }
        };
        if let Some(snapshot) = &snapshot
            && let Err(err) = self.populate_from_snapshot(&agent, snapshot).await
        {
            self.delete_and_detach_in_background(container_id, dir, network);
            return Err(err);
        }
        self.register(sandbox, container_id, dir, agent, network, image);
        Ok(())
    }

    #[tracing::instrument(skip(self, request), fields(sandbox = %sandbox))]
    async fn exec(
        &self,
        sandbox: &SandboxId,
        request: ExecRequest,
    ) -> Result<Execution, RuntimeError> {
        let local = self.get(sandbox)?;
        let id = local.agent.new_id("e");
        {
            let mut current = local
                .current_exec
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if current.checkpointing {
                return Err(RuntimeError::Checkpointing(sandbox.clone()));
            }
            if current.exec.is_some() {
                return Err(RuntimeError::ExecutionInProgress(sandbox.clone()));
            }
            current.exec = Some(id.clone());
        }
        let started = local
            .agent
            .start_exec(&id, exec_command(&request, &self.config.bundle.python))
            .await;
        let agent_events = match started {
            Ok(events) => events,
            Err(err) => {
                {
                    let mut current = local
                        .current_exec
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    if current.exec.as_deref() == Some(id.as_str()) {
                        current.exec = None;
                    }
                }
                return Err(match err {
                    AgentError::Gone => RuntimeError::Lost {
                        sandbox: sandbox.clone(),
                        detail: "the sandbox stopped".to_owned(),
                    },
                    other => RuntimeError::Failed(other.to_string()),
                });
            }
        };
        let gate = request
            .resumable
            .then(|| DeliveryGate::new(id.clone(), 0, local.agent.clone()));
        if request.resumable {
            // The agent journals only the newest resumable execution.
            local.set_gate(gate.clone());
        }
        Ok(relay_execution(&local, id, agent_events, gate))
    }

    #[tracing::instrument(skip(self, request), fields(sandbox = %sandbox, checkpoint = %request.checkpoint_id))]
    async fn checkpoint(
        &self,
        sandbox: &SandboxId,
        request: CheckpointRequest,
    ) -> Result<CheckpointManifest, RuntimeError> {
        if let Some(name) = &request.name
            && !is_resource_name(name)
        {
            return Err(RuntimeError::Invalid(format!(
                "invalid checkpoint name {name:?}"
            )));
        }
        let local = self.get(sandbox)?;
        {
            let mut current = local
                .current_exec
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if current.checkpointing {
                return Err(RuntimeError::Failed(format!(
                    "sandbox {sandbox} is already being checkpointed"
                )));
            }
            // A forced checkpoint kills the running execution (its relay
            // frees the slot when it ends).
            if current.exec.is_some() && !request.force && !request.keep_executions {
                return Err(RuntimeError::ExecutionInProgress(sandbox.clone()));
            }
            current.checkpointing = true;
        }
        let keep = request.keep_executions;
        let outcome = self.checkpoint_held(sandbox, &local, request).await;
        if outcome.is_err() {
            let still_here = self
                .sandboxes()
                .get(sandbox)
                .is_some_and(|current| Arc::ptr_eq(current, &local));
            if keep && still_here {
                self.resume_after_failure(&local).await;
            }
            local
                .current_exec
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .checkpointing = false;
        } else {
            // Not taken here: it went on with the checkpoint.
            self.resumed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(sandbox);
        }
        outcome
    }

    #[tracing::instrument(skip(self, manifest), fields(sandbox = %sandbox, checkpoint = %manifest.checkpoint_id))]
    async fn restore(
        &self,
        sandbox: &SandboxId,
        manifest: &CheckpointManifest,
    ) -> Result<(), RuntimeError> {
        let _reservation = self.claim(sandbox)?;
        check_cpu_features(&manifest.cpu_features, &self.cpu_features)?;
        // The files open at checkpoint time must be byte-identical: only the
        // very image the checkpoint was taken on will do.
        let image = self.image_for_restore(manifest).await?;
        let key = controllers::store::ObjectKey::new(manifest.image.key.as_str())
            .map_err(|err| RuntimeError::Invalid(err.to_string()))?;
        // A fresh namespace and address on this host, whatever the old ones were.
        let network = match self.attach_network(manifest.network).await {
            Err(RuntimeError::Invalid(detail)) => return Err(RuntimeError::Incompatible(detail)),
            other => other?,
        };
        let restored = self
            .restore_into(sandbox, manifest, &key, network.as_ref(), &image)
            .await;
        match restored {
            Ok((container_id, dir, agent)) => {
                let local = self.register(sandbox, container_id, dir, agent, network, image);
                self.resume_executions(sandbox, &local).await;
                Ok(())
            }
            Err(err) => {
                self.detach_network(network).await;
                Err(err)
            }
        }
    }

    #[tracing::instrument(skip(self), fields(sandbox = %sandbox))]
    async fn snapshot_filesystem(
        &self,
        sandbox: &SandboxId,
        name: &str,
    ) -> Result<SnapshotManifest, RuntimeError> {
        let invalid = || {
            RuntimeError::Invalid(format!(
                "invalid snapshot name {name:?}: {}",
                controllers::api::RESOURCE_NAME_RULE
            ))
        };
        let archive_id = SandboxId::from_u128(uuid::Uuid::new_v4().as_u128());
        let archive_key = snapshot_archive_key(name, &archive_id).ok_or_else(invalid)?;
        let manifest_key = snapshot_manifest_key(name).ok_or_else(invalid)?;
        let local = self.get(sandbox)?;
        let (mut chunks, done) = local
            .agent
            .start_archive(json!({"op": "archive", "paths": SNAPSHOT_PATHS}))
            .await
            .map_err(|err| RuntimeError::Failed(format!("starting the snapshot: {err}")))?;
        let path = self
            .config
            .state_dir
            .join(format!("snapshot-{}.tar.gz", uuid::Uuid::new_v4().simple()));
        let io = |err: std::io::Error| RuntimeError::Failed(format!("writing the snapshot: {err}"));
        let written = async {
            let mut file = tokio::fs::File::create(&path).await?;
            while let Some(chunk) = chunks.recv().await {
                file.write_all(&chunk).await?;
            }
            file.flush().await
        }
        .await;
        if let Err(err) = written {
            let _ = tokio::fs::remove_file(&path).await;
            return Err(io(err));
        }
        let result = async {
            let reply = done
                .await
                .map_err(|_| RuntimeError::Lost {
                    sandbox: sandbox.clone(),
                    detail: "the sandbox stopped during the snapshot".to_owned(),
                })?
                .map_err(|message| RuntimeError::Failed(format!("snapshot failed: {message}")))?;
            let (sha256, size) = sha256_file(&path).await.map_err(io)?;
            self.snapshots
                .upload_blob(&archive_key, BlobSource::File(path.clone()))
                .await?;
            let manifest = SnapshotManifest {
                api_version: API_VERSION.to_owned(),
                name: name.to_owned(),
                source_sandbox: sandbox.clone(),
                created_at: Utc::now(),
                archive: BlobDigest {
                    key: archive_key.to_string(),
                    size,
                    sha256,
                },
                entries: reply["entries"].as_u64().unwrap_or(0),
                sandbox_image: Some(local.image.digest.clone()),
                extra: ExtraFields::new(),
            };
            self.snapshots
                .put(&manifest_key, encode(&manifest), PutMode::Overwrite)
                .await?;
            Ok(manifest)
        }
        .await;
        let _ = tokio::fs::remove_file(&path).await;
        result
    }

    #[tracing::instrument(skip(self), fields(sandbox = %sandbox))]
    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), RuntimeError> {
        self.resumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(sandbox);
        let local = self
            .sandboxes()
            .remove(sandbox)
            .ok_or_else(|| RuntimeError::NotFound(sandbox.clone()))?;
        self.delete_and_detach_in_background(
            local.container_id.clone(),
            local.dir.clone(),
            local.network.clone(),
        );
        Ok(())
    }

    fn is_running(&self, sandbox: &SandboxId) -> bool {
        self.sandboxes()
            .get(sandbox)
            .is_some_and(|local| !local.agent.is_gone())
    }

    fn take_resumed(&self, sandbox: &SandboxId) -> Option<Execution> {
        self.resumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(sandbox)
    }
}
