//! Executions on the agent: the `exec` request an [`ExecRequest`] becomes,
//! the relay from the agent's events to the API's [`Execution`] (which frees
//! the sandbox's execution slot at the exit), stdin and kill through the
//! agent, and taking up after a restore the execution a checkpoint kept
//! (decision 0012), or going on after a checkpoint that failed.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use controllers::api::SandboxId;
use controllers::runtime::{
    Command, ExecControl, ExecEvent, ExecRequest, Execution, RuntimeError, TerminalSize,
};
use tokio::sync::mpsc;

use super::{GvisorRuntime, Local, LocalSandbox};
use crate::runtime::agent::delivery::DeliveryGate;
use crate::runtime::agent::protocol::{JournalEntry, JournalsReply, Request};
use crate::runtime::agent::{AgentConnection, ExecEvents, LatestCommand, STDIN_WINDOW_BYTES};

impl GvisorRuntime {
    /// After a restore: takes up the execution the checkpoint kept (its
    /// journal), routes its events, and lets the agent go on (replaying what
    /// no client got). Nothing to take up is the usual case; an agent that
    /// cannot say (an image from before executions could survive a move) has nothing either.
    pub(super) async fn resume_executions(&self, sandbox: &SandboxId, local: &LocalSandbox) {
        let reply: JournalsReply = match local
            .agent
            .ask(Request::Journals, Duration::from_secs(10))
            .await
        {
            Ok(reply) => reply,
            Err(err) => {
                tracing::debug!(%sandbox, %err, "no executions to resume");
                return;
            }
        };
        if !reply.paused {
            return;
        }
        if let Some(JournalEntry {
            id,
            acked,
            running,
            stdin_window,
            stdin_room,
        }) = reply.executions.into_iter().next_back()
        {
            let window = stdin_window.map(|size| (size, stdin_room.unwrap_or(0)));
            match local.agent.adopt_exec(&id, window) {
                Ok(events) => {
                    if running {
                        local
                            .current_exec
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .exec = Some(id.clone());
                    }
                    let gate = DeliveryGate::new(id.clone(), acked, local.agent.clone());
                    local.set_gate(Some(Arc::clone(&gate)));
                    let execution = relay_execution(local, id, events, Some(gate));
                    self.locals
                        .step(sandbox, |state| Local::resume(state, local, execution));
                    tracing::info!(%sandbox, running, acked, "execution resumed with the sandbox");
                }
                Err(err) => tracing::warn!(%sandbox, %err, "cannot take up the kept execution"),
            }
        }
        if let Err(err) = local
            .agent
            .request(Request::Resume { replay: true }, Duration::from_secs(10))
            .await
        {
            tracing::warn!(%sandbox, %err, "resuming the kept execution failed");
        }
    }

    /// A checkpoint that kept the execution failed, the sandbox still runs
    /// here: delivery and the agent go on where they stopped.
    pub(super) async fn resume_after_failure(&self, local: &LocalSandbox) {
        if let Some(gate) = local.gate() {
            gate.thaw();
            local.agent.suspend(gate.exec(), false);
        }
        if let Err(err) = local
            .agent
            .request(Request::Resume { replay: false }, Duration::from_secs(10))
            .await
        {
            tracing::warn!(%err, "resuming executions after a failed checkpoint failed");
        }
    }
}

/// Controls one execution through the agent.
#[derive(Debug)]
struct AgentExecControl {
    agent: Arc<AgentConnection>,
    id: String,
    /// Resumable executions only.
    gate: Option<Arc<DeliveryGate>>,
    /// The terminal size not yet written to the agent: a burst of resizes
    /// queues one line at a time and ends at its last size.
    size: Arc<LatestCommand>,
}

