//! The session's answers to client frames: run code, stdin, kill the
//! process or the sandbox, checkpoint, snapshot the filesystem. Lifecycle
//! requests are written as intents; the outcome arrives as controller
//! events (see `relay`).

use std::sync::Arc;

use controllers::api::{DesiredState, RESOURCE_NAME_RULE, is_resource_name};
use controllers::runtime::{Command, ExecRequest};

use crate::api::output::ExecutionState;
use crate::api::protocol::{ClientFrame, Language, ServerFrame, Status};
use crate::api::snapshot_owner::SnapshotProof;

use super::out::{CLOSE_FATAL, CLOSE_NORMAL, report_frame_error};
use super::{Queued, Session};

impl Session {
    /// Answers one client frame (or reports why it could not be parsed).
    pub(super) async fn handle(
        self: Arc<Self>,
        parsed: Queued,
        bytes: Option<tokio::sync::mpsc::Receiver<bytes::Bytes>>,
    ) {
        let frame = match parsed {
            Ok(frame) => frame,
            Err(err) => {
                tracing::debug!(sandbox = %self.id, %err, "bad client frame");
                report_frame_error(&self.out, &err).await;
                return;
            }
        };
        // A frame that arrived is honoured even if the client closed the
        // socket right after it and the session has detached meanwhile
        // (`kill_sandbox` then close: the sandbox is killed). Only frames
        // after the server's own close (the kill or checkpoint it answered
        // ended the session) are dropped.
        if self.out.is_closing() {
            return;
        }
        match frame {
            ClientFrame::Exec {
                language,
                code,
                session,
                pty,
                results,
            } => self.exec(language, code, session, pty, results).await,
            ClientFrame::Resize(size) => {
                *self.resizes.latest.lock().await = Some(size);
                self.apply_resize().await;
            }
            ClientFrame::Stdin { data } => self.stdin(data).await,
            ClientFrame::KillProcess => self.kill_process().await,
            ClientFrame::KillSandbox => self.kill_sandbox().await,
            ClientFrame::Checkpoint { name } => self.checkpoint(name).await,
            ClientFrame::SnapshotFilesystem { name, proof } => self.snapshot(name, proof).await,
            ClientFrame::Reconnect => self.reconnect(),
            ClientFrame::Fs(call) => self.fs(call, bytes).await,
        }
    }

    async fn exec(
        self: &Arc<Self>,
        language: Language,
        code: String,
        session: bool,
        pty: Option<controllers::runtime::TerminalSize>,
        results: bool,
    ) {
        let command = match (language, session) {
            (Language::Bash, _) => Command::Bash(code),
            (Language::Python, false) => Command::Python(code),
            (Language::Python, true) => Command::PythonSession(code),
        };
        // One execution at a time is the runtime's to say (its execution
        // slot): this session does not check it again.
        let in_progress = "An execution is already in progress.";
        let execution = match self
            .controller
            .exec(
                &self.id,
                ExecRequest {
                    resumable: self.live.options().keep_executions,
                    pty,
                    results,
                    ..ExecRequest::new(command)
                },
            )
            .await
        {
            Ok(execution) => execution,
            Err(controllers::sandboxes::ControlError::Runtime(
                controllers::runtime::RuntimeError::ExecutionInProgress(_),
            )) => {
                self.out.error(Status::ExecutionError, in_progress).await;
                return;
            }
            Err(controllers::sandboxes::ControlError::Runtime(
                controllers::runtime::RuntimeError::Checkpointing(_),
            )) => {
                let id = &self.id;
                let message = format!(
                    "Cannot execute code in sandbox {id}: sandbox {id} is being checkpointed; \
                     attach again to run code"
                );
                self.out.error(Status::ExecutionError, &message).await;
                return;
            }
            Err(err) => {
                let message = format!("Cannot execute code in sandbox {}: {err}", self.id);
                self.out.error(Status::ExecutionError, &message).await;
                return;
            }
        };
        let live = Arc::clone(&self.live);
        let controller = Arc::clone(&self.controller);
        let id = self.id.clone();
        let clock = Arc::clone(self.live.clock());
        let execution = ExecutionState::start(execution, clock, move || {
            live.touch();
            // A checkpoint may be waiting for this execution to end.
            controller.poke(&id);
        });
        self.live.begin_execution(Arc::clone(&execution)).await;
        self.out.status(Status::ExecutionRunning).await;
        self.stream(execution);
    }

    async fn stdin(&self, data: String) {
        match self.live.execution() {
            None => {
                self.out
                    .error(
                        Status::ExecutionError,
                        "No process is running in the sandbox.",
                    )
                    .await;
            }
            Some(execution) if execution.is_running() => {
                if let Err(err) = execution.write_stdin(bytes::Bytes::from(data)).await {
                    self.out
                        .error(Status::StdinError, &format!("Cannot write to stdin: {err}"))
                        .await;
                }
            }
            // Upstream drops stdin for a finished execution silently.
            Some(_) => {}
        }
    }

    async fn kill_process(&self) {
        let killed_running = match self.live.execution() {
            Some(execution) => execution.kill().await,
            None => false,
        };
        if !killed_running {
            self.out.status(Status::ExecutionForceKilled).await;
        }
    }

