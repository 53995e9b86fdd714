//! Executions and filesystem snapshots, passed through to the runtime for a
//! sandbox this instance holds: an execution waits out a periodic checkpoint
//! in progress, and its exit is reported only while the hold is vouched for.

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
        let execution = self
            .past_checkpoints(
                sandbox,
                || runtime.exec(sandbox, request.clone()),
                |err| {
                    matches!(
                        err,
                        RuntimeError::Checkpointing(_) | RuntimeError::NotFound(_)
                    )
                },
            )
            .await?;
        Ok(self.relayed(sandbox, execution))
    }

    /// The execution a restore here brought back with the sandbox (created
    /// with `keep_executions`), once, wrapped like one [`Self::exec`] started.
    pub fn take_resumed(&self, sandbox: &SandboxId) -> Option<Execution> {
        let execution = self.reconciler.runtime().take_resumed(sandbox)?;
        Some(self.relayed(sandbox, execution))
    }

    /// `execution` with the sandbox's after-exec hooks, its end reported
    /// only while the hold is vouched for ([`fence_exit`]).
    fn relayed(&self, sandbox: &SandboxId, execution: Execution) -> Execution {
        let execution = match self.reconciler.hook_binding(sandbox) {
            Some(hooks) if hooks.wants_after_exec() => {
                crate::hooks::run_after_exec(execution, hooks, sandbox.clone())
            }
            _ => execution,
        };
        fence_exit(execution, Arc::clone(&self.reconciler), sandbox.clone())
    }

    /// Runs `attempt` on a sandbox held here, waiting out a periodic
    /// checkpoint in progress: one is taken in place and lasts about a
    /// second, and between it and its restore the runtime has no sandbox
    /// while the hold stays (`in_checkpoint` recognises that error). The
    /// attempt is made again when the sandbox's state changes, until
    /// [`CHECKPOINT_WAIT`]; if the checkpoint moved the sandbox away, the
    /// wait ends with the hold.
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
            // Armed before trying: the checkpoint's end (its restore here
            // noted in the slot, or the sandbox stopped) is not missed.
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

    /// Saves the sandbox's changed files as snapshot `name` and records it in
    /// `status.latest_snapshot`.
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
        let written = self
            .command(sandbox, Command::RecordSnapshot { snapshot })
            .await;
        if let Err(err) = written {
            // The snapshot exists; only its mention in the metadata is missing.
            tracing::warn!(%sandbox, %err, "cannot record the snapshot in metadata.json");
        }
        Ok(reference)
    }

    /// One filesystem request on a sandbox held here; like an execution it
    /// waits out a periodic checkpoint in progress.
    pub async fn fs(&self, sandbox: &SandboxId, request: FsRequest) -> Result<FsReply, FsError> {
        if !self.is_held_here(sandbox) {
            return Err(FsError::Runtime(RuntimeError::NotFound(sandbox.clone())));
        }
        let runtime = self.reconciler.runtime();
        self.past_checkpoints(
            sandbox,
            || runtime.fs(sandbox, request.clone()),
            |err| {
                matches!(
                    err,
                    FsError::Runtime(RuntimeError::Checkpointing(_) | RuntimeError::NotFound(_))
                )
            },
        )
        .await
    }
}

/// How long an execution or a file request waits for a checkpoint in
/// progress to end.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(30);

/// How long an exit held back by [`fence_exit`] waits at most.
const FENCE_EXIT_GIVE_UP: Duration = Duration::from_secs(600);

/// Relays an execution's events, but reports its end only while this
/// instance can vouch for its hold. A holder frozen past its lease (the runsc
/// sandbox kept running) may find, when it resumes, an execution that ended
/// meanwhile, while another instance already took the sandbox over and
/// acknowledged executions of its own: reporting that end would acknowledge
/// work on two instances at once. The end (its exit, or its events ending
/// without one: the sandbox stopped) is held back until the hold is vouched
/// for again (re-verified) and then reported, or until the sandbox is no
/// longer held here (lost: the loss is reported to the session first, then
/// [`ExecEvent::HoldLost`] tells the relay that no end may be reported:
/// without it, a relay that saw the events end would report the execution
/// done, and under load it can reach the socket before the loss does). The
/// reconciler settles an unvouched hold one way or the other within a lease
/// or so (a pass that cannot read the bucket stops it after the store's
/// deadline), so no time bound is needed for safety;
/// [`FENCE_EXIT_GIVE_UP`] only keeps a task from living for ever if it
/// never does.
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
                        // Nobody listens; keep draining so the runtime
                        // never blocks.
                        while execution.events.recv().await.is_some() {}
                        return;
                    }
                }
                None => break None,
            }
        };
        let give_up = reconciler.clock().instant() + FENCE_EXIT_GIVE_UP;
        loop {
            // Armed before looking: a change between the look and the wait
            // is not missed.
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
                    // Vouched for again by a renewal of the instance lease
                    // or a re-verification (a change of the slot), or lost
                    // (a change of the slot too).
                    tokio::select! {
                        () = changed => {}
                        () = renewed => {}
                        () = tokio::time::sleep_until(give_up) => {}
                    }
                }
                held => {
                    // Lost to another instance, or never vouched for again:
                    // no end may be reported. Not held any more without a
                    // loss (the sandbox died, was deleted or checkpointed):
                    // the events' end is the stop it was, as before.
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
