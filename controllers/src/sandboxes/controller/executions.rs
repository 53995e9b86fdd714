//! Executions and snapshots on a sandbox held here: they wait out a periodic
//! checkpoint, and an exit is reported only while the hold is vouched for.

use std::sync::Arc;
use std::time::Duration;

use crate::api::{SandboxId, SnapshotRef};
use crate::files::{FsError, FsReply, FsRequest};
use crate::runtime::{ExecEvent, ExecRequest, Execution, RuntimeError};

use super::super::reconciler::{Command, Reconciler};
use super::{ControlError, SandboxController};

impl SandboxController {
    /// Starts an execution in a sandbox held here.
    pub async fn exec(
        &self,
        sandbox: &SandboxId,
        request: ExecRequest,
    ) -> Result<Execution, ControlError> {
        if !self.is_held_here(sandbox) {
            return Err(ControlError::NotHere(sandbox.clone()));
        }
        let runtime = self.reconciler.runtime();
        let attempt = || runtime.exec(sandbox, request.clone());
        let execution = self
            .past_checkpoints(sandbox, attempt, checkpointing)
            .await?;
        Ok(self.relayed(sandbox, execution))
    }

    /// The execution a restore here brought back with the sandbox (created
    /// with `keep_executions`), once, wrapped like one [`Self::exec`] started.
    pub fn take_resumed(&self, sandbox: &SandboxId) -> Option<Execution> {
        let execution = self.reconciler.runtime().take_resumed(sandbox)?;
        Some(self.relayed(sandbox, execution))
    }

    /// `execution` with the sandbox's after-exec hooks, fenced by [`fence_exit`].
    fn relayed(&self, sandbox: &SandboxId, execution: Execution) -> Execution {
        let execution = match self.reconciler.hook_binding(sandbox) {
            Some(hooks) if hooks.wants_after_exec() => {
                crate::hooks::run_after_exec(execution, hooks, sandbox.clone())
            }
            _ => execution,
        };
        fence_exit(execution, Arc::clone(&self.reconciler), sandbox.clone())
    }

    /// Runs `attempt` on a sandbox held here, retrying on state changes until
    /// [`CHECKPOINT_WAIT`] or the hold ends while a periodic checkpoint (about a
    /// second, no runtime sandbox, hold kept) makes it fail `in_checkpoint`.
    async fn past_checkpoints<T, E, F>(
        &self,
        sandbox: &SandboxId,
        attempt: impl Fn() -> F,
        in_checkpoint: impl Fn(&E) -> bool,
    ) -> Result<T, E>
    where
        F: std::future::Future<Output = Result<T, E>>,
    {
        let give_up = self.reconciler.clock().instant() + CHECKPOINT_WAIT;
        loop {
            // Armed first, not to miss the checkpoint's end (restore or stop).
            let changed = self.reconciler.state_changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match attempt().await {
                Err(err)
                    if in_checkpoint(&err)
                        && self.is_held_here(sandbox)
                        && self.reconciler.clock().instant() < give_up =>
                {
                    tokio::select! {
                        () = changed => {}
                        () = tokio::time::sleep_until(give_up) => {}
                    }
                }
                other => return other,
            }
        }
    }

    /// Snapshots changed files as `name`, recorded in `status.latest_snapshot`.
    pub async fn snapshot_filesystem(
        &self,
        sandbox: &SandboxId,
        name: &str,
    ) -> Result<SnapshotRef, ControlError> {
        if !self.is_held_here(sandbox) {
            return Err(ControlError::NotHere(sandbox.clone()));
        }
        let manifest = self
            .reconciler
            .runtime()
            .snapshot_filesystem(sandbox, name)
            .await?;
        let reference = SnapshotRef {
            name: manifest.name.clone(),
            bucket: self.reconciler.snapshot_bucket().to_owned(),
            path: manifest.archive.key.clone(),
            sha256: manifest.archive.sha256.clone(),
            size: manifest.archive.size,
            created_at: manifest.created_at,
            extra: crate::api::ExtraFields::new(),
        };
        // Recorded by the sandbox's own pass, as every write of its objects.
        let snapshot = Box::new(reference.clone());
        let written = self.command(sandbox, Command::RecordSnapshot { snapshot });
        if let Err(err) = written.await {
            // The snapshot exists; only its mention in the metadata is missing.
            tracing::warn!(%sandbox, %err, "cannot record the snapshot in metadata.json");
        }
        Ok(reference)
    }

