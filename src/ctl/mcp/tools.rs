//! The eight tools. Each returns a [`CallToolResult`]: what the call did, or
//! (`isError`) why it could not, in words a model can act on.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde_json::json;

use super::output::{Bounded, OUTPUT_LIMIT, ProgressStream};
use super::params::{
    CheckpointSandbox, CreateSandbox, ForkSandbox, Language, ListFiles, ReadFile, RunCode,
    SandboxRef, WriteFile,
};
use super::sandboxes::{Lease, Sandboxes, ToolError};
use crate::client::{
    ClientError, CreateOptions, FileEntry, FileKind, ForkSource, Language as ClientLanguage,
    OutputChunk, Sandbox,
};

const DEFAULT_RUN_TIMEOUT: u64 = 300;
const MAX_RUN_TIMEOUT: u64 = 3600;
/// How long a program killed at its timeout may take to end.
const KILL_GRACE: Duration = Duration::from_secs(10);
const MAX_DEPTH: u32 = 8;

/// The MCP server's handler: the tools and the sandboxes they act on.
#[derive(Debug, Clone)]
pub(super) struct SandboxTools {
    sandboxes: Arc<Sandboxes>,
    idle_timeout_s: u64,
    tool_router: ToolRouter<Self>,
}

type Outcome = Result<CallToolResult, ToolError>;

impl SandboxTools {
    pub(super) fn new(sandboxes: Arc<Sandboxes>, idle_timeout_s: u64) -> Self {
        Self {
            sandboxes,
            idle_timeout_s,
            tool_router: Self::tool_router(),
        }
    }

    /// The options of every sandbox made here: checkpointable (so it can be
    /// forked, and moved between instances), and checkpointed when idle
    /// rather than deleted.
    fn create_options(&self) -> CreateOptions {
        CreateOptions {
            idle_timeout_s: (self.idle_timeout_s > 0).then_some(self.idle_timeout_s),
            enable_checkpoint: true,
            enable_sandbox_handoff: true,
            enable_idle_timeout_auto_checkpoint: true,
            ..CreateOptions::default()
        }
    }

