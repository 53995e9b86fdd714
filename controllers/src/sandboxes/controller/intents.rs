//! What the API layer asks of the controller (create, fork, attach, withdraw, checkpoint, delete,
//! drain), each a command its sandbox's own pass writes and replies to (`reconciler/commands.rs`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::api::{DesiredState, ForkOrigin, Phase, SandboxId, SandboxMetadata};

use super::super::reconciler::{AttachRead, Command, ForkPoint, record_carried};
use super::{ControlError, SandboxController};

impl SandboxController {
    /// Gives `sandbox`'s pass `command`, queues the pass, awaits its reply.
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

    /// Reads `metadata.json` and `lock.json` at once for an attach or, held here, what the owner
    /// knows, with no request (`Reconciler::owner_read`). `None`: no such sandbox.
    pub async fn read_for_attach(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<AttachRead>, ControlError> {
        if let Some(read) = self.reconciler.owner_read(sandbox) {
            return Ok(Some(read));
        }
        let (metadata, lock) = tokio::join!(
            self.reconciler.read_metadata(sandbox),
            self.reconciler.leases().read(sandbox)
        );
        let Some(metadata) = metadata? else {
            return Ok(None);
        };
        let lock = lock?;
        Ok(Some(AttachRead { metadata, lock }))
    }

    /// `metadata.json` with `lock.json`'s carried checkpoint folded in (decision 18): what a fork
    /// starts from, as the record may lag CHECKPOINTED. `None`: no such sandbox.
    pub async fn read_with_carried(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<SandboxMetadata>, ControlError> {
        let Some(read) = self.read_for_attach(sandbox).await? else {
            return Ok(None);
        };
        let (mut metadata, _) = read.metadata;
        if let Some((lock, _)) = &read.lock {
            // A view, not a record: nothing falls off the history.
            record_carried(&mut metadata.status, lock, usize::MAX);
        }
        Ok(Some(metadata))
    }

    /// Records `metadata` as a fork of `source` at `point` and asks for it here,
    /// restored from its own copy on the checkpoint's image and network kind.
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
        tracing::info!(fork = %metadata.sandbox_id, source = %source.sandbox_id, ?point, "forking a sandbox");
        self.create(&metadata).await
    }

    /// Asks for `sandbox` here from `checkpoint` (else the latest): a read, then
    /// [`Self::request_here_from`] (tests, simulation; a session reads first).
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

    /// [`Self::request_here`] on a fresh read: the pass writes spec and lock at once, each
    /// conditional on it; replies as the lock lands, not the spec (decision 21).
    pub async fn request_here_from(
        self: &Arc<Self>,
        read: AttachRead,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        let sandbox = read.metadata.0.sandbox_id.clone();
        let command = Command::Attach {
            read: Box::new(read),
            checkpoint: checkpoint.map(str::to_owned),
            at: now,
        };
        self.command(&sandbox, command).await
    }

    /// Withdraws this instance's wish to run `sandbox` (its client gave up).
    pub async fn withdraw_request(&self, sandbox: &SandboxId) -> Result<(), ControlError> {
        self.command(sandbox, Command::Withdraw).await
    }

    /// Asks for `sandbox` to be checkpointed (named if given), deleted or run;
    /// a checkpoint held here is answered before its intent lands (decision 22).
    pub async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
        checkpoint_name: Option<&str>,
    ) -> Result<(), ControlError> {
        let name = checkpoint_name.map(str::to_owned);
        self.command(sandbox, Command::Desire { desired, name })
            .await
    }

    /// Shutdown: checkpoints (else deletes) every sandbox held here, forcing past executions, until
    /// none is held or in a transition (`Reconciler::unsettled`) or `grace` passed; returns how
    /// many remain. Nothing more starts here; one whose start was under way is asked too, once it
    /// is held.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.reconciler.start_draining();
        let deadline = self.reconciler.clock().instant() + grace;
        let mut asked: Vec<SandboxId> = Vec::new();
        loop {
            // Told of every slot change from now on: a hold ending, a start becoming one.
            let changed = self.reconciler.state_changed();
            let mut ask = self.held_sandboxes();
            ask.retain(|sandbox| !asked.contains(sandbox));
            // All at once; each pass decides what `Command::Drain` means for it.
            let asking = ask.iter().map(|sandbox| async move {
                let asked = self.command(sandbox, Command::Drain).await;
                if let Err(err) = asked {
                    tracing::warn!(%sandbox, %err, "cannot ask for the sandbox to stop at shutdown");
                }
            });
            let _ = tokio::time::timeout_at(deadline, futures::future::join_all(asking)).await;
            asked.extend(ask);
            // Not only held: a checkpoint's hand-back lands after its local sandbox is gone.
            let left = self.reconciler.unsettled();
            if left == 0 || self.reconciler.clock().instant() >= deadline {
                // Let pending checkpoint records land (else the locks carry them).
                let _ =
                    tokio::time::timeout_at(deadline, self.reconciler.background_settled()).await;
                return left;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }
}