    /// One filesystem request on a sandbox held here; waits out a checkpoint too.
    pub async fn fs(&self, sandbox: &SandboxId, request: FsRequest) -> Result<FsReply, FsError> {
        if !self.is_held_here(sandbox) {
            return Err(FsError::Runtime(RuntimeError::NotFound(sandbox.clone())));
        }
        let runtime = self.reconciler.runtime();
        let attempt = || runtime.fs(sandbox, request.clone());
        let in_checkpoint =
            |err: &FsError| matches!(err, FsError::Runtime(err) if checkpointing(err));
        self.past_checkpoints(sandbox, attempt, in_checkpoint).await
    }
}

/// How an attempt on a sandbox fails while a periodic checkpoint runs.
fn checkpointing(err: &RuntimeError) -> bool {
    matches!(
        err,
        RuntimeError::Checkpointing(_) | RuntimeError::NotFound(_)
    )
}

/// How long an execution or file request waits for a checkpoint to end.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(30);

/// How long an exit held back by [`fence_exit`] waits at most.
const FENCE_EXIT_GIVE_UP: Duration = Duration::from_secs(600);

/// Relays an execution's events, reporting its end only while this instance vouches for its hold: a
/// holder frozen past its lease (runsc ran on) may resume to an exit that came after another
/// instance took over, and reporting it would acknowledge work on two instances at once. The end
/// (exit, or events ending) waits until the hold is re-verified or is no longer held here: if lost,
/// the session hears the loss first, then [`ExecEvent::HoldLost`] stops the relay reporting an end
/// (which under load could beat the loss to the socket). The reconciler settles an unvouched hold
/// within about a lease (a pass that cannot read the bucket stops it past the store's deadline);
/// [`FENCE_EXIT_GIVE_UP`] only bounds the task's life.
fn fence_exit(
    mut execution: Execution,
    reconciler: Arc<Reconciler>,
    sandbox: SandboxId,
) -> Execution {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let exit = loop {
            match execution.events.recv().await {
                Some(event @ ExecEvent::Exited(_)) => break Some(event),
                Some(event) => {
                    if tx.send(event).await.is_err() {
                        // Nobody listens; drain so the runtime never blocks.
                        while execution.events.recv().await.is_some() {}
                        return;
                    }
                }
                None => break None,
            }
        };
        let give_up = reconciler.clock().instant() + FENCE_EXIT_GIVE_UP;
        loop {
            // Armed before looking, so a change in between is not missed.
            let changed = reconciler.state_changed();
            let renewed = reconciler.leases().instance_lease().renewed();
            tokio::pin!(changed, renewed);
            changed.as_mut().enable();
            renewed.as_mut().enable();
            match reconciler.held(&sandbox) {
                Some(held) if reconciler.leases().is_safe(&held) => {
                    if let Some(exit) = exit {
                        let _ = tx.send(exit).await;
                    }
                    return;
                }
                Some(_) if reconciler.clock().instant() < give_up => {
                    // Renewed, or re-verified or lost (both slot changes).
                    tokio::select! {
                        () = changed => {}
                        () = renewed => {}
                        () = tokio::time::sleep_until(give_up) => {}
                    }
                }
                held => {
                    // Lost, or never vouched for again: no end may be reported. Unheld without a
                    // loss (died, deleted, checkpointed): the events' end is that stop.
                    if held.is_some() || reconciler.was_lost(&sandbox) {
                        tracing::warn!(%sandbox, "an execution ended while this instance could not vouch for its hold: its end is not reported");
                        let _ = tx.send(ExecEvent::HoldLost).await;
                    }
                    return;
                }
            }
        }
    });
    Execution {
        events: rx,
        control: execution.control,
    }
}
