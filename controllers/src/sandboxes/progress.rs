//! What the reconciler tells the sessions waiting on a sandbox: each step it
//! takes, in order, on a per-sandbox broadcast channel.
//!
//! The API layer writes an intent, subscribes here (before writing, so nothing
//! is missed) and turns these events into the wire's status frames. Sessions
//! that are not attached to the sandbox never subscribe, so a rejected attach
//! cannot steal the attached client's notifications (upstream bug B7).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::broadcast;

use crate::api::SandboxId;

/// How many events a slow subscriber may fall behind before it misses some.
const CHANNEL_CAPACITY: usize = 64;

/// The operation a failure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Create,
    Restore,
    Checkpoint,
    Delete,
}

/// One step of the reconciler on one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    LockAcquiring,
    LockAcquired,
    Restoring,
    /// The sandbox runs on this instance under lease `epoch`.
    Running {
        epoch: u64,
    },
    /// Another instance asked for the sandbox: it is being handed over.
    LockReleaseRequested,
    Checkpointing,
    Deleting,
    LockReleasing,
    LockReleased,
    Deleted,
    /// The checkpoint is recorded in `metadata.json` (its image key).
    Checkpointed {
        image: String,
    },
    /// A checkpoint was refused because an execution is running; the sandbox
    /// keeps running.
    ExecutionInProgress,
    Failed {
        operation: Operation,
        message: String,
    },
    /// The sandbox stopped here without being asked: its lease was taken over
    /// or its runtime died.
    Lost {
        message: String,
    },
}

/// The per-sandbox broadcast channels of one instance.
#[derive(Debug, Clone, Default)]
pub struct ProgressBus {
    channels: Arc<Mutex<HashMap<SandboxId, broadcast::Sender<Progress>>>>,
}

impl ProgressBus {
    pub fn subscribe(&self, sandbox: &SandboxId) -> broadcast::Receiver<Progress> {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels
            .entry(sandbox.clone())
            .or_insert_with(|| broadcast::channel(CHANNEL_CAPACITY).0)
            .subscribe()
    }

    /// Sends `event` to the current subscribers (none is fine), and forgets
    /// channels nobody listens to any more.
    pub fn emit(&self, sandbox: &SandboxId, event: Progress) {
        tracing::debug!(%sandbox, ?event, "progress");
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = channels.get(sandbox) {
            if sender.receiver_count() == 0 {
                channels.remove(sandbox);
            } else {
                let _ = sender.send(event);
            }
        }
    }
}
