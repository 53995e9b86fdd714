//! What the API layer asks of the controller: create, fork, ask for a
//! sandbox here (or withdraw), ask for a checkpoint or deletion, and the
//! shutdown drain. Each is a command to the sandbox's own pass
//! (`reconciler/commands.rs`), which makes its writes and replies; none
//! writes a sandbox's objects or touches the runtime itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::api::{DesiredState, ForkOrigin, Phase, SandboxId, SandboxMetadata};

use super::super::reconciler::{AttachRead, Command, ForkPoint, record_carried};
use super::{ControlError, SandboxController};

impl SandboxController {
    /// Gives `sandbox`'s pass `command`, queues the pass, and awaits its
    /// reply.
    pub(super) async fn command(
        &self,
        sandbox: &SandboxId,
        command: Command,
    ) -> Result<(), ControlError> {
        let (reply, replied) = oneshot::channel();
        self.reconciler.send(sandbox, command, Some(reply));
        self.queue.add(sandbox);
        replied.await.unwrap_or_else(|_| {
            Err(ControlError::Internal(format!(
                "the pass of sandbox {sandbox} ended without answering"
            )))
        })
    }

    /// Records a new sandbox (desired running) and runs it here: its pass
    /// writes `metadata.json` and a lock held here at once (decision 18).
    pub async fn create(&self, metadata: &SandboxMetadata) -> Result<(), ControlError> {
        let command = Command::Create {
            metadata: Box::new(metadata.clone()),
        };
        self.command(&metadata.sandbox_id, command).await
    }

    /// Reads what an attach needs, both objects at once: `metadata.json`
    /// (the token, the options) and `lock.json` (who holds it); for a
    /// sandbox held here, what its owner knows of both instead
    /// (`Reconciler::owner_read`). `None`: the sandbox does not exist.
    pub async fn read_for_attach(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<AttachRead>, ControlError> {
        // Held here: its owner knows both (no bucket request).
        if let Some(read) = self.reconciler.owner_read(sandbox) {
            return Ok(Some(read));
        }
        let (metadata, lock) = tokio::join!(
            self.reconciler.read_metadata_versioned(sandbox),
            self.reconciler.leases().read(sandbox)
        );
        let Some(metadata) = metadata? else {
            return Ok(None);
        };
        Ok(Some(AttachRead {
            metadata,
            lock: lock?,
        }))
    }

    /// `metadata.json` with the checkpoint `lock.json` carries folded in
    /// (both read at once): what a fork starts from. A client hears
    /// CHECKPOINTED once the hand-back carries the checkpoint, before its
    /// record lands in the metadata (decision 18), and may fork it at once,
    /// on any instance. `None`: the sandbox does not exist.
    pub async fn read_with_carried(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<SandboxMetadata>, ControlError> {
        let Some(read) = self.read_for_attach(sandbox).await? else {
            return Ok(None);
        };
        let (mut metadata, _) = read.metadata;
        if let Some(carried) = read
            .lock
            .as_ref()
            .and_then(|(lock, _)| lock.checkpoint.as_ref())
        {
            // A view, not a record: nothing falls off the history.
            record_carried(&mut metadata.status, carried, usize::MAX);
        }
        Ok(Some(metadata))
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
    /// if given (else the latest): a read, then [`Self::request_here_from`]
    /// (the tests' and the simulation's shorthand; a session reads first
    /// itself, to answer from what it read).
    #[cfg(any(test, feature = "testing"))]
    pub async fn request_here(
        self: &Arc<Self>,
        sandbox: &SandboxId,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        let read = self.read_for_attach(sandbox).await?;
        let read = read.ok_or_else(|| ControlError::NotFound(sandbox.clone()))?;
        self.request_here_from(read, checkpoint, now).await
    }

    /// [`Self::request_here`] from the objects the caller just read (with
    /// [`Self::read_for_attach`]): the pass writes the spec and the lock at
    /// once, each conditional on what was read, taking a lock nobody holds
    /// or wants in the same write, or ringing its holder with the intent.
    /// The reply comes once the lock is written: a hold taken does not
    /// wait for the spec's write (decision 21).
    pub async fn request_here_from(
        self: &Arc<Self>,
        read: AttachRead,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        let sandbox = read.metadata.0.sandbox_id.clone();
        self.command(
            &sandbox,
            Command::Attach {
                read: Box::new(read),
                checkpoint: checkpoint.map(str::to_owned),
                at: now,
            },
        )
        .await
    }

    /// Withdraws this instance's wish to run `sandbox` (its client gave up).
    pub async fn withdraw_request(&self, sandbox: &SandboxId) -> Result<(), ControlError> {
        self.command(sandbox, Command::Withdraw).await
    }

    /// Asks for `sandbox` to be checkpointed (under `name`, if given),
    /// deleted or run. A checkpoint of a sandbox held here is answered
    /// before its intent's write lands (decision 22).
    pub async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
        checkpoint_name: Option<&str>,
    ) -> Result<(), ControlError> {
        self.command(
            sandbox,
            Command::Desire {
                desired,
                name: checkpoint_name.map(str::to_owned),
            },
        )
        .await
    }

    /// Shutdown: asks for every sandbox held here to be checkpointed (or
    /// deleted, if it cannot be), forcing checkpoints past running executions,
    /// and waits until none is held or `grace` has passed. Returns how many
    /// were still held at the end.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.reconciler.start_draining();
        let deadline = self.reconciler.clock().instant() + grace;
        // Each sandbox's own pass decides what the drain asks of it
        // (`Command::Drain`); all at once.
        let held = self.held_sandboxes();
        let asked = held.iter().map(|sandbox| async move {
            let asked = self.command(sandbox, Command::Drain).await;
            if let Err(err) = asked {
                tracing::warn!(%sandbox, %err, "cannot ask for the sandbox to stop at shutdown");
            }
        });
        let _ = tokio::time::timeout_at(deadline, futures::future::join_all(asked)).await;
        loop {
            let left = self.held_sandboxes().len();
            if left == 0 || self.reconciler.clock().instant() >= deadline {
                // The checkpoints' records still under way land before the
                // process ends (the locks carry them if they cannot).
                let _ =
                    tokio::time::timeout_at(deadline, self.reconciler.background_settled()).await;
                return left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
