//! The `runsc` command line, wrapped: one method per subcommand we use, every
//! call with the same global flags, failures as errors carrying runsc's stderr.
//!
//! Global flags on every call (`docs/gvisor.md`):
//! `--root` (this server's own state directory), `--platform`, `--network=none`
//! and `--overlay2=root:memory` (writes to the root filesystem stay in sandbox
//! memory and are saved in checkpoints; this runsc's overlay takes no size,
//! so the places user code may write are sized tmpfs mounts of the bundle,
//! `bundle::user_writable_mounts`). `egress` sandboxes start and restore
//! with `--network=sandbox` instead ([`LaunchNetwork`]), on this runsc inside
//! the `/proc/sys/net` wrapper (`network::NetnsWorkaround`).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum RunscError {
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error(
        "`{command}` did not finish within {after:?} and was killed (a hung runsc; raise \
         SANDBOXD_RUNSC_TIMEOUT_S or SANDBOXD_RUNSC_IMAGE_TIMEOUT_S if it is only slow)"
    )]
    Timeout { command: String, after: Duration },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
}

/// The stdio an init process gets: our agent channel and a log file.
#[derive(Debug)]
pub struct InitStdio {
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: std::fs::File,
}

/// The network a container starts or restores with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchNetwork {
    /// Loopback only.
    None,
    /// gVisor's netstack on the namespace the bundle names. `wrap`: run runsc
    /// in a private mount namespace with a tmpfs over `/proc/sys/net` (runsc
    /// before 2024-07-31 otherwise takes every namespace for the root one).
    Sandbox { wrap: bool },
}

/// Runs the rest of the command line with `/proc/sys/net` hidden.
const HIDE_PROC_SYS_NET: &str = "mount -t tmpfs none /proc/sys/net && exec \"$0\" \"$@\"";

/// How long a `runsc` call may take before it is killed. A hung runsc would
/// otherwise hold its sandbox's work-queue slot forever (containerd's runc
/// wrapper uses 5 s for its short calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunscTimeouts {
    /// `state`, `list`, `delete`, `--version`.
    pub command: Duration,
    /// `run`, `restore` and `checkpoint`: they move a whole memory image.
    pub image: Duration,
}

impl Default for RunscTimeouts {
    fn default() -> Self {
        Self {
            command: Duration::from_secs(30),
            image: Duration::from_secs(300),
        }
    }
}

/// A configured `runsc`.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub binary: PathBuf,
    pub root: PathBuf,
    pub platform: String,
    pub timeouts: RunscTimeouts,
}

impl Runsc {
    fn command(&self, args: &[&str]) -> (Command, String) {
        self.command_with(args, LaunchNetwork::None)
    }

    fn command_with(&self, args: &[&str], network: LaunchNetwork) -> (Command, String) {
        let mut command = match network {
            LaunchNetwork::Sandbox { wrap: true } => {
                let mut wrapper = Command::new("unshare");
                wrapper
                    .args([
                        "-m",
                        "--propagation",
                        "private",
                        "sh",
                        "-c",
                        HIDE_PROC_SYS_NET,
                    ])
                    .arg(&self.binary);
                wrapper
            }
            _ => Command::new(&self.binary),
        };
        let network_flag = match network {
            LaunchNetwork::None => "--network=none",
            LaunchNetwork::Sandbox { .. } => "--network=sandbox",
        };
        command
            .arg("--root")
            .arg(&self.root)
            .arg(format!("--platform={}", self.platform))
            .arg(network_flag)
            .arg("--overlay2=root:memory")
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let text = format!("runsc {}", args.join(" "));
        (command, text)
    }

    async fn run(&self, command: Command, text: String) -> Result<Output, RunscError> {
        self.run_within(command, text, self.timeouts.command).await
    }

    /// Runs `command`, killing it (`kill_on_drop`) after `limit`.
    async fn run_within(
        &self,
        mut command: Command,
        text: String,
        limit: Duration,
    ) -> Result<Output, RunscError> {
        let output = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output();
        let output = tokio::time::timeout(limit, output)
            .await
            .map_err(|_| RunscError::Timeout {
                command: text.clone(),
                after: limit,
            })?
            .map_err(|source| RunscError::Spawn {
                command: text.clone(),
                source,
            })?;
        if output.status.success() {
            Ok(output)
        } else {
            Err(RunscError::Failed {
                command: text,
                status: output.status.to_string(),
                stderr: last_lines(&String::from_utf8_lossy(&output.stderr)),
            })
        }
    }

