//! [`SandboxRuntime`] for [`GvisorRuntime`]: the controllers' port, each
//! operation checked and then handed to the module that owns it (`launch`,
//! `executions`, `checkpoint`, `snapshots`).

use std::sync::{Arc, PoisonError};

use async_trait::async_trait;
use chrono::Utc;
use controllers::api::{
    API_VERSION, BlobDigest, CheckpointManifest, ExtraFields, NetworkMode, SandboxId,
    SnapshotManifest, encode, is_resource_name,
};
use controllers::layout::{snapshot_archive_key, snapshot_manifest_key};
use controllers::runtime::{
    CheckpointRequest, CreateOptions, ExecRequest, Execution, RuntimeError, SandboxRuntime,
};
use controllers::store::{BlobSource, PutMode};
use tokio::io::AsyncWriteExt;

use super::executions::{exec_command, relay_execution};
use super::launch::check_agent_version;
use super::{GvisorRuntime, Local, SNAPSHOT_PATHS, prefetch};
use crate::runtime::agent::AgentError;
use crate::runtime::agent::delivery::DeliveryGate;
use crate::runtime::agent::protocol::{ArchiveDone, Request};
use crate::runtime::checkpoint::transfer::{check_cpu_features, sha256_file};
use crate::runtime::images::ready::read_ready_command;

#[async_trait]
impl SandboxRuntime for GvisorRuntime {
    async fn prepare_create(&self, sandbox: &SandboxId, options: &CreateOptions) {
        if let Err(err) = self.prepare_boot(sandbox, options).await {
            tracing::debug!(%sandbox, %err, "could not boot ahead of the create's writes; the create boots it");
        }
    }

    fn forget_prepared(&self, sandbox: &SandboxId) {
        GvisorRuntime::forget_prepared(self, sandbox);
    }

    fn prefetch_checkpoint(
        &self,
        sandbox: &SandboxId,
        image: &controllers::store::ObjectKey,
    ) -> Option<controllers::runtime::ImageLanded> {
        // A directory store's image is used in place: nothing to fetch.
        if self.checkpoints.local_path(image).is_some() {
            return None;
        }
        // A staged restore of it has (or will take) the download already: a
        // waiting taker's next pass must not fetch it again.
        if !self.staged.covers(&self.locals, sandbox, image) {
            let dest = self
                .config
                .state_dir
                .join(self.owner.temporary(prefetch::TEMPORARY_KIND, "img"));
            self.prefetches
                .start(self.checkpoints.clone(), sandbox, image, dest);
            self.staged.start(&self.locals, sandbox, image);
        }
        // Still watched for, not found: the holder is still checkpointing.
        let landed = self.prefetches.awaited(image)?;
        Some(Box::pin(async move {
            landed.await;
        }))
    }

    async fn check_create(&self, options: &CreateOptions) -> Result<(), RuntimeError> {
        let snapshot = match &options.snapshot_name {
            Some(name) => Some(self.snapshot_manifest(name).await?),
            None => None,
        };
        self.image_for_create(options.image.as_deref(), snapshot.as_ref())
            .await
            .map(drop)
    }

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
        let ready = read_ready_command(&image.rootfs)
            .map_err(|err| RuntimeError::Invalid(format!("sandbox image {}: {err}", image.name)))?;
        // Warm (the pool), ready (a template's checkpoint) or cold.
        let (container_id, dir, agent, network, image) = match &ready {
            None => match self
                .take_prepared(sandbox, &image)
                .or_else(|| self.take_warm(&image, options.network))
            {
                Some(warm) => {
                    let (container_id, dir, agent, image) = warm.into_taken();
                    (container_id, dir, agent, None, image)
                }
                None => {
                    self.launch_cold(sandbox, options.network, image, None)
                        .await?
                }
            },
            Some(command) if options.network == NetworkMode::None => {
                let (container_id, dir, agent) =
                    self.launch_ready(sandbox, &image, command).await?;
                (container_id, dir, agent, None, image)
            }
            Some(command) => {
                self.launch_cold(sandbox, options.network, image, Some(command))
                    .await?
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
            current.forced_kill = current.exec.is_some() && !request.keep_executions;
            current.checkpointing = true;
        }
        let keep = request.keep_executions;
        let outcome = self.checkpoint_held(sandbox, &local, request).await;
        if outcome.is_err() {
            let still_here = self
                .locals
                .running(sandbox)
                .is_some_and(|current| Arc::ptr_eq(&current, &local));
            if keep && still_here {
                self.resume_after_failure(&local).await;
            }
            let mut current = local
                .current_exec
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            current.checkpointing = false;
            current.forced_kill = false;
        }
        // Done, the sandbox no longer runs here: an execution its restore
        // brought back and nobody took went on with the checkpoint (and out
        // of the runtime with its state).
        outcome
    }