    async fn kill_sandbox(&self) {
        self.out.status(Status::Killing).await;
        self.pending.set_kill(true);
        if let Err(err) = self
            .controller
            .request_state(&self.id, DesiredState::Deleted, None)
            .await
        {
            self.pending.set_kill(false);
            self.out
                .error(
                    Status::KillError,
                    &format!("Failed to kill sandbox {}: {err}", self.id),
                )
                .await;
            self.out.close(CLOSE_NORMAL).await;
        }
    }

    async fn checkpoint(&self, name: Option<String>) {
        let out = &self.out;
        out.status(Status::Checkpointing).await;
        if self.live.execution_running() {
            out.error(
                Status::ExecutionInProgressError,
                "Cannot checkpoint while an execution is in progress.",
            )
            .await;
            return;
        }
        let failed = |detail: String| format!("Failed to checkpoint sandbox {}: {detail}", self.id);
        if !self.features.checkpoint || !self.live.options().enable_checkpoint {
            let message = failed(format!(
                "Sandbox {} is not configured for checkpointing.",
                self.id
            ));
            out.error(Status::CheckpointError, &message).await;
            out.close(CLOSE_FATAL).await;
            return;
        }
        if let Some(name) = &name
            && !is_resource_name(name)
        {
            let message = failed(format!(
                "invalid checkpoint name {name:?}: {RESOURCE_NAME_RULE}"
            ));
            out.error(Status::CheckpointError, &message).await;
            return;
        }
        if let Some(name) = &name
            && let Err(message) = self.named_checkpoint_room(name).await
        {
            out.error(Status::CheckpointError, &failed(message)).await;
            return;
        }
        self.pending.set_checkpoint(true);
        if let Err(err) = self
            .controller
            .request_state(&self.id, DesiredState::Checkpointed, name.as_deref())
            .await
        {
            self.pending.set_checkpoint(false);
            out.error(Status::CheckpointError, &failed(err.to_string()))
                .await;
            out.close(CLOSE_FATAL).await;
        }
    }

    /// A checkpoint under `name` is within the sandbox's
    /// `--max-named-checkpoints` (reusing one of its names always is). A
    /// metadata read that fails lets the request go on: the intent's own
    /// write reports the store's error.
    async fn named_checkpoint_room(&self, name: &str) -> Result<(), String> {
        let Ok(Some(metadata)) = self.controller.read_with_carried(&self.id).await else {
            return Ok(());
        };
        let named = &metadata.status.named_checkpoints;
        let most = self.features.max_named_checkpoints;
        if named.contains_key(name) || named.len() < most {
            return Ok(());
        }
        Err(format!(
            "it has {} named checkpoints, the most allowed (--max-named-checkpoints {most}); \
             reuse a name or delete one (sandboxctl checkpoints {} --delete NAME)",
            named.len(),
            self.id
        ))
    }

    /// Saves a filesystem snapshot under its owner (the proof sent with
    /// the frame, else this sandbox): another owner's snapshot of the same
    /// name is another snapshot, never overwritten (docs/security.md).
    async fn snapshot(&self, name: String, proof: Option<SnapshotProof>) {
        let out = &self.out;
        out.status(Status::FilesystemSnapshotCreating).await;
        let failed = |detail: String| {
            format!(
                "Failed to snapshot filesystem for sandbox {}: {detail}",
                self.id
            )
        };
        if !self.features.snapshot {
            out.error(
                Status::FilesystemSnapshotError,
                "Filesystem snapshot is not enabled on the server.",
            )
            .await;
            return;
        }
        if !is_resource_name(&name) {
            out.error(
                Status::FilesystemSnapshotError,
                &failed(format!(
                    "invalid snapshot name {name:?}: {RESOURCE_NAME_RULE}"
                )),
            )
            .await;
            return;
        }
        let owner = proof.unwrap_or_else(|| self.snapshot_owner.clone());
        if !owner.is_owner() && !self.features.shared_snapshots {
            // A read-only token creates from its owner's snapshots and
            // overwrites none; refused whether the name exists or not.
            out.error(
                Status::FilesystemSnapshotError,
                &failed(format!(
                    "no filesystem snapshot named {name:?} that this token may write"
                )),
            )
            .await;
            return;
        }
        let path = if self.features.shared_snapshots {
            name.clone()
        } else {
            owner.path(&name)
        };
        if let Some(store) = &self.snapshot_store
            && !self.features.shared_snapshots
            && let Err(refused) = self
                .features
                .snapshot_quota
                .check(store.as_ref(), &path)
                .await
        {
            out.error(
                Status::FilesystemSnapshotError,
                &failed(refused.to_string()),
            )
            .await;
            return;
        }
        match self.controller.snapshot_filesystem(&self.id, &path).await {
            Ok(_) if self.features.shared_snapshots => {
                out.status(Status::FilesystemSnapshotCreated).await;
            }
            Ok(_) => {
                // The extension fields are ignored by the earlier clients.
                out.send(ServerFrame::Event(serde_json::json!({
                    "event": "status_update",
                    "status": Status::FilesystemSnapshotCreated.as_str(),
                    "filesystem_snapshot_name": name,
                    "filesystem_snapshot_token": owner.snapshot_token(),
                    "filesystem_snapshot_read_token": owner.read_token(),
                })))
                .await;
            }
            Err(err) => {
                out.error(Status::FilesystemSnapshotError, &failed(err.to_string()))
                    .await;
            }
        }
    }
}
