//! The intents the API layer writes through the controller: create, fork,
//! ask for a sandbox here (or withdraw), ask for a checkpoint or deletion
//! (ringing the holder elsewhere), and the shutdown drain. Each writes
//! `metadata.json`'s spec or the lease's `wanted_by` and queues a
//! reconcile; none touches the runtime.

use std::time::Duration;

use crate::api::{
    DesiredState, ForkOrigin, Phase, RestoreRequest, SandboxId, SandboxMetadata, SandboxSpec,
    decode, encode,
};
use crate::layout::metadata_key;
use crate::store::{Decision, PutMode, RmwError, StoreError, read_modify_write};

use super::super::reconciler::{ForkPoint, ReconcileError};
use super::{ControlError, SandboxController};

impl SandboxController {
    /// Records a new sandbox (desired running) and asks for it here.
    pub async fn create(&self, metadata: &SandboxMetadata) -> Result<(), ControlError> {
        let sandbox = &metadata.sandbox_id;
        match self
            .reconciler
            .metadata_store()
            .put(&metadata_key(sandbox), encode(metadata), PutMode::Create)
            .await
        {
            Ok(_) => {}
            Err(StoreError::PreconditionFailed { .. }) => {
                return Err(ControlError::AlreadyExists(sandbox.clone()));
            }
            Err(err) => return Err(err.into()),
        }
        self.reconciler.leases().request_attach(sandbox).await?;
        self.enqueue(sandbox);
        Ok(())
    }

    /// Records `metadata` (a new sandbox) as a fork of `source` at `point`
    /// and asks for it here: it is restored from its own copy of that
    /// checkpoint, on the image and kind of network the checkpoint needs.
    pub async fn fork(
        &self,
        source: &SandboxMetadata,
        point: &ForkPoint,
        mut metadata: SandboxMetadata,
    ) -> Result<(), ControlError> {
        let forked = self
            .reconciler
            .copy_checkpoint_for_fork(source, point, &metadata.sandbox_id)
            .await?;
        metadata.spec.network = forked.manifest.network;
        metadata.spec.image.clone_from(&source.spec.image);
        metadata.status.phase = Phase::Checkpointed;
        metadata.status.forked_from = Some(ForkOrigin {
            sandbox_id: source.sandbox_id.clone(),
            checkpoint: forked.source_checkpoint,
            name: match point {
                ForkPoint::Latest => None,
                ForkPoint::Named(name) => Some(name.clone()),
            },
        });
        metadata.status.latest_checkpoint = Some(forked.reference);
        tracing::info!(
            fork = %metadata.sandbox_id,
            source = %source.sandbox_id,
            ?point,
            "forking a sandbox"
        );
        self.create(&metadata).await
    }

    /// Asks for `sandbox` to run here, from the checkpoint named `checkpoint`
    /// if given (else the latest).
    pub async fn request_here(
        &self,
        sandbox: &SandboxId,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        self.update_spec(sandbox, |spec| {
            spec.desired_state = DesiredState::Running;
            if let Some(name) = checkpoint {
                spec.restore_request = Some(RestoreRequest {
                    checkpoint: name.to_owned(),
                    requested_at: now,
                });
            }
        })
        .await?;
        self.reconciler.mark_waiting(sandbox);
        self.reconciler.leases().request_attach(sandbox).await?;
        self.enqueue(sandbox);
        Ok(())
    }

    /// Withdraws this instance's wish to run `sandbox` (its client gave up).
    pub async fn withdraw_request(&self, sandbox: &SandboxId) -> Result<(), ControlError> {
        self.reconciler.leases().withdraw_attach(sandbox).await?;
        Ok(())
    }

