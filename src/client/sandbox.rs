//! The user-facing handles: [`Sandbox`] and the [`Process`] of one execution.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::sync::mpsc;

use super::connection::{CookieJar, Event, Shared, Socket, drive, next_event, open};
use super::error::ClientError;

#[path = "files.rs"]
pub(super) mod files;

/// How long [`Sandbox::close`] waits for the server to let the connection go.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// How long an operation (create, restore, checkpoint) may take.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(180);

/// Called with each status the server reports while an operation is under
/// way (`SANDBOX_RESTORING`, lock progress, `SANDBOX_CHECKPOINTING`, ...), for
/// progress displays.
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<ReportFn>>);

type ReportFn = dyn Fn(&str) + Send + Sync;

impl Progress {
    pub fn new(report: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(report)))
    }

    fn report(&self, status: &str) {
        if let Some(report) = &self.0 {
            report(status);
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Progress(..)"
        } else {
            "Progress(none)"
        })
    }
}

/// Options of `/create` (the init message).
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// Seconds without activity before the sandbox stops; `None`: never.
    pub idle_timeout_s: Option<u64>,
    pub enable_checkpoint: bool,
    pub enable_sandbox_handoff: bool,
    pub enable_idle_timeout_auto_checkpoint: bool,
    /// A move (handoff, eviction, drain) takes a running execution along:
    /// its process keeps streaming after the library follows the sandbox.
    pub keep_executions: bool,
    pub filesystem_snapshot_name: Option<String>,
    /// The proof of owning that snapshot: the token of the sandbox that
    /// made it, or the snapshot token it returned (docs/security.md).
    pub filesystem_snapshot_token: Option<String>,
    /// The sandbox image (`GET /images` lists them); `None`: the server's default.
    pub image: Option<String>,
    /// Sync `/workspace` with this workspace (sandboxes given the same name
    /// share its files; see docs/workspaces.md).
    pub workspace_id: Option<String>,
    /// The secret that owns a named workspace (16–256 characters; required
    /// with `workspace_id`).
    pub workspace_token: Option<String>,
    /// The workspace's hook template (`default` when unset).
    pub workspace_template: Option<String>,
    /// Start as a fork of another sandbox's checkpoint (see [`Sandbox::fork`]).
    pub from_checkpoint: Option<ForkSource>,
    pub progress: Progress,
}

/// The checkpoint a fork starts from: a sandbox, its token, and a
/// checkpoint name (`None`: its latest checkpoint).
#[derive(Clone, Default)]
pub struct ForkSource {
    pub sandbox_id: String,
    pub sandbox_token: String,
    pub name: Option<String>,
}

impl std::fmt::Debug for ForkSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkSource")
            .field("sandbox_id", &self.sandbox_id)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Options of `/attach`.
#[derive(Debug, Clone, Default)]
pub struct AttachOptions {
    /// Restore this named checkpoint instead of the latest.
    pub checkpoint: Option<String>,
    pub progress: Progress,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Python,
    Bash,
    /// The sandbox's persistent Python session (globals survive).
    PythonSession,
}

/// How an execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// The exit code (128 + signal when killed); `None` if the server did
    /// not report one (an older server).
    pub code: Option<i32>,
    /// It was killed by `kill_process` or a forced checkpoint.
    pub killed: bool,
}

impl ExitStatus {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// A chunk of output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputChunk {
    Stdout(String),
    Stderr(String),
}

/// Everything an execution printed, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    pub status: ExitStatus,
}

/// A connected sandbox. Dropping it closes the connection (the sandbox stays).
#[derive(Debug)]
pub struct Sandbox {
    id: String,
    token: String,
    shared: Arc<Shared>,
    outgoing: mpsc::UnboundedSender<String>,
    /// An upload's frame and bytes, in order (a few in flight: the socket
    /// paces the upload).
    binary: mpsc::Sender<tokio_tungstenite::tungstenite::protocol::Message>,
    events: tokio::sync::Mutex<mpsc::UnboundedReceiver<Event>>,
    progress: Progress,
    /// Asks the connection's driver for the close handshake.
    close: tokio::sync::oneshot::Sender<()>,
    driver: tokio::task::JoinHandle<()>,
}

