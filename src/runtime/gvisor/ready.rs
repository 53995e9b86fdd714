//! Ready templates on this host (`runtime::images::ready`): the first create of an
//! image that names a start command boots a sandbox, runs the command until
//! it exits 0, and checkpoints it into the runtime's state directory
//! (`ready/ready-<owner>-<uuid>.d/<digest>/checkpoint.img`, never the bucket: the work is paid once
//! per instance and template); that create and every later one restore the
//! checkpoint under a container of their own, as fast as any restore.
//!
//! The checkpoint is made once at a time per template (a create arriving
//! while it is being made waits for it); one that fails leaves nothing, and
//! the next create tries again. Each runtime has a directory of its own
//! (tagged with its owner tag, `owner.rs`), and startup removes those of
//! servers that are gone, so a new runsc never restores an old one's image.
//!
//! Only network `none`: an `egress` create of a ready template boots cold and
//! runs the start command itself (its network namespace is its own).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use controllers::runtime::{Command, ExecEvent, ExecRequest, RuntimeError};
use tokio::sync::OnceCell;

use super::GvisorRuntime;
use super::executions::exec_command;
use super::owner::Owner;
use crate::runtime::agent::AgentConnection;
use crate::runtime::agent::protocol::{CheckpointReady, Request};
use crate::runtime::checkpoint::cpu_quota;
use crate::runtime::images::catalog::Image;
use crate::runtime::images::ready::{ReadyCommand, ReadyLanguage};

/// The most of a failed start command's output an error quotes.
const OUTPUT_TAIL: usize = 2048;

/// A template's checkpoint on this host.
#[derive(Debug)]
pub(super) struct ReadyImage {
    /// Holds `checkpoint.img`.
    dir: PathBuf,
}

/// The templates prepared (or being prepared) here, by image digest.
#[derive(Debug)]
pub(super) struct ReadyTemplates {
    /// This runtime's own directory of checkpoints
    /// (`<state>/ready/ready-<owner tag>-<uuid>.d/<digest>/`).
    root: PathBuf,
    cells: Mutex<HashMap<String, Arc<OnceCell<ReadyImage>>>>,
}

impl ReadyTemplates {
    /// A fresh directory for this runtime under `state_dir/ready`, after
    /// removing those of servers that are gone (servers sharing the state
    /// directory keep theirs).
    pub(super) async fn under(state_dir: &std::path::Path, owner: &Owner) -> Self {
        let parent = state_dir.join("ready");
        if let Ok(mut entries) = tokio::fs::read_dir(&parent).await {
            while let Ok(Some(entry)) = entries.next_entry().await {
                let name = entry.file_name().to_string_lossy().into_owned();
                if owner.is_orphan_temporary("ready", &name) {
                    let _ = tokio::fs::remove_dir_all(entry.path()).await;
                }
            }
        }
        Self {
            root: parent.join(owner.temporary("ready", "d")),
            cells: Mutex::default(),
        }
    }
}

impl GvisorRuntime {
    /// A container for a new sandbox on the ready template `image`: its
    /// checkpoint restored (made first if this is the first create here).
    pub(super) async fn launch_ready(
        &self,
        sandbox: &(dyn std::fmt::Display + Sync),
        image: &Image,
        command: &ReadyCommand,
    ) -> Result<(String, PathBuf, Arc<AgentConnection>), RuntimeError> {
        let cell = Arc::clone(
            self.ready
                .cells
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(image.digest.clone())
                .or_default(),
        );
        let ready = cell
            .get_or_try_init(|| self.prepare_ready(image, command))
            .await?;
        self.restore_ready(sandbox, ready, image).await
    }

