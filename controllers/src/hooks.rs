//! Lifecycle hooks: work that runs at fixed points of a sandbox's life on the
//! instance that holds it (`docs/workspaces.md`), such as syncing its workspace.
//!
//! The reconciler and the controller call the hooks; what they do is the
//! server's business (the workspace sync lives in the server crate, which has
//! the runtime's file access and the workspace store). Criticality is decided
//! by the hook point, not by each hook:
//!
//! | point | when | on failure |
//! |---|---|---|
//! | cold start | the sandbox was created or restored here, before it is reported running | the start fails (the client gets the error), if the hook says so |
//! | after exec | an execution ended, before its exit is reported | logged and counted by the hook; the client gets the error before the exit ([`ExecEvent::AfterExecFailed`]) |
//! | terminate | the sandbox is about to be destroyed for good | logged and counted; the deletion goes on |

use std::fmt;

use async_trait::async_trait;

use crate::api::{SandboxId, SandboxSpec};
use crate::runtime::{ExecEvent, Execution};

/// How the sandbox came to run here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdStart {
    /// A new sandbox.
    Created,
    /// Restored from a checkpoint (after a move, a crash or a stop).
    Restored,
}

/// Why a critical hook failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HookError(pub String);

/// The hooks an instance runs. Every method has a do-nothing default.
#[async_trait]
pub trait LifecycleHooks: Send + Sync + fmt::Debug {
    /// The sandbox now runs here (created or restored), not yet reported
    /// running. An error fails the start: the sandbox is destroyed here (its
    /// checkpoint stays). The implementation decides what is worth failing a
    /// restore for: a restored sandbox has its own files. What it returns
    /// is the sandbox's binding for the later points, kept with the hold.
    async fn on_cold_start(
        &self,
        _sandbox: &SandboxId,
        _spec: &SandboxSpec,
        _start: ColdStart,
    ) -> Result<Option<HookBinding>, HookError> {
        Ok(None)
    }
}

/// What the hooks keep for one sandbox while it runs here (a workspace's
/// template and the store's state as last seen), and the later hook points.
/// Opaque to the controllers: the reconciler keeps it in the sandbox's slot
/// with its hold and drops it when the hold ends, so the hooks need no map
/// of their own.
pub type HookBinding = std::sync::Arc<dyn BoundHooks>;

/// The hook points after the cold start, of one sandbox's binding. Every
/// method has a do-nothing default.
#[async_trait]
pub trait BoundHooks: Send + Sync + fmt::Debug {
    /// Whether [`Self::after_exec`] must run for this sandbox's executions;
    /// when false their events are not relayed through the hooks at all.
    fn wants_after_exec(&self) -> bool {
        false
    }

    /// An execution ended; its exit is reported when this returns. An
    /// error reaches the execution's client before the exit (what it did
    /// may not be stored); the sandbox goes on. An implementation also logs
    /// and counts its own failures.
    async fn after_exec(&self, _sandbox: &SandboxId) -> Result<(), HookError> {
        Ok(())
    }

    /// The sandbox is about to be destroyed for good (deleted). Non-critical.
    async fn on_terminate(&self, _sandbox: &SandboxId) {}
}

/// No hooks at all: the default.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHooks;

impl LifecycleHooks for NoHooks {}

/// Relays an execution's events, running the after-exec hook between the
/// process's end and the report of its exit, so a client that saw the exit
/// knows the hook (e.g. the workspace upload) has run.
pub fn run_after_exec(
    mut execution: Execution,
    hooks: HookBinding,
    sandbox: SandboxId,
) -> Execution {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(event) = execution.events.recv().await {
            if let ExecEvent::Exited(_) = event
                && let Err(HookError(message)) = hooks.after_exec(&sandbox).await
                && tx.send(ExecEvent::AfterExecFailed(message)).await.is_err()
            {
                return;
            }
            if tx.send(event).await.is_err() {
                // Nobody listens any more; the hook still ran above if the
                // process had ended. Keep draining so the runtime never blocks.
                while let Some(event) = execution.events.recv().await {
                    if let ExecEvent::Exited(_) = event {
                        let _ = hooks.after_exec(&sandbox).await;
                    }
                }
                return;
            }
        }
    });
    Execution {
        events: rx,
        control: execution.control,
    }
}