fn ws_base(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if let Some(rest) = url.strip_prefix("http://") {
        format!("ws://{rest}")
    } else if let Some(rest) = url.strip_prefix("https://") {
        format!("wss://{rest}")
    } else {
        url.to_owned()
    }
}

/// Reads the handshake until `SANDBOX_RUNNING`; the id and token if the
/// server sent them.
async fn handshake(
    socket: &mut Socket,
    progress: &Progress,
) -> Result<Option<(String, String)>, ClientError> {
    let mut ids = None;
    let wait = async {
        loop {
            match next_event(socket).await {
                Ok(Event::SandboxId { id, token }) => ids = Some((id, token)),
                Ok(Event::Status { status, .. }) if status == "SANDBOX_RUNNING" => {
                    progress.report(&status);
                    return Ok(());
                }
                Ok(Event::Status { status, message })
                    if status.ends_with("_ERROR")
                        || status == "SANDBOX_NOT_FOUND"
                        || status == "SANDBOX_IN_USE" =>
                {
                    let message = match message {
                        Some(message) => Some(message),
                        // Older servers put the text in the following event.
                        None => {
                            match tokio::time::timeout(Duration::from_secs(1), next_event(socket))
                                .await
                            {
                                Ok(Ok(Event::Error(message))) => Some(message),
                                _ => None,
                            }
                        }
                    };
                    return Err(ClientError::from_status(&status, message.as_deref()));
                }
                Ok(Event::Status { status, .. }) => progress.report(&status),
                Ok(_) => {}
                Err(why) => return Err(ClientError::Closed(why.to_string())),
            }
        }
    };
    match tokio::time::timeout(OPERATION_TIMEOUT, wait).await {
        Ok(result) => result.map(|()| ids),
        Err(_) => Err(ClientError::Closed("no SANDBOX_RUNNING in time".to_owned())),
    }
}

impl Sandbox {
    /// Creates a sandbox on the server at `url` (`ws://host:port` or `http://…`).
    pub async fn create(url: &str, options: CreateOptions) -> Result<Self, ClientError> {
        let base = ws_base(url);
        let jar = CookieJar::default();
        let mut socket = open(&format!("{base}/create"), &jar).await?;
        let mut init = json!({
            "idle_timeout": options.idle_timeout_s.unwrap_or(0),
            "enable_checkpoint": options.enable_checkpoint,
            "enable_sandbox_handoff": options.enable_sandbox_handoff,
            "enable_idle_timeout_auto_checkpoint": options.enable_idle_timeout_auto_checkpoint,
        });
        if options.keep_executions {
            init["keep_executions"] = json!(true);
        }
        if let Some(name) = &options.filesystem_snapshot_name {
            init["filesystem_snapshot_name"] = json!(name);
        }
        if let Some(token) = &options.filesystem_snapshot_token {
            init["filesystem_snapshot_token"] = json!(token);
        }
        if let Some(image) = &options.image {
            init["image"] = json!(image);
        }
        if let Some(workspace) = &options.workspace_id {
            init["workspace_id"] = json!(workspace);
        }
        if let Some(token) = &options.workspace_token {
            init["workspace_token"] = json!(token);
        }
        if let Some(template) = &options.workspace_template {
            init["workspace_template"] = json!(template);
        }
        if let Some(source) = &options.from_checkpoint {
            init["from_checkpoint"] = json!({
                "sandbox_id": source.sandbox_id,
                "sandbox_token": source.sandbox_token,
                "name": source.name,
            });
        }
        use futures::SinkExt;
        socket
            .send(tokio_tungstenite::tungstenite::Message::text(
                init.to_string(),
            ))
            .await
            .map_err(|err| ClientError::Closed(err.to_string()))?;
        let (id, token) = handshake(&mut socket, &options.progress)
            .await?
            .ok_or_else(|| ClientError::Protocol("no sandbox_id before SANDBOX_RUNNING".into()))?;
        let mut sandbox = Self::start(base, id, token, jar, socket);
        sandbox.progress = options.progress;
        Ok(sandbox)
    }

