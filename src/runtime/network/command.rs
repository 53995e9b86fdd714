//! Running the host's `ip` and `iptables` tools: one call, its stderr kept for
//! the error, a missing tool named with the package to install.
//!
//! Every call has a deadline ([`COMMAND_TIMEOUT`]): a tool stuck on a lock or
//! a wedged kernel call is killed and reported, never waited on forever
//! (`iptables -w` waited for the xtables lock without end). The
//! iptables tools wait for their lock [`XTABLES_WAIT`] at most.

use std::process::Stdio;
use std::time::Duration;

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
    #[error("`{command}` did not finish within {after:?} and was killed")]
    TimedOut { command: String, after: Duration },
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
            Self::Missing { .. } | Self::TimedOut { .. } => "",
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

/// Longest an `ip` or `iptables` call may take before it is killed.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The iptables tools' lock wait (`--wait=SECONDS`; a bare `-w` waits forever).
pub const XTABLES_WAIT: &str = "--wait=10";

/// Runs `program args…` (with `input` on stdin), returning its stdout.
pub async fn run(
    program: &str,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, CommandError> {
    run_within(program, args, input, COMMAND_TIMEOUT).await
}

/// [`run`] with its own deadline.
pub async fn run_within(
    program: &str,
    args: &[&str],
    input: Option<&str>,
    timeout: Duration,
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
    let stdin = child.stdin.take();
    let finished = async move {
        if let (Some(input), Some(mut stdin)) = (input, stdin) {
            // A write error shows up as the command's failure below.
            let _ = stdin.write_all(input.as_bytes()).await;
            drop(stdin);
        }
        child.wait_with_output().await
    };
    // On timeout the child is dropped, and `kill_on_drop` kills it.
    let output = match tokio::time::timeout(timeout, finished).await {
        Ok(output) => output.map_err(missing)?,
        Err(_) => {
            return Err(CommandError::TimedOut {
                command: text,
                after: timeout,
            });
        }
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that never returns (here `sleep`, standing for
    /// `iptables` waiting on the xtables lock) is killed at its deadline.
    #[tokio::test]
    async fn a_stuck_command_is_killed_at_its_deadline() {
        let started = std::time::Instant::now();
        let err = run_within("sleep", &["30"], None, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(matches!(err, CommandError::TimedOut { .. }), "{err}");
        assert!(err.to_string().contains("sleep 30"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_command_reading_stdin_finishes_within_its_deadline() {
        let out = run_within("cat", &[], Some("rules\n"), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(out, "rules\n");
    }
}
