//! `sandboxctl run | create | attach | checkpoint | snapshot | kill`: user
//! verbs through the client library. `run` and `attach` pass the process's
//! exit code through; Ctrl-C kills the process, never the sandbox.

use std::io::Write as _;

use tokio::io::AsyncReadExt;

use crate::client::{
    AttachOptions, ClientError, CreateOptions, Language, OutputChunk, Process, Progress, Sandbox,
};

/// Progress on stderr while the server works (restoring, waiting for the lock,
/// checkpointing), when stderr is a terminal: one line, updated in place.
fn progress() -> Progress {
    use std::io::IsTerminal as _;
    if !std::io::stderr().is_terminal() {
        return Progress::default();
    }
    #[allow(
        clippy::disallowed_methods,
        reason = "sandboxctl's progress line shows the seconds the user waited, on the host's clock"
    )]
    let started = std::time::Instant::now();
    Progress::new(move |status| {
        let label = status
            .trim_start_matches("SANDBOX_")
            .replace('_', " ")
            .to_lowercase();
        let end = if status == "SANDBOX_RUNNING" || status == "SANDBOX_CHECKPOINTED" {
            "\n"
        } else {
            ""
        };
        eprint!(
            "\r\x1b[2K[{:5.1} s] {label}{end}",
            started.elapsed().as_secs_f64()
        );
    })
}

fn attach_options(checkpoint: Option<String>) -> AttachOptions {
    AttachOptions {
        checkpoint,
        progress: progress(),
    }
}

/// One user verb, parsed.
#[derive(Debug, Clone)]
pub enum UserCommand {
    Run {
        url: String,
        language: Language,
        code: String,
    },
    Create {
        url: String,
        options: CreateOptions,
    },
    Attach {
        url: String,
        id: String,
        token: String,
        checkpoint: Option<String>,
        language: Language,
        code: String,
    },
    Checkpoint {
        url: String,
        id: String,
        token: String,
        name: Option<String>,
    },
    Snapshot {
        url: String,
        id: String,
        token: String,
        name: String,
    },
    Kill {
        url: String,
        id: String,
        token: String,
    },
}

/// Runs the verb; the exit code to leave with.
pub async fn run_user_command(command: UserCommand) -> Result<u8, ClientError> {
    match command {
        UserCommand::Run {
            url,
            language,
            code,
        } => {
            let sandbox = Sandbox::create(
                &url,
                CreateOptions {
                    idle_timeout_s: Some(300),
                    ..CreateOptions::default()
                },
            )
            .await?;
            let process = sandbox.exec(language, &code).await?;
            let code = stream(process, false).await;
            let _ = sandbox.kill().await;
            code
        }
        UserCommand::Create { url, mut options } => {
            options.progress = progress();
            let sandbox = Sandbox::create(&url, options).await?;
            println!(
                "{}",
                serde_json::json!({"sandbox_id": sandbox.id(), "sandbox_token": sandbox.token()})
            );
            sandbox.close().await;
            Ok(0)
        }
        UserCommand::Attach {
            url,
            id,
            token,
            checkpoint,
            language,
            code,
        } => {
            let sandbox = Sandbox::attach(&url, &id, &token, attach_options(checkpoint)).await?;
            let code = match sandbox.exec(language, &code).await {
                Ok(process) => stream(process, true).await,
                Err(err) => Err(err),
            };
            sandbox.close().await;
            code
        }
        UserCommand::Checkpoint {
            url,
            id,
            token,
            name,
        } => {
            let sandbox = Sandbox::attach(&url, &id, &token, attach_options(None)).await?;
            let checkpointed = sandbox.checkpoint(name.as_deref()).await;
            sandbox.close().await;
            checkpointed?;
            eprintln!(
                "checkpointed {id}{}",
                name.map_or(String::new(), |n| format!(" as {n}"))
            );
            Ok(0)
        }
        UserCommand::Snapshot {
            url,
            id,
            token,
            name,
        } => {
            let sandbox = Sandbox::attach(&url, &id, &token, attach_options(None)).await?;
            let saved = sandbox.snapshot_filesystem(&name).await;
            sandbox.close().await;
            saved?;
            eprintln!("filesystem snapshot {name} saved");
            Ok(0)
        }
        UserCommand::Kill { url, id, token } => {
            let sandbox = Sandbox::attach(&url, &id, &token, attach_options(None)).await?;
            let killed = sandbox.kill().await;
            sandbox.close().await;
            killed?;
            eprintln!("killed {id}");
            Ok(0)
        }
    }
}

/// Copies the process's output to ours (stdin passed through when asked) and
/// returns its exit code; Ctrl-C kills the process.
async fn stream(mut process: Process, pass_stdin: bool) -> Result<u8, ClientError> {
    let handle = process.handle();
    let interrupt = {
        let handle = handle.clone();
        tokio::spawn(async move {
            while tokio::signal::ctrl_c().await.is_ok() {
                let _ = handle.kill();
            }
        })
    };
    let stdin = pass_stdin.then(|| {
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut input = tokio::io::stdin();
            let mut buffer = vec![0u8; 16 << 10];
            while let Ok(read) = input.read(&mut buffer).await {
                if read == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buffer[..read]).into_owned();
                if handle.write_stdin(&text).is_err() {
                    break;
                }
            }
        })
    });
    let outcome = async {
        while let Some(chunk) = process.next().await? {
            match chunk {
                OutputChunk::Stdout(data) => {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(data.as_bytes());
                    let _ = out.flush();
                }
                OutputChunk::Stderr(data) => {
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(data.as_bytes());
                    let _ = err.flush();
                }
            }
        }
        Ok::<_, ClientError>(())
    }
    .await;
    interrupt.abort();
    if let Some(stdin) = stdin {
        stdin.abort();
    }
    outcome?;
    let status = process.wait().await?;
    Ok(status
        .code
        .map_or(1, |code| u8::try_from(code.clamp(0, 255)).unwrap_or(1)))
}