    /// Boots the template, runs its start command, checkpoints it here.
    async fn prepare_ready(
        &self,
        image: &Image,
        command: &ReadyCommand,
    ) -> Result<ReadyImage, RuntimeError> {
        #[allow(
            clippy::disallowed_methods,
            reason = "times work on the host (runsc, processes, files) for a log line; not the instance's clock"
        )]
        let started = Instant::now();
        let label = format!("(template {})", image.name);
        let (container_id, dir) = self.new_container(None, image)?;
        let agent = self.launch(&label, &container_id, &dir, None, None).await?;
        let target = self.ready.root.join(&image.digest);
        let made = async {
            self.run_start_command(&agent, image, command).await?;
            let prepared = agent
                .ask::<CheckpointReady>(
                    Request::PrepareCheckpoint {
                        force: false,
                        keep: false,
                        acked: None,
                    },
                    Duration::from_secs(10),
                )
                .await
                .map_err(|err| {
                    RuntimeError::Failed(format!("preparing template {}: {err}", image.name))
                })?;
            if !prepared.running.is_empty() {
                return Err(RuntimeError::Failed(format!(
                    "template {}: an execution still runs after its start command",
                    image.name
                )));
            }
            let io =
                |err: std::io::Error| RuntimeError::Failed(format!("{}: {err}", target.display()));
            let _ = tokio::fs::remove_dir_all(&target).await;
            tokio::fs::create_dir_all(&target).await.map_err(io)?;
            let lifted =
                cpu_quota::lift(std::path::Path::new(cpu_quota::CGROUP_ROOT), &container_id);
            let checkpointed = self.config.runsc.checkpoint(&container_id, &target).await;
            if let (Err(_), Some(lifted)) = (&checkpointed, lifted) {
                lifted.restore();
            }
            checkpointed.map_err(|err| {
                RuntimeError::Failed(format!("checkpointing template {}: {err}", image.name))
            })?;
            Ok(ReadyImage {
                dir: target.clone(),
            })
        }
        .await;
        // Checkpointed (the container has exited) or failed: it goes.
        self.delete_in_background(container_id, dir);
        match &made {
            Ok(_) => {
                tracing::info!(template = %image.name, digest = %image.digest, elapsed_ms = started.elapsed().as_millis() as u64, "ready template prepared")
            }
            Err(err) => {
                let _ = tokio::fs::remove_dir_all(&target).await;
                tracing::warn!(template = %image.name, %err, "cannot prepare the ready template");
            }
        }
        made
    }

    /// Runs the start command on a fresh agent; Ok once it exited 0.
    pub(super) async fn run_start_command(
        &self,
        agent: &AgentConnection,
        image: &Image,
        command: &ReadyCommand,
    ) -> Result<(), RuntimeError> {
        let failed = |detail: String| {
            RuntimeError::Failed(format!(
                "the start command of template {} {detail}",
                image.name
            ))
        };
        let request = ExecRequest::new(match command.language {
            ReadyLanguage::Python => Command::PythonSession(command.code.clone()),
            ReadyLanguage::Bash => Command::Bash(command.code.clone()),
        });
        let id = agent.new_id("e");
        let mut events = agent
            .start_exec(&id, exec_command(&request, &self.config.bundle.python))
            .await
            .map_err(|err| failed(format!("did not start: {err}")))?;
        let mut output = Vec::new();
        let wait = async {
            while let Some((_, event)) = events.recv().await {
                match event {
                    ExecEvent::Stdout(data) | ExecEvent::Stderr(data) => {
                        output.extend_from_slice(&data);
                        if output.len() > 2 * OUTPUT_TAIL {
                            output.drain(..output.len() - OUTPUT_TAIL);
                        }
                    }
                    ExecEvent::Exited(code) => return Some(code),
                    // A start command never asks for rich results.
                    ExecEvent::Result(_) => {}
                    // The agent's own events: no after-exec hook runs
                    // here, and no controller relays them.
                    ExecEvent::AfterExecFailed(_)
                    | ExecEvent::HoldLost
                    | ExecEvent::ForceKilled => {}
                }
            }
            None
        };
        let code = match tokio::time::timeout(command.timeout(), wait).await {
            Ok(Some(code)) => code,
            Ok(None) => return Err(failed("lost its sandbox".to_owned())),
            Err(_) => {
                return Err(failed(format!(
                    "did not report ready (exit 0) within {:?}",
                    command.timeout()
                )));
            }
        };
        if code == 0 {
            return Ok(());
        }
        let tail = String::from_utf8_lossy(&output[output.len().saturating_sub(OUTPUT_TAIL)..])
            .trim()
            .to_owned();
        Err(failed(format!("exited with {code}: {tail}")))
    }

    /// Restores the template's checkpoint into a new container (a link to
    /// the image: restores read it, nothing writes it).
    async fn restore_ready(
        &self,
        sandbox: &(dyn std::fmt::Display + Sync),
        ready: &ReadyImage,
        image: &Image,
    ) -> Result<(String, PathBuf, Arc<AgentConnection>), RuntimeError> {
        let (container_id, dir) = self.new_container(None, image)?;
        let image_dir = dir.join("restore");
        let linked = async {
            tokio::fs::create_dir_all(&image_dir).await?;
            tokio::fs::hard_link(
                ready.dir.join("checkpoint.img"),
                image_dir.join("checkpoint.img"),
            )
            .await
        }
        .await;
        if let Err(err) = linked {
            let _ = tokio::fs::remove_dir_all(&dir).await;
            return Err(RuntimeError::Failed(format!(
                "the checkpoint of template {}: {err}",
                image.name
            )));
        }
        let quota_watch = cpu_quota::QuotaWatch::start(
            PathBuf::from(cpu_quota::CGROUP_ROOT),
            container_id.clone(),
        );
        let launched = self
            .launch(sandbox, &container_id, &dir, Some(&image_dir), None)
            .await;
        quota_watch.end().await;
        let _ = tokio::fs::remove_dir_all(&image_dir).await;
        Ok((container_id, dir, launched?))
    }
}
