//! Starting and restoring a sandbox's container and connecting to its agent:
//! the bundle of a new container, `runsc run`/`runsc restore` with the
//! agent's stdio as the channel, the agent's protocol version checked at
//! connect (a checkpoint's recorded one before a restore), and the image a
//! restore needs verified (hashed beside `runsc restore`, or downloaded).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use controllers::api::{CheckpointManifest, NetworkMode, SandboxId};
use controllers::runtime::RuntimeError;
use tokio::net::unix::pipe;

use super::prefetch::Downloaded;
use super::{AGENT_READY_TIMEOUT, GvisorRuntime};
use crate::runtime::agent::protocol::{
    AGENT_PROTOCOL_VERSION, OLDEST_AGENT_PROTOCOL_VERSION, Pong, Request,
};
use crate::runtime::agent::{AgentConnection, AgentError, check_version};
use crate::runtime::bundle::BundleNetwork;
use crate::runtime::checkpoint::cpu_quota;
use crate::runtime::checkpoint::transfer::{download_verified, mismatch, sha256_of};
use crate::runtime::images::catalog::Image;
use crate::runtime::images::ready::ReadyCommand;
use crate::runtime::network::SandboxNetwork;
use crate::runtime::runsc::{InitStdio, LaunchNetwork};

/// A started container: its id, directory, agent, network and image.
pub(super) type Launched = (
    String,
    PathBuf,
    Arc<AgentConnection>,
    Option<SandboxNetwork>,
    Image,
);

impl GvisorRuntime {
    /// A new container booted cold (the network set up first), with the
    /// image's start command run in it when it names one: what a create
    /// does without a warm sandbox or a ready checkpoint.
    pub(super) async fn launch_cold(
        &self,
        sandbox: &SandboxId,
        mode: NetworkMode,
        image: Image,
        start: Option<&ReadyCommand>,
    ) -> Result<Launched, RuntimeError> {
        let network = self.attach_network(mode).await?;
        let started = async {
            let (container_id, dir) = self.new_container(network.as_ref(), &image)?;
            let agent = self
                .launch(sandbox, &container_id, &dir, None, network.as_ref())
                .await?;
            if let Some(command) = start
                && let Err(err) = self.run_start_command(&agent, &image, command).await
            {
                self.delete_in_background(container_id, dir);
                return Err(err);
            }
            Ok::<_, RuntimeError>((container_id, dir, agent))
        }
        .await;
        match started {
            Ok((container_id, dir, agent)) => Ok((container_id, dir, agent, network, image)),
            Err(err) => {
                self.detach_network(network).await;
                Err(err)
            }
        }
    }

    pub(super) fn new_container(
        &self,
        network: Option<&SandboxNetwork>,
        image: &Image,
    ) -> Result<(String, PathBuf), RuntimeError> {
        let id = self.owner.container_id();
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

    pub(super) fn launch_network(&self, network: Option<&SandboxNetwork>) -> LaunchNetwork {
        match (network, &self.network) {
            (Some(_), Some(host)) => LaunchNetwork::Sandbox {
                wrap: host.wrap_runsc(),
            },
            _ => LaunchNetwork::None,
        }
    }

    /// Starts (`image_dir: None`) or restores a container and connects to its agent.
    pub(super) async fn launch(
        &self,
        sandbox: &(dyn std::fmt::Display + Sync),
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
        widen_pipe(&command_writer);
        widen_pipe(&event_reader);
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
                Ok(Ok(version)) => Ok(version),
                Ok(Err(_)) => Err(AgentError::Gone),
                Err(_) => Err(AgentError::Timeout(AGENT_READY_TIMEOUT)),
            },
            // A restored one is mid-loop: ask.
            Some(_) => agent
                .ask::<Pong>(Request::Ping, AGENT_READY_TIMEOUT)
                .await
                .map(|pong| pong.version),
        }
        .and_then(check_version);
        if let Ok(version) = ready {
            agent.set_version(version);
        }
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

    /// Restores the image into a new container, verified: downloaded and
    /// hashed in one pass from a remote store; used in place (a hard link)
    /// from a directory store and hashed while runsc reads it, the container
    /// destroyed before anyone can use it if the digest is wrong.
    pub(super) async fn restore_into(
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
        let prefetched = match self.prefetches.take(sandbox, key).await {
            Some(downloaded) => adopt_prefetched(key, &downloaded, manifest, &image).await,
            None => false,
        };
        let in_place = match self.checkpoints.local_path(key) {
            // Downloaded and hashed already, the digest the manifest's.
            _ if prefetched => Ok(None),
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

    /// The image a checkpoint restores onto: the digest it recorded, which
    /// must be here.
    pub(super) async fn image_for_restore(
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
}

/// Moves a prefetched image into place when it is the manifest's (size and
/// digest); otherwise removes it. True when it is in place.
async fn adopt_prefetched(
    key: &controllers::store::ObjectKey,
    downloaded: &Downloaded,
    manifest: &CheckpointManifest,
    image: &Path,
) -> bool {
    let wanted = (manifest.image.sha256.as_str(), manifest.image.size);
    if (downloaded.sha256.as_str(), downloaded.size) == wanted
        && tokio::fs::rename(&downloaded.path, image).await.is_ok()
    {
        tracing::debug!(%key, "restoring the image fetched before the transfer");
        return true;
    }
    tracing::info!(%key, "a prefetched image is not the checkpoint's: downloading it again");
    let _ = tokio::fs::remove_file(&downloaded.path).await;
    false
}

/// Puts a directory store's image at `image` without copying it (a hard
/// link, or a symbolic link across filesystems) after checking its size, and
/// returns it open for hashing.
pub(super) async fn link_stored_image(
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

/// Bytes an agent pipe holds: a 1 MiB file chunk passes in one write and
/// one read instead of sixteen (the default is 64 KiB), which under ptrace
/// is most of what moving it costs (decision 19). Linux lets anyone raise a
/// pipe to `/proc/sys/fs/pipe-max-size` (1 MiB by default).
const AGENT_PIPE_BYTES: usize = 1 << 20;

/// Raises a pipe's capacity to [`AGENT_PIPE_BYTES`]; a refusal only costs
/// speed.
fn widen_pipe(pipe: &impl std::os::fd::AsFd) {
    if let Err(err) = rustix::pipe::fcntl_setpipe_size(pipe, AGENT_PIPE_BYTES) {
        tracing::debug!(%err, "cannot widen an agent pipe");
    }
}

/// Refuses a checkpoint whose agent speaks a protocol version this host
/// does not: the agent comes back with the image, this host could not talk
/// to it. A manifest without the field predates recording it, when every
/// agent spoke version 1.
pub(super) fn check_agent_version(manifest: &CheckpointManifest) -> Result<(), RuntimeError> {
    let recorded = manifest.agent_version.unwrap_or(1);
    if (OLDEST_AGENT_PROTOCOL_VERSION..=AGENT_PROTOCOL_VERSION).contains(&recorded) {
        return Ok(());
    }
    Err(RuntimeError::Incompatible(format!(
        "its sandbox agent speaks protocol version {recorded}, and this server speaks versions \
         {OLDEST_AGENT_PROTOCOL_VERSION} to {AGENT_PROTOCOL_VERSION}"
    )))
}
