//! `sandboxctl shell ID`: an interactive terminal in a sandbox, like
//! `kubectl exec -it`: the local terminal in raw mode (restored at the
//! end), keystrokes to the sandbox's terminal, its output to ours, and the
//! window's size followed (SIGWINCH). `stty` does the terminal settings
//! (this crate has no unsafe code for `termios`).

use std::io::Write as _;
use std::process::Stdio;

use tokio::io::AsyncReadExt as _;

use crate::client::{AttachOptions, ClientError, OutputChunk, Sandbox};

/// Runs `stty ARGS` on the controlling terminal; its output.
fn stty(args: &[&str]) -> Option<String> {
    let tty = std::fs::File::open("/dev/tty").ok()?;
    let output = std::process::Command::new("stty")
        .args(args)
        .stdin(Stdio::from(tty))
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The terminal's size: `(cols, rows)`, 80 x 24 when it has none.
fn window_size() -> (u16, u16) {
    stty(&["size"])
        .and_then(|size| {
            let (rows, cols) = size.split_once(' ')?;
            Some((cols.parse().ok()?, rows.parse().ok()?))
        })
        .filter(|&(cols, rows): &(u16, u16)| cols > 0 && rows > 0)
        .unwrap_or((80, 24))
}

/// Puts the terminal back as it was when dropped.
struct RawMode(Option<String>);

impl RawMode {
    fn enter() -> Self {
        let saved = stty(&["-g"]);
        if saved.is_some() {
            let _ = stty(&["raw", "-echo"]);
        }
        Self(saved)
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            let _ = stty(&[saved.as_str()]);
        }
    }
}

/// Runs `command` on a terminal in the sandbox until it exits; its exit code.
pub async fn shell(url: &str, id: &str, token: &str, command: &str) -> Result<u8, ClientError> {
    let sandbox = Sandbox::attach(url, id, token, AttachOptions::default()).await?;
    let (cols, rows) = window_size();
    let mut process = match sandbox.exec_terminal(command, cols, rows).await {
        Ok(process) => process,
        Err(err) => {
            sandbox.close().await;
            return Err(err);
        }
    };
    let raw = RawMode::enter();
    let handle = process.handle();
    let keys = {
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buffer = vec![0u8; 4096];
            while let Ok(n) = stdin.read(&mut buffer).await {
                if n == 0
                    || handle
                        .write_stdin(&String::from_utf8_lossy(&buffer[..n]))
                        .is_err()
                {
                    break;
                }
            }
        })
    };
    let resizes = tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut changes) = signal(SignalKind::window_change()) else {
            return;
        };
        while changes.recv().await.is_some() {
            let (cols, rows) = window_size();
            if handle.resize(cols, rows).is_err() {
                break;
            }
        }
    });
    let mut stdout = std::io::stdout();
    let outcome = loop {
        match process.next().await {
            Ok(Some(OutputChunk::Stdout(data) | OutputChunk::Stderr(data))) => {
                let _ = stdout.write_all(data.as_bytes());
                let _ = stdout.flush();
            }
            Ok(None) => break Ok(()),
            Err(err) => break Err(err),
        }
    };
    keys.abort();
    resizes.abort();
    drop(raw);
    let status = match outcome {
        Ok(()) => process.wait().await,
        Err(err) => Err(err),
    };
    sandbox.close().await;
    Ok(status?
        .code
        .and_then(|code| u8::try_from(code).ok())
        .unwrap_or(1))
}