    #[tracing::instrument(skip(self, manifest), fields(sandbox = %sandbox, checkpoint = %manifest.checkpoint_id))]
    async fn restore(
        &self,
        sandbox: &SandboxId,
        manifest: &CheckpointManifest,
    ) -> Result<(), RuntimeError> {
        let _reservation = self.claim(sandbox)?;
        // Restored before the transfer landed, from this very checkpoint
        // (`staged`): take it up; its executions resume now, under the hold.
        if let Some(staged) = self.staged.take(self, sandbox, manifest).await {
            let local = self.register(
                sandbox,
                staged.container_id,
                staged.dir,
                staged.agent,
                None,
                staged.image,
            );
            self.resume_executions(sandbox, &local).await;
            return Ok(());
        }
        check_cpu_features(&manifest.cpu_features, &self.cpu_features)?;
        check_agent_version(manifest)?;
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
            .start_archive(Request::Archive {
                paths: SNAPSHOT_PATHS
                    .iter()
                    .map(|path| (*path).to_owned())
                    .collect(),
                since: None,
            })
            .await
            .map_err(|err| RuntimeError::Failed(format!("starting the snapshot: {err}")))?;
        let path = self
            .config
            .state_dir
            .join(self.owner.temporary("snapshot", "tar.gz"));
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
                .map_err(|message| RuntimeError::Failed(format!("snapshot failed: {message}")))?
                .0
                .reply::<ArchiveDone>()
                .map_err(|err| RuntimeError::Failed(format!("snapshot failed: {err}")))?;
            let (sha256, size) = sha256_file(&path).await.map_err(io)?;
            self.snapshots
                .upload_blob(&archive_key, BlobSource::File(path.clone()))
                .await?;
            let manifest = SnapshotManifest {
                api_version: API_VERSION.to_owned(),
                name: name.to_owned(),
                source_sandbox: sandbox.clone(),
                #[allow(
                    clippy::disallowed_methods,
                    reason = "the date runsc made this on the host, recorded in its manifest; no simulation runs the gVisor runtime (its fake stamps its own)"
                )]
                created_at: Utc::now(),
                archive: BlobDigest {
                    key: archive_key.to_string(),
                    size,
                    sha256,
                },
                entries: reply.entries,
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
        GvisorRuntime::forget_prepared(self, sandbox);
        let local = self
            .locals
            .step(sandbox, Local::stop)
            .ok_or_else(|| RuntimeError::NotFound(sandbox.clone()))?;
        self.delete_and_detach_in_background(
            local.container_id.clone(),
            local.dir.clone(),
            local.network.clone(),
        );
        Ok(())
    }

    fn is_running(&self, sandbox: &SandboxId) -> bool {
        self.locals
            .running(sandbox)
            .is_some_and(|local| !local.agent.is_gone())
    }

    fn take_resumed(&self, sandbox: &SandboxId) -> Option<Execution> {
        self.locals.step(sandbox, Local::take_resumed)
    }

    #[tracing::instrument(level = "debug", skip(self, request), fields(sandbox = %sandbox))]
    async fn fs(
        &self,
        sandbox: &SandboxId,
        request: controllers::files::FsRequest,
    ) -> Result<controllers::files::FsReply, controllers::files::FsError> {
        self.fs_request(sandbox, request).await
    }
}