#[async_trait]
impl ExecControl for AgentExecControl {
    async fn write_stdin(&self, data: Bytes) -> Result<(), RuntimeError> {
        self.agent
            .send_stdin(&self.id, &data)
            .await
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    async fn close_stdin(&self) -> Result<(), RuntimeError> {
        self.agent
            .send_control(&Request::StdinClose.with_id(&self.id))
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    async fn kill(&self) -> Result<(), RuntimeError> {
        self.agent
            .send_control(&Request::Kill.with_id(&self.id))
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    async fn resize(&self, size: TerminalSize) -> Result<(), RuntimeError> {
        self.agent
            .send_latest(
                &self.size,
                &Request::Resize {
                    cols: size.cols,
                    rows: size.rows,
                }
                .with_id(&self.id),
            )
            .map_err(|err| RuntimeError::Failed(err.to_string()))
    }

    fn begin_delivery(&self, _event: u64) -> bool {
        self.gate.as_ref().is_none_or(|gate| gate.begin())
    }

    fn end_delivery(&self, event: u64, delivered: bool) {
        if let Some(gate) = &self.gate {
            gate.end(event, delivered);
        }
    }

    fn dropped(&self, event: u64) {
        if let Some(gate) = &self.gate {
            gate.dropped(event);
        }
    }
}

/// Relays an execution's events from the agent to the returned
/// [`Execution`], freeing the execution slot the moment the exit is seen.
/// The exit code of an execution whose sandbox stopped under it.
const KILLED: i32 = 137;

/// What the client reads when the host's memory cgroup killed the sandbox
/// under an execution: processes together (each is capped below the limit,
/// `bundle::address_space_limit`) or files in its memory-backed places
/// with them took more than its memory limit.
const OUT_OF_MEMORY: &[u8] = b"\n[sandboxd] out of memory: the sandbox used more than its memory \
    limit (its processes and the files in its memory-backed /tmp, home and /workspace together) \
    and the host killed it whole; what it held since its last checkpoint is lost\n";

/// The OOM kills of a container's memory cgroup so far.
fn oom_kills(container_id: &str) -> Option<u64> {
    crate::runtime::cgroup::oom_kills(
        std::path::Path::new(crate::runtime::checkpoint::cpu_quota::CGROUP_ROOT),
        container_id,
    )
}

pub(super) fn relay_execution(
    local: &LocalSandbox,
    id: String,
    mut agent_events: ExecEvents,
    gate: Option<Arc<DeliveryGate>>,
) -> Execution {
    let (tx, rx) = mpsc::channel(64);
    let slot = local.current_exec.clone();
    let relay_id = id.clone();
    let numbering = gate.clone();
    let container_id = local.container_id.clone();
    let oom_kills_before = oom_kills(&container_id);
    tokio::spawn(async move {
        // Frees the slot only if it still names this execution; true if a
        // forced checkpoint killed it.
        let release = || {
            let mut current = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if current.exec.as_deref() == Some(relay_id.as_str()) {
                current.exec = None;
                return std::mem::take(&mut current.forced_kill);
            }
            false
        };
        let mut count = 0;
        while let Some((seq, event)) = agent_events.recv().await {
            count += 1;
            if let Some(gate) = &numbering
                && seq != gate.seq(count)
            {
                // The API counts events; a gap would make it acknowledge
                // the wrong ones.
                tracing::warn!(execution = %relay_id, seq, expected = gate.seq(count), "resumable execution's events out of sequence");
            }
            let exited = matches!(event, ExecEvent::Exited(_));
            if exited && release() {
                let _ = tx.send(ExecEvent::ForceKilled).await;
            }
            if matches!(event, ExecEvent::Exited(KILLED))
                && oom_kills(&container_id).unwrap_or(0) > oom_kills_before.unwrap_or(0)
            {
                tracing::warn!(container = %container_id, "the host's memory cgroup killed a sandbox");
                let _ = tx
                    .send(ExecEvent::Stderr(Bytes::from_static(OUT_OF_MEMORY)))
                    .await;
            }
            let _ = tx.send(event).await;
            if exited {
                return;
            }
        }
        let _ = release();
    });
    Execution {
        events: rx,
        control: Box::new(AgentExecControl {
            agent: local.agent.clone(),
            id,
            gate,
            size: Arc::default(),
        }),
    }
}

pub(super) fn exec_command(request: &ExecRequest, python: &str) -> Request {
    let (argv, session, code) = match &request.command {
        Command::Bash(code) => (
            Some(vec!["bash".into(), "-c".into(), code.clone()]),
            false,
            None,
        ),
        Command::Python(code) => (
            Some(vec![python.into(), "-u".into(), "-c".into(), code.clone()]),
            false,
            None,
        ),
        Command::PythonSession(code) => (None, true, Some(code.clone())),
    };
    Request::Exec {
        argv,
        session,
        code,
        env: (!request.env.is_empty()).then(|| request.env.clone()),
        cwd: request.cwd.clone(),
        resumable: request.resumable,
        results: request.results,
        stdin_window: Some(STDIN_WINDOW_BYTES),
        pty: request.pty.map(|size| {
            std::collections::BTreeMap::from([
                ("cols".to_owned(), size.cols),
                ("rows".to_owned(), size.rows),
            ])
        }),
    }
}