    /// Asks for `sandbox` to be checkpointed (under `name`, if given) or deleted.
    pub async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
        checkpoint_name: Option<&str>,
    ) -> Result<(), ControlError> {
        self.update_spec(sandbox, |spec| {
            spec.desired_state = desired;
            if desired == DesiredState::Checkpointed {
                spec.checkpoint_name = checkpoint_name.map(str::to_owned);
            }
        })
        .await?;
        self.enqueue(sandbox);
        self.ring_holder(sandbox).await;
        Ok(())
    }

    /// Rings the doorbell of `sandbox`'s holder when that is another
    /// instance, so an intent written here takes effect there at once.
    /// Failures are logged: the holder's resync catches up.
    async fn ring_holder(&self, sandbox: &SandboxId) {
        if self.is_held_here(sandbox) {
            return;
        }
        let leases = self.reconciler.leases();
        match leases.read(sandbox).await {
            Ok(Some((lease, _))) => {
                if let Some(holder) = lease.holder.filter(|h| h != leases.instance())
                    && let Err(err) = leases.instance_lease().ring(&holder, sandbox).await
                {
                    tracing::warn!(%sandbox, %holder, %err, "cannot ring the holder's doorbell");
                }
            }
            Ok(None) => {}
            Err(err) => tracing::warn!(%sandbox, %err, "cannot read the lock to ring its holder"),
        }
    }

    /// Read-modify-write of the spec under the object's generation.
    async fn update_spec(
        &self,
        sandbox: &SandboxId,
        mut change: impl FnMut(&mut SandboxSpec),
    ) -> Result<(), ControlError> {
        let store = self.reconciler.metadata_store();
        let key = metadata_key(sandbox);
        let outcome = read_modify_write(store.as_ref(), &key, |current| {
            let current = current.ok_or_else(|| ControlError::NotFound(sandbox.clone()))?;
            let mut metadata: SandboxMetadata =
                decode(&current.data).map_err(|err| ReconcileError::Invalid {
                    key: key.to_string(),
                    detail: err.to_string(),
                })?;
            let before = metadata.spec.clone();
            change(&mut metadata.spec);
            Ok(if metadata.spec == before {
                Decision::Keep(())
            } else {
                Decision::Write(encode(&metadata), ())
            })
        })
        .await;
        match outcome {
            Ok(_) => Ok(()),
            Err(RmwError::Rejected(err)) => Err(err),
            Err(RmwError::Store(err)) => Err(err.into()),
            Err(RmwError::Contended { key, .. }) => Err(ControlError::Contended(key)),
        }
    }

    /// Shutdown: asks for every sandbox held here to be checkpointed (or
    /// deleted, if it cannot be), forcing checkpoints past running executions,
    /// and waits until none is held or `grace` has passed. Returns how many
    /// were still held at the end.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.reconciler.start_draining();
        let deadline = tokio::time::Instant::now() + grace;
        for sandbox in self.held_sandboxes() {
            let desired = match self.read(&sandbox).await {
                Ok(Some(metadata)) if metadata.spec.enable_checkpoint => DesiredState::Checkpointed,
                _ => DesiredState::Deleted,
            };
            // A client waits for it on another instance: hand it over (the
            // drain forces the checkpoint) rather than overwrite that
            // attach's `running` with `checkpointed`, which would leave it
            // waiting for a start that never comes.
            if desired == DesiredState::Checkpointed && self.wanted_elsewhere(&sandbox).await {
                self.enqueue(&sandbox);
                continue;
            }
            if let Err(err) = self.request_state(&sandbox, desired, None).await {
                tracing::warn!(%sandbox, %err, "cannot ask for the sandbox to stop at shutdown");
            }
        }
        loop {
            let left = self.held_sandboxes().len();
            if left == 0 || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// True when another instance's live attach intent names `sandbox`.
    async fn wanted_elsewhere(&self, sandbox: &SandboxId) -> bool {
        let leases = self.reconciler.leases();
        match leases.read(sandbox).await {
            Ok(Some((lease, _))) => lease
                .live_intent(self.reconciler.clock().now())
                .is_some_and(|intent| &intent.instance != leases.instance()),
            _ => false,
        }
    }
}