    /// Runs a detached container whose init gets `stdio`. The init keeps the
    /// pipes after runsc returns; its stderr (and runsc's) goes to the log file.
    async fn detached(
        &self,
        args: &[&str],
        network: LaunchNetwork,
        stdio: InitStdio,
        log: &Path,
    ) -> Result<(), RunscError> {
        let (mut command, text) = self.command_with(args, network);
        command
            .stdin(Stdio::from(stdio.stdin))
            .stdout(Stdio::from(stdio.stdout))
            .stderr(Stdio::from(stdio.stderr));
        let limit = self.timeouts.image;
        let status = tokio::time::timeout(limit, command.status())
            .await
            .map_err(|_| RunscError::Timeout {
                command: text.clone(),
                after: limit,
            })?
            .map_err(|source| RunscError::Spawn {
                command: text.clone(),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            Err(RunscError::Failed {
                command: text,
                status: status.to_string(),
                stderr: last_lines(&log),
            })
        }
    }

    pub async fn run_detached(
        &self,
        bundle: &Path,
        id: &str,
        network: LaunchNetwork,
        stdio: InitStdio,
        log: &Path,
    ) -> Result<(), RunscError> {
        let bundle = bundle.to_string_lossy();
        let args = ["run", "--detach", "--bundle", &bundle, id];
        self.detached(&args, network, stdio, log).await
    }

    pub async fn restore_detached(
        &self,
        bundle: &Path,
        image_dir: &Path,
        id: &str,
        network: LaunchNetwork,
        stdio: InitStdio,
        log: &Path,
    ) -> Result<(), RunscError> {
        let bundle = bundle.to_string_lossy();
        let image = image_dir.to_string_lossy();
        let args = [
            "restore",
            "--detach",
            "--image-path",
            &image,
            "--bundle",
            &bundle,
            id,
        ];
        self.detached(&args, network, stdio, log).await
    }

    /// Writes `checkpoint.img` into `image_dir` and stops the container.
    pub async fn checkpoint(&self, id: &str, image_dir: &Path) -> Result<(), RunscError> {
        let image = image_dir.to_string_lossy();
        let (command, text) = self.command(&["checkpoint", "--image-path", &image, id]);
        self.run_within(command, text, self.timeouts.image)
            .await
            .map(drop)
    }

    /// Kills and removes a container; takes about 2 s here.
    pub async fn delete_force(&self, id: &str) -> Result<(), RunscError> {
        let (command, text) = self.command(&["delete", "--force", id]);
        self.run(command, text).await.map(drop)
    }

    /// The container's status as runsc reports it (`running`, `stopped`, …).
    pub async fn state(&self, id: &str) -> Result<String, RunscError> {
        let (command, text) = self.command(&["state", id]);
        let output = self.run(command, text.clone()).await?;
        let state: serde_json::Value =
            serde_json::from_slice(&output.stdout).map_err(|err| RunscError::Failed {
                command: text,
                status: "0".to_owned(),
                stderr: format!("unreadable output: {err}"),
            })?;
        Ok(state["status"].as_str().unwrap_or_default().to_owned())
    }

    /// The ids of every container under this root.
    pub async fn list(&self) -> Result<Vec<String>, RunscError> {
        let (command, text) = self.command(&["list", "--format", "json"]);
        let output = self.run(command, text.clone()).await?;
        let parsed: Option<Vec<serde_json::Value>> = serde_json::from_slice(&output.stdout)
            .map_err(|err| RunscError::Failed {
                command: text,
                status: "0".to_owned(),
                stderr: format!("unreadable output: {err}"),
            })?;
        Ok(parsed
            .unwrap_or_default()
            .iter()
            .filter_map(|c| c["id"].as_str().map(str::to_owned))
            .collect())
    }

    /// The first line of `runsc --version`.
    pub async fn version(&self) -> Result<String, RunscError> {
        let mut command = Command::new(&self.binary);
        command.arg("--version").kill_on_drop(true);
        let output = self.run(command, "runsc --version".to_owned()).await?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned())
    }
}

/// The end of a long error output: runsc puts the cause last.
fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}