    /// Starts a new, independent sandbox (its own id, token and
    /// checkpoints) from this sandbox's latest checkpoint, or the one named
    /// `checkpoint`: its memory, processes, files and Python session.
    pub async fn fork(
        &self,
        url: &str,
        checkpoint: Option<&str>,
        mut options: CreateOptions,
    ) -> Result<Self, ClientError> {
        options.from_checkpoint = Some(ForkSource {
            sandbox_id: self.id.clone(),
            sandbox_token: self.token.clone(),
            name: checkpoint.map(str::to_owned),
        });
        Self::create(url, options).await
    }

    /// Attaches to an existing sandbox (restoring it here if needed).
    pub async fn attach(
        url: &str,
        id: &str,
        token: &str,
        options: AttachOptions,
    ) -> Result<Self, ClientError> {
        let base = ws_base(url);
        let jar = CookieJar::default();
        let mut target = format!("{base}/attach/{id}?sandbox_token={token}");
        if let Some(name) = &options.checkpoint {
            target.push_str(&format!("&checkpoint={name}"));
        }
        let mut socket = open(&target, &jar).await?;
        handshake(&mut socket, &options.progress).await?;
        let mut sandbox = Self::start(base, id.to_owned(), token.to_owned(), jar, socket);
        sandbox.progress = options.progress;
        Ok(sandbox)
    }

    fn start(base: String, id: String, token: String, jar: CookieJar, socket: Socket) -> Self {
        let (sandbox_events, events) = mpsc::unbounded_channel();
        let (outgoing, outgoing_receiver) = mpsc::unbounded_channel();
        let (binary, binary_receiver) = mpsc::channel(4);
        let shared = Arc::new(Shared {
            jar,
            attach_url: format!("{base}/attach/{id}?sandbox_token={token}"),
            reconnect: std::sync::atomic::AtomicBool::new(true),
            user_checkpoint: std::sync::atomic::AtomicBool::new(false),
            process: Mutex::new(None),
            sandbox_events,
            files: Mutex::new(std::collections::HashMap::new()),
            download: Mutex::new(None),
        });
        let (close, close_receiver) = tokio::sync::oneshot::channel();
        let driver = tokio::spawn(drive(
            socket,
            Arc::clone(&shared),
            outgoing_receiver,
            binary_receiver,
            close_receiver,
        ));
        Self {
            id,
            token,
            shared,
            outgoing,
            binary,
            events: tokio::sync::Mutex::new(events),
            progress: Progress::default(),
            close,
            driver,
        }
    }