    /// The tool result of `outcome`; a sandbox found gone is forgotten.
    fn finish(&self, tool: &str, outcome: Outcome) -> CallToolResult {
        match outcome {
            Ok(result) => result,
            Err(err) => {
                if let ToolError::Gone(id) = &err {
                    self.sandboxes.remove(id);
                }
                tracing::info!(tool, %err, "tool error");
                CallToolResult::error(vec![ContentBlock::text(describe(&err))])
            }
        }
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "sandboxctl's MCP server times the user's script on the operator's machine, outside any instance"
    )]
    async fn run_code_in(&self, args: RunCode, context: RequestContext<RoleServer>) -> Outcome {
        let timeout_s = args
            .timeout
            .unwrap_or(DEFAULT_RUN_TIMEOUT)
            .clamp(1, MAX_RUN_TIMEOUT);
        let language = match args.language {
            Language::Python => ClientLanguage::Python,
            Language::Bash => ClientLanguage::Bash,
        };
        let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
        let sandbox = lease.sandbox().await?;
        let started = sandbox.exec(language, &args.code).await;
        let mut process = lease.check(started).await?;
        let handle = process.handle();
        let mut stdout = Bounded::new(OUTPUT_LIMIT);
        let mut stderr = Bounded::new(OUTPUT_LIMIT);
        let mut progress =
            ProgressStream::new(context.peer.clone(), context.meta.get_progress_token());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
        let mut stopped: Option<(&str, tokio::time::Instant)> = None;
        let ended = loop {
            let flush_at = progress.due();
            let give_up = stopped.map(|(_, at)| at + KILL_GRACE);
            tokio::select! {
                chunk = process.next() => match chunk {
                    Ok(Some(OutputChunk::Stdout(text))) => {
                        stdout.push(&text);
                        progress.push(&text, false).await;
                    }
                    Ok(Some(OutputChunk::Stderr(text))) => {
                        stderr.push(&text);
                        progress.push(&text, true).await;
                    }
                    Ok(None) => break Ok(()),
                    Err(err) => break Err(err),
                },
                () = tokio::time::sleep_until(flush_at.unwrap_or(deadline)), if flush_at.is_some() => {
                    progress.flush().await;
                }
                () = tokio::time::sleep_until(deadline), if stopped.is_none() => {
                    stopped = Some(("timed out", tokio::time::Instant::now()));
                    let _ = handle.kill();
                }
                () = context.ct.cancelled(), if stopped.is_none() => {
                    stopped = Some(("cancelled", tokio::time::Instant::now()));
                    let _ = handle.kill();
                }
                () = tokio::time::sleep_until(give_up.unwrap_or(deadline)), if give_up.is_some() => {
                    // The connection goes with the unfinished execution.
                    lease.disconnect().await;
                    break Err(ClientError::Execution(format!(
                        "the program did not end within {} s of being killed",
                        KILL_GRACE.as_secs()
                    )));
                }
            }
        };
        progress.flush().await;
        let status = lease.check(ended.map(|()| process.status())).await;
        let mut text = stdout.finish();
        if !stderr.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str("[stderr]\n");
            text.push_str(&stderr.finish());
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        match (status, stopped) {
            (Ok(status), None) => {
                let code = status
                    .code
                    .map_or_else(|| "unknown".to_owned(), |code| code.to_string());
                text.push_str(&format!("[exit code {code}]"));
            }
            (Ok(_), Some(("timed out", _))) => {
                text.push_str(&format!("[killed: timed out after {timeout_s} s]"));
            }
            (Ok(_), Some((why, _))) => text.push_str(&format!("[killed: {why}]")),
            (Err(err), _) => {
                text.push_str(&format!("[the execution failed: {}]", describe(&err)));
                return Ok(CallToolResult::error(vec![ContentBlock::text(text)]));
            }
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    async fn read_file_in(&self, args: ReadFile) -> Outcome {
        let offset = args.offset.unwrap_or(0);
        let length = args
            .length
            .unwrap_or(OUTPUT_LIMIT as u64)
            .clamp(1, OUTPUT_LIMIT as u64);
        let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
        let sandbox = lease.sandbox().await?;
        let read = sandbox.read_range(&args.path, offset, length).await;
        let range = lease.check(read).await?;
        let end = offset + range.data.len() as u64;
        let (mut text, shown_end) = match std::str::from_utf8(&range.data) {
            Ok(text) => (text.to_owned(), end),
            // A character cut by the range's end: the text up to it.
            Err(err) if err.error_len().is_none() && !range.eof => {
                let valid = err.valid_up_to();
                (
                    String::from_utf8_lossy(&range.data[..valid]).into_owned(),
                    offset + valid as u64,
                )
            }
            Err(_) => (
                format!(
                    "[binary file: {} bytes from offset {offset}, base64]\n{}",
                    range.data.len(),
                    BASE64.encode(&range.data)
                ),
                end,
            ),
        };
        if shown_end < range.size {
            if !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!(
                "[... the file is {} bytes; this is bytes {offset}..{shown_end}: read_file with offset {shown_end} for more]",
                range.size
            ));
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    async fn write_file_in(&self, args: WriteFile) -> Outcome {
        let data = if args.base64 {
            BASE64
                .decode(args.content.trim())
                .map_err(|err| ToolError::Invalid(format!("content is not base64: {err}")))?
        } else {
            args.content.into_bytes()
        };
        let mode = match &args.mode {
            None => None,
            Some(mode) => Some(
                u32::from_str_radix(mode.trim_start_matches("0o"), 8)
                    .ok()
                    .filter(|mode| *mode <= 0o7777)
                    .ok_or_else(|| {
                        ToolError::Invalid(format!(
                            "mode {mode:?} is not octal permission bits like \"644\" or \"755\""
                        ))
                    })?,
            ),
        };
        let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
        let sandbox = lease.sandbox().await?;
        let written = sandbox.write_file(&args.path, &data, mode).await;
        let entry = lease.check(written).await?;
        Ok(text(format!(
            "wrote {} bytes to {} (mode {:o})",
            entry.size, entry.path, entry.mode
        )))
    }

    async fn list_files_in(&self, args: ListFiles) -> Outcome {
        let path = args.path.unwrap_or_else(|| ".".to_owned());
        let depth = args.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
        let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
        let sandbox = lease.sandbox().await?;
        let listed = sandbox.list(&path, depth).await;
        let listing = lease.check(listed).await?;
        let mut lines: Vec<String> = listing.entries.iter().map(render_entry).collect();
        if lines.is_empty() {
            lines.push(format!("{path} is empty"));
        }
        if listing.truncated {
            lines.push("[... more entries: list a subdirectory or a smaller depth]".to_owned());
        }
        Ok(text(lines.join("\n")))
    }

    async fn checkpoint_in(&self, args: CheckpointSandbox) -> Outcome {
        let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
        checkpoint(&mut lease, args.name.as_deref()).await?;
        Ok(text(match &args.name {
            Some(name) => format!("checkpointed {} as {name:?}", lease.id()),
            None => format!("checkpointed {}", lease.id()),
        }))
    }

    async fn fork_in(&self, args: ForkSandbox) -> Outcome {
        let (id, token) = {
            let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
            if args.checkpoint.is_none() {
                checkpoint(&mut lease, None).await?;
            }
            (lease.id().to_owned(), lease.token().to_owned())
        };
        let options = CreateOptions {
            from_checkpoint: Some(ForkSource {
                sandbox_id: id.clone(),
                sandbox_token: token,
                name: args.checkpoint.clone(),
            }),
            ..self.create_options()
        };
        let fork = Sandbox::create(self.sandboxes.url(), options).await?;
        let fork_id = self.sandboxes.insert(fork);
        eprintln!("sandboxctl mcp: created sandbox {fork_id} (a fork of {id})");
        Ok(CallToolResult::structured(json!({
            "sandbox_id": fork_id,
            "forked_from": id,
            "checkpoint": args.checkpoint,
        })))
    }

    async fn kill_in(&self, args: SandboxRef) -> Outcome {
        let mut lease = self.sandboxes.lease(&args.sandbox_id)?;
        let sandbox = lease.sandbox().await?;
        let killed = sandbox.kill().await;
        lease.check(killed).await?;
        lease.disconnect().await;
        self.sandboxes.remove(lease.id());
        Ok(text(format!("killed {}", lease.id())))
    }
}

#[tool_router]
impl SandboxTools {
    /// Create a new sandbox: a Linux machine (gVisor) with Python 3 and bash,
    /// whose files, processes and memory persist between calls. Returns its
    /// sandbox_id, which the other tools take.
    #[tool]
    async fn create_sandbox(&self, Parameters(args): Parameters<CreateSandbox>) -> CallToolResult {
        let options = CreateOptions {
            image: args.image,
            ..self.create_options()
        };
        let created = match Sandbox::create(self.sandboxes.url(), options).await {
            Ok(sandbox) => {
                let id = self.sandboxes.insert(sandbox);
                // On stderr (the client's log), for an operator to find a
                // sandbox this process could not kill (`sandboxctl delete`).
                eprintln!("sandboxctl mcp: created sandbox {id}");
                Ok(CallToolResult::structured(json!({"sandbox_id": id})))
            }
            Err(err) => Err(err.into()),
        };
        self.finish("create_sandbox", created)
    }

    /// Run a program in a sandbox and return its output (stdout, then stderr
    /// after a "[stderr]" line) and exit code. Each stream is kept to 1 MiB
    /// (its start and end). With a progress token the output also streams
    /// as progress notifications while it runs.
    #[tool]
    async fn run_code(
        &self,
        Parameters(args): Parameters<RunCode>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        self.finish("run_code", self.run_code_in(args, context).await)
    }

    /// Read a file of a sandbox (up to 1 MiB a call; offset and length read
    /// a part of a larger one). Binary content comes back as base64.
    #[tool]
    async fn read_file(&self, Parameters(args): Parameters<ReadFile>) -> CallToolResult {
        self.finish("read_file", self.read_file_in(args).await)
    }

    /// Write a file in a sandbox (created with its parent directories, or replaced).
    #[tool]
    async fn write_file(&self, Parameters(args): Parameters<WriteFile>) -> CallToolResult {
        self.finish("write_file", self.write_file_in(args).await)
    }

    /// List a directory of a sandbox: type (d directory, - file, l symlink),
    /// permission bits, size and path of each entry.
    #[tool]
    async fn list_files(&self, Parameters(args): Parameters<ListFiles>) -> CallToolResult {
        self.finish("list_files", self.list_files_in(args).await)
    }

    /// Save a sandbox's whole state (memory, processes, files), optionally
    /// under a name that fork_sandbox can start from. The sandbox stays usable.
    #[tool]
    async fn checkpoint_sandbox(
        &self,
        Parameters(args): Parameters<CheckpointSandbox>,
    ) -> CallToolResult {
        self.finish("checkpoint_sandbox", self.checkpoint_in(args).await)
    }

    /// Start a new, independent sandbox as a copy of another one (its files,
    /// memory and processes, as they are now or as a named checkpoint kept
    /// them). Returns the new sandbox_id; the original is unchanged.
    #[tool]
    async fn fork_sandbox(&self, Parameters(args): Parameters<ForkSandbox>) -> CallToolResult {
        self.finish("fork_sandbox", self.fork_in(args).await)
    }

    /// Destroy a sandbox and everything in it.
    #[tool]
    async fn kill_sandbox(&self, Parameters(args): Parameters<SandboxRef>) -> CallToolResult {
        self.finish("kill_sandbox", self.kill_in(args).await)
    }
}

#[tool_handler(
    router = self.tool_router,
    name = "sandboxd",
    instructions = "Stateful code sandboxes (Python and bash in gVisor). Create one with create_sandbox and pass its sandbox_id to the other tools; files and processes persist between calls."
)]
impl ServerHandler for SandboxTools {}

/// Checkpoints the leased sandbox; its connection ends with it (the next
/// call attaches, restoring it).
async fn checkpoint(lease: &mut Lease, name: Option<&str>) -> Result<(), ToolError> {
    let sandbox = lease.sandbox().await?;
    let outcome = sandbox.checkpoint(name).await;
    lease.disconnect().await;
    lease.check(outcome).await
}

fn text(message: String) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(message)])
}

fn render_entry(entry: &FileEntry) -> String {
    let kind = match entry.kind {
        FileKind::Directory => 'd',
        FileKind::File => '-',
        FileKind::Symlink => 'l',
        FileKind::Other => '?',
    };
    let mut line = format!(
        "{kind} {:04o} {:>10} {}",
        entry.mode, entry.size, entry.path
    );
    if let Some(target) = &entry.target {
        line.push_str(&format!(" -> {target}"));
    }
    line
}

/// The error as a model should read it.
fn describe(err: &(impl std::fmt::Display + ?Sized)) -> String {
    err.to_string()
}
