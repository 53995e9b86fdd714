//! Taking a checkpoint with the sandbox's execution slot held: the agent
//! prepares (executions killed, or paused and kept), an `egress` sandbox's
//! network is quiesced, `runsc checkpoint` writes the image (its CPU quota
//! lifted, a follower hashing and flushing the image as it is written), the
//! store takes it, and the manifest (with the runsc version, CPU features, image
//! digest and agent protocol version a restore checks) is written once.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use chrono::Utc;
use controllers::api::{
    API_VERSION, BlobDigest, CheckpointManifest, ExtraFields, NetworkMode, SandboxId, encode,
};
use controllers::layout::{checkpoint_image_key, checkpoint_manifest_key};
use controllers::runtime::{CheckpointRequest, RuntimeError};
use controllers::store::{PutMode, Store};

use super::prefetch::{self, Downloaded};
use super::{GvisorRuntime, Local, LocalSandbox};
use crate::runtime::agent::AgentError;
use crate::runtime::agent::protocol::{CheckpointReady, Request};
use crate::runtime::checkpoint::cpu_quota;
use crate::runtime::checkpoint::follower::ImageFollower;
use crate::runtime::network;

impl GvisorRuntime {
    /// The checkpoint proper, with the execution slot held.
    pub(super) async fn checkpoint_held(
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
        // In turns with the other checkpoints here (`checkpoint_permits`),
        // taken before anything is prepared: a sandbox waiting its turn keeps
        // running, its output still delivered.
        let permit = self
            .checkpoint_permits
            .acquire()
            .await
            .map_err(|err| RuntimeError::Failed(format!("checkpoint turn: {err}")))?;
        // Keeping executions: nothing more is delivered here; the agent drops
        // what was, pauses the rest and keeps it in the image.
        let keep = request.keep_executions;
        let mut acked = None;
        if keep && let Some(gate) = local.gate() {
            let delivered = gate.freeze().await;
            local.agent.suspend(gate.exec(), true);
            acked = Some(BTreeMap::from([(gate.exec().to_owned(), delivered)]));
        }
        let prepare = Request::PrepareCheckpoint {
            force: request.force,
            keep,
            acked,
        };
        let prepared = local
            .agent
            .ask::<CheckpointReady>(prepare, Duration::from_secs(10))
            .await;
        match prepared {
            // Anything still listed as running would be frozen mid-way.
            Ok(reply) if !reply.running.is_empty() => {
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
        drop(permit);
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
                self.locals.step(sandbox, Local::stop);
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
        // The container is stopped now: it no longer runs here (nor does
        // an execution a restore brought back and nobody took).
        self.locals.step(sandbox, Local::stop);
        let agent_version = local.agent.version();
        let upload = async {
            let (sha256, size) = follower.finish().await.map_err(|err| {
                RuntimeError::Failed(format!("hashing the checkpoint image: {err}"))
            })?;
            let key = checkpoint_image_key(&request.checkpoint_id);
            let manifest = CheckpointManifest {
                api_version: API_VERSION.to_owned(),
                checkpoint_id: request.checkpoint_id.to_string(),
                sandbox_id: sandbox.clone(),
                epoch: request.epoch,
                name: request.name.clone(),
                #[allow(
                    clippy::disallowed_methods,
                    reason = "the date runsc made this on the host, recorded in its manifest; no simulation runs the gVisor runtime (its fake stamps its own)"
                )]
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
                // The agent's own (checked at connect): one restored from an
                // older checkpoint keeps its version in the next.
                agent_version: Some(agent_version),
                extra: ExtraFields::new(),
            };
            // The image (a rename on a directory store; the upload, from the
            // page cache, to GCS) and its manifest at once: the digest is
            // known before the upload starts, and nothing refers to either
            // until the reconciler records the checkpoint, after both.
            let manifest_key = checkpoint_manifest_key(&request.checkpoint_id);
            // A link to the image, for a restore here soon after (a client
            // that checkpoints and attaches again) to skip the download.
            let kept = self.link_for_restore_here(&image, &key, size);
            let (image_stored, manifest_stored) = tokio::join!(
                self.checkpoints.adopt_blob(&key, image.clone()),
                create_idempotent(self.checkpoints.as_ref(), &manifest_key, encode(&manifest))
            );
            if let Err(err) = image_stored.and(manifest_stored) {
                if let Some(link) = kept {
                    let _ = std::fs::remove_file(link);
                }
                return Err(err.into());
            }
            Ok::<_, RuntimeError>((manifest, kept))
        }
        .await;
        match upload {
            Ok((manifest, kept)) => {
                if let Some(path) = kept {
                    let downloaded = Downloaded {
                        path,
                        sha256: manifest.image.sha256.clone(),
                        size: manifest.image.size,
                    };
                    let key = checkpoint_image_key(&request.checkpoint_id);
                    self.prefetches.keep(sandbox, &key, downloaded);
                }
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
                let kept = super::housekeeping::orphaned_checkpoints_dir(&self.config.state_dir)
                    .join(format!("{}-{}.img", sandbox, request.checkpoint_id));
                let moved = match kept.parent() {
                    Some(parent) => tokio::fs::create_dir_all(parent)
                        .await
                        .and(tokio::fs::rename(&image, &kept).await),
                    None => Err(std::io::Error::other("no parent directory")),
                };
                let kept_at = if moved.is_ok() { kept } else { image.clone() };
                super::housekeeping::prune_orphaned_checkpoints(
                    &self.config.state_dir,
                    self.config.orphaned_checkpoints_budget,
                )
                .await;
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

impl GvisorRuntime {
    /// A hard link to a checkpoint image just written (in the state
    /// directory, an owner-tagged temporary), when the store is remote and
    /// the image small enough to keep (`prefetch::Prefetches::keep`).
    fn link_for_restore_here(
        &self,
        image: &Path,
        key: &controllers::store::ObjectKey,
        size: u64,
    ) -> Option<std::path::PathBuf> {
        if self.checkpoints.local_path(key).is_some() || size > prefetch::KEEP_TAKEN_MAX {
            return None;
        }
        let link = self
            .config
            .state_dir
            .join(self.owner.temporary(prefetch::TEMPORARY_KIND, "img"));
        std::fs::hard_link(image, &link).ok().map(|()| link)
    }
}

/// Creates an object that must not exist yet. A precondition failure whose
/// object holds exactly these bytes was this call's own write, retried after a
/// lost response: success.
pub(super) async fn create_idempotent(
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