    /// Closes the connection and waits for the server to let it go (the
    /// sandbox stays). After it returns the sandbox's one attach slot is
    /// free, so the next attach (this process's or another's) is not refused
    /// as in use. Dropping the handle instead closes in the background.
    pub async fn close(self) {
        let Self {
            close, mut driver, ..
        } = self;
        let _ = close.send(());
        // A connected driver sends what was queued, then the close frame, and
        // reads until the server answers; a reconnecting one ends at once
        // (no socket to close). Bounded all the same: a send to a server that
        // stopped reading can stall, and then the driver is stopped, its
        // socket dropped (no handshake), before this returns.
        if tokio::time::timeout(CLOSE_WAIT, &mut driver).await.is_err() {
            driver.abort();
            let _ = driver.await;
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    fn send(&self, frame: serde_json::Value) -> Result<(), ClientError> {
        self.outgoing
            .send(frame.to_string())
            .map_err(|_| ClientError::Closed("the connection is gone".to_owned()))
    }

    /// Starts an execution; returns once the server reports it running.
    pub async fn exec(&self, language: Language, code: &str) -> Result<Process, ClientError> {
        let frame = match language {
            Language::Python => json!({"language": "python", "code": code}),
            Language::Bash => json!({"language": "bash", "code": code}),
            Language::PythonSession => json!({"language": "python", "code": code, "session": true}),
        };
        self.start_process(frame).await
    }

    /// Starts `bash -c CODE` on a terminal of `cols` x `rows`: its output
    /// (raw terminal bytes, as stdout) and stdin are one stream each way;
    /// [`ProcessHandle::resize`] changes the size.
    pub async fn exec_terminal(
        &self,
        code: &str,
        cols: u16,
        rows: u16,
    ) -> Result<Process, ClientError> {
        self.start_process(
            json!({"language": "bash", "code": code, "pty": {"cols": cols, "rows": rows}}),
        )
        .await
    }

    async fn start_process(&self, frame: serde_json::Value) -> Result<Process, ClientError> {
        let (sender, mut events) = mpsc::unbounded_channel();
        if !self.shared.claim_process(sender) {
            return Err(ClientError::ExecutionInProgress(
                "another process runs in this sandbox".to_owned(),
            ));
        }
        self.send(frame)?;
        loop {
            match events.recv().await {
                Some(Event::Status { status, .. }) if status == "SANDBOX_EXECUTION_RUNNING" => {
                    return Ok(Process {
                        events,
                        outgoing: self.outgoing.clone(),
                        exit_code: None,
                        killed: false,
                        finished: false,
                    });
                }
                Some(Event::Status { status, message }) if status.ends_with("_ERROR") => {
                    self.shared.set_process(None);
                    return Err(ClientError::from_status(&status, message.as_deref()));
                }
                Some(Event::Closed(why)) => return Err(ClientError::Closed(why)),
                None => return Err(ClientError::Closed("the connection is gone".into())),
                Some(_) => {}
            }
        }
    }

    /// Waits for one of `done` (Ok) or an error status on the sandbox channel.
    async fn await_status(&self, done: &[&str]) -> Result<(), ClientError> {
        let mut events = self.events.lock().await;
        let wait = async {
            loop {
                match events.recv().await {
                    Some(Event::Status { status, .. }) if done.contains(&status.as_str()) => {
                        return Ok(());
                    }
                    Some(Event::Status { status, message })
                        if status.ends_with("_ERROR") && status != "SANDBOX_LOCK_RENEWAL_ERROR" =>
                    {
                        return Err(ClientError::from_status(&status, message.as_deref()));
                    }
                    Some(Event::Closed(why)) => return Err(ClientError::Closed(why)),
                    None => return Err(ClientError::Closed("the connection is gone".into())),
                    Some(Event::Status { status, .. }) => self.progress.report(&status),
                    Some(_) => {}
                }
            }
        };
        tokio::time::timeout(OPERATION_TIMEOUT, wait)
            .await
            .map_err(|_| ClientError::Closed("no answer in time".into()))?
    }

    /// Checkpoints the sandbox (under `name`, if given). The connection ends;
    /// [`Sandbox::attach`] restores it.
    pub async fn checkpoint(&self, name: Option<&str>) -> Result<(), ClientError> {
        self.shared.user_checkpoint.store(true, Ordering::Release);
        self.shared.reconnect.store(false, Ordering::Release);
        let mut frame = json!({"action": "checkpoint"});
        if let Some(name) = name {
            frame["name"] = json!(name);
        }
        self.send(frame)?;
        let outcome = self.await_status(&["SANDBOX_CHECKPOINTED"]).await;
        if outcome.is_err() {
            self.shared.user_checkpoint.store(false, Ordering::Release);
            self.shared.reconnect.store(true, Ordering::Release);
        }
        outcome
    }

    /// Saves the sandbox's changed files as filesystem snapshot `name`.
    pub async fn snapshot_filesystem(&self, name: &str) -> Result<(), ClientError> {
        self.send(json!({"action": "snapshot_filesystem", "name": name}))?;
        self.await_status(&["SANDBOX_FILESYSTEM_SNAPSHOT_CREATED"])
            .await
    }

    /// Destroys the sandbox.
    pub async fn kill(&self) -> Result<(), ClientError> {
        self.shared.reconnect.store(false, Ordering::Release);
        self.send(json!({"action": "kill_sandbox"}))?;
        self.await_status(&["SANDBOX_KILLED"]).await
    }
}

/// One execution: its output as it comes, stdin, kill, and its end.
#[derive(Debug)]
pub struct Process {
    events: mpsc::UnboundedReceiver<Event>,
    outgoing: mpsc::UnboundedSender<String>,
    exit_code: Option<i32>,
    killed: bool,
    finished: bool,
}

impl Process {
    /// The next chunk of output; `None` once the execution has ended.
    pub async fn next(&mut self) -> Result<Option<OutputChunk>, ClientError> {
        if self.finished {
            return Ok(None);
        }
        loop {
            match self.events.recv().await {
                Some(Event::Stdout(data)) => return Ok(Some(OutputChunk::Stdout(data))),
                Some(Event::Stderr(data)) => return Ok(Some(OutputChunk::Stderr(data))),
                Some(Event::ExitCode(code)) => self.exit_code = Some(code),
                Some(Event::Status { status, .. }) if status == "SANDBOX_EXECUTION_DONE" => {
                    self.finished = true;
                    return Ok(None);
                }
                Some(Event::Status { status, .. })
                    if status == "SANDBOX_EXECUTION_FORCE_KILLED" =>
                {
                    self.killed = true;
                }
                Some(Event::Status { status, message })
                    if status == "SANDBOX_EXECUTION_ERROR" || status == "SANDBOX_ERROR" =>
                {
                    self.finished = true;
                    return Err(ClientError::from_status(&status, message.as_deref()));
                }
                Some(Event::Closed(why)) => {
                    self.finished = true;
                    return Err(ClientError::Closed(why));
                }
                None => {
                    self.finished = true;
                    return Err(ClientError::Closed("the connection is gone".into()));
                }
                // A replayed RUNNING after a reconnect, stdin errors, ...
                Some(_) => {}
            }
        }
    }

    /// A handle for stdin and kill that another task can hold while this
    /// one reads the output.
    pub fn handle(&self) -> ProcessHandle {
        ProcessHandle {
            outgoing: self.outgoing.clone(),
        }
    }

    /// Writes to the process's stdin (buffered while reconnecting).
    pub fn write_stdin(&self, data: &str) -> Result<(), ClientError> {
        self.handle().write_stdin(data)
    }

    /// Kills the process (its whole tree); the sandbox stays.
    pub fn kill(&self) -> Result<(), ClientError> {
        self.handle().kill()
    }

    /// Waits for the end, discarding output not read yet.
    pub async fn wait(mut self) -> Result<ExitStatus, ClientError> {
        while self.next().await?.is_some() {}
        Ok(self.status())
    }

    /// Waits for the end, collecting the output.
    pub async fn output(mut self) -> Result<Output, ClientError> {
        let mut stdout = String::new();
        let mut stderr = String::new();
        while let Some(chunk) = self.next().await? {
            match chunk {
                OutputChunk::Stdout(data) => stdout.push_str(&data),
                OutputChunk::Stderr(data) => stderr.push_str(&data),
            }
        }
        Ok(Output {
            stdout,
            stderr,
            status: self.status(),
        })
    }

    /// How it ended, once [`Self::next`] returned `None` (before that: no
    /// exit code yet).
    pub fn status(&self) -> ExitStatus {
        ExitStatus {
            code: self.exit_code,
            killed: self.killed,
        }
    }
}

/// Stdin and kill for a running [`Process`], usable from another task.
#[derive(Debug, Clone)]
pub struct ProcessHandle {
    outgoing: mpsc::UnboundedSender<String>,
}

impl ProcessHandle {
    /// Writes to the process's stdin (buffered while reconnecting).
    pub fn write_stdin(&self, data: &str) -> Result<(), ClientError> {
        self.outgoing
            .send(json!({"event": "stdin", "data": data}).to_string())
            .map_err(|_| ClientError::Closed("the connection is gone".into()))
    }

    /// Kills the process (its whole tree); the sandbox stays.
    pub fn kill(&self) -> Result<(), ClientError> {
        self.outgoing
            .send(json!({"action": "kill_process"}).to_string())
            .map_err(|_| ClientError::Closed("the connection is gone".into()))
    }

    /// Resizes the process's terminal (one started with
    /// [`Sandbox::exec_terminal`]).
    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), ClientError> {
        self.outgoing
            .send(json!({"action": "resize", "cols": cols, "rows": rows}).to_string())
            .map_err(|_| ClientError::Closed("the connection is gone".into()))
    }
}
