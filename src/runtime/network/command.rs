//! Running the host's `ip` and `iptables` tools: one call, its stderr kept for
//! the error, a missing tool named with the package to install.

use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("`{program}` is not installed (apt-get install -y {package}): {source}")]
    Missing {
        program: String,
        package: &'static str,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
}

impl CommandError {
    /// The tool's complaint (for callers that tolerate "already gone").
    pub fn stderr(&self) -> &str {
        match self {
            Self::Failed { stderr, .. } => stderr,
            Self::Missing { .. } => "",
        }
    }
}

fn package_of(program: &str) -> &'static str {
    if program.starts_with("iptables") {
        "iptables"
    } else if program == "modprobe" {
        "kmod"
    } else {
        "iproute2"
    }
}

/// Runs `program args…` (with `input` on stdin), returning its stdout.
pub async fn run(
    program: &str,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, CommandError> {
    let text = format!("{program} {}", args.join(" "));
    let missing = |source| CommandError::Missing {
        program: program.to_owned(),
        package: package_of(program),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(missing)?;
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        // A write error shows up as the command's failure below.
        let _ = stdin.write_all(input.as_bytes()).await;
        drop(stdin);
    }
    let output = child.wait_with_output().await.map_err(missing)?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(CommandError::Failed {
            command: text,
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}
