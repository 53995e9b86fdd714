//! The `SandboxRuntime` port: what the controllers need from whatever runs
//! sandboxes (gVisor in production, a fake in the controllers' tests).
//!
//! A runtime runs sandboxes on this host only. Moving one between hosts is the
//! controllers' business: they call `checkpoint` here, record the returned
//! manifest, and `restore` it on the other host.
//!
//! # Guarantees an implementation gives
//! - One execution at a time per sandbox: `exec` while one runs fails with
//!   [`RuntimeError::ExecutionInProgress`].
//! - An [`Execution`]'s event stream ends with exactly one `Exited`.
//! - `checkpoint` either returns a manifest whose image is in the store and the
//!   local sandbox gone, or an error with the sandbox still running (or, if the
//!   runtime itself failed mid-way, gone with [`RuntimeError::Lost`]).
//! - `restore` verifies the image's size and SHA-256 before using it.

use std::collections::BTreeMap;
use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;

use crate::api::{CheckpointManifest, SandboxId, SnapshotManifest};
use crate::files::{FsError, FsReply, FsRequest};
use crate::store::ObjectKey;

pub mod error;

pub use error::RuntimeError;

/// Completes once a handoff's image watched for by
/// [`SandboxRuntime::prefetch_checkpoint`] is in the store, or the watch
/// ended without it.
pub type ImageLanded = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>;

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `bash -c CODE` in a fresh process.
    Bash(String),
    /// `python3 -u -c CODE` in a fresh process.
    Python(String),
    /// CODE as a cell of the sandbox's persistent Python session, whose
    /// globals survive between executions and across checkpoint/restore.
    PythonSession(String),
}

/// A terminal's size in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminalSize {
    pub cols: u16,
    pub rows: u16,
}

/// An execution request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    pub command: Command,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// The execution may survive a checkpoint (the sandbox was created with
    /// `keep_executions`): the runtime keeps its output until it is delivered
    /// (see [`ExecControl::begin_delivery`]) so a restore elsewhere can send
    /// the rest.
    pub resumable: bool,
    /// Run on a pseudo-terminal of this size (one stream of raw bytes each
    /// way, output as stdout) instead of pipes.
    pub pty: Option<TerminalSize>,
    /// A Python session cell reports rich results ([`ExecEvent::Result`]):
    /// its last expression's value and its matplotlib figures.
    pub results: bool,
}

impl ExecRequest {
    pub fn new(command: Command) -> Self {
        Self {
            command,
            env: BTreeMap::new(),
            cwd: None,
            resumable: false,
            pty: None,
            results: false,
        }
    }
}

/// What an execution produces, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Bytes),
    Stderr(Bytes),
    /// A rich result of a session cell that asked for them
    /// ([`ExecRequest::results`]): a JSON object `{"kind", "data"}`, `data`
    /// a MIME bundle (`text/plain`, `image/png` as base64, ...).
    Result(Bytes),
    /// The process ended: its exit code, or 128 + signal.
    Exited(i32),
    /// Work that had to follow the execution failed (the after-exec hook,
    /// e.g. the workspace upload): sent before [`Self::Exited`], so the
    /// client learns it before the execution's end. Not an output event:
    /// it takes no event number of its own.
    AfterExecFailed(String),
    /// The runtime killed the execution itself, for a forced checkpoint (a
    /// handoff's or a shutdown's): its end follows, and is reported as
    /// forced. Not an output event: it takes no event number.
    ForceKilled,
    /// The hold on the sandbox was lost while the execution ran (another
    /// instance took it over): its end must not be reported, nor taken for
    /// a stop. Sent by the controller's relay, never by a runtime; the last
    /// event.
    HoldLost,
}

/// Controls a running execution.
#[async_trait]
pub trait ExecControl: Send + Sync + fmt::Debug {
    async fn write_stdin(&self, data: Bytes) -> Result<(), RuntimeError>;
    async fn close_stdin(&self) -> Result<(), RuntimeError>;
    /// Kills the execution's whole process tree.
    async fn kill(&self) -> Result<(), RuntimeError>;

    /// Resizes the execution's terminal (one started with a `pty`).
    async fn resize(&self, _size: TerminalSize) -> Result<(), RuntimeError> {
        Err(RuntimeError::Invalid(
            "the execution has no terminal".into(),
        ))
    }

    /// Asks to hand the output of the `event`-th event of this execution
    /// (counted from 1 on this host; 0 for a frame of the caller's own) to
    /// the client. `false`: the execution is being moved with its sandbox and
    /// nothing more may be delivered here (what was not delivered goes with
    /// it). A `true` must be followed by [`Self::end_delivery`].
    ///
    /// Only resumable executions ever refuse; the default always delivers.
    fn begin_delivery(&self, _event: u64) -> bool {
        true
    }

    /// Ends [`Self::begin_delivery`]: `delivered` says whether the frame
    /// reached the socket's writer.
    fn end_delivery(&self, _event: u64, _delivered: bool) {}

    /// The caller dropped the output of events up to `event` undelivered
    /// (its replay buffer was full): it will never be delivered anywhere.
    fn dropped(&self, _event: u64) {}
}

/// A started execution.
#[derive(Debug)]
pub struct Execution {
    pub events: mpsc::Receiver<ExecEvent>,
    pub control: Box<dyn ExecControl>,
}

/// How to create a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreateOptions {
    /// Populate the filesystem from this snapshot.
    pub snapshot_name: Option<String>,
    /// The sandbox's network (`none` by default).
    pub network: crate::api::NetworkMode,
    /// The sandbox image (a name or a digest); `None`: the snapshot's image,
    /// else the runtime's default.
    pub image: Option<String>,
}

/// How to checkpoint a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRequest {
    /// A fresh id: images are write-once.
    pub checkpoint_id: SandboxId,
    /// The holder's lease epoch, recorded in the manifest.
    pub epoch: u64,
    pub name: Option<String>,
    /// Kill a running execution first instead of refusing.
    pub force: bool,
    /// Checkpoint a running (resumable) execution with the sandbox instead
    /// of killing it or refusing (whatever `force` says); its undelivered
    /// output moves with it. Only for checkpoints that release the sandbox:
    /// the execution goes on where the sandbox is restored next.
    pub keep_executions: bool,
}

/// What a runtime's warm pool (sandboxes booted ahead of demand) holds now,
/// and how it served creates: what admission sizes it by and `/metrics`
/// reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmPoolStats {
    /// How many sandboxes it keeps ready (`--warm-pool`, or less after a shrink).
    pub target: usize,
    /// How many are ready now.
    pub ready: usize,
    /// The memory the ready ones use (their memory cgroups; 0 where unreadable).
    pub memory_bytes: u64,
    /// Creates that took a warm sandbox.
    pub hits: u64,
    /// Creates of the pool's image and network that found none ready.
    pub misses: u64,
    /// Boots the refill made, and those that failed.
    pub boots: u64,
    pub boot_failures: u64,
}

/// Runs sandboxes on this host.
#[async_trait]
pub trait SandboxRuntime: Send + Sync + fmt::Debug {
    async fn create(
        &self,
        sandbox: &SandboxId,
        options: &CreateOptions,
    ) -> Result<(), RuntimeError>;
    async fn exec(
        &self,
        sandbox: &SandboxId,
        request: ExecRequest,
    ) -> Result<Execution, RuntimeError>;
    /// Checkpoints to the store and removes the local sandbox.
    async fn checkpoint(
        &self,
        sandbox: &SandboxId,
        request: CheckpointRequest,
    ) -> Result<CheckpointManifest, RuntimeError>;
    /// Restores a checkpoint taken anywhere, verifying it first.
    async fn restore(
        &self,
        sandbox: &SandboxId,
        manifest: &CheckpointManifest,
    ) -> Result<(), RuntimeError>;
    /// Saves the files user code created or changed under `name`.
    async fn snapshot_filesystem(
        &self,
        sandbox: &SandboxId,
        name: &str,
    ) -> Result<SnapshotManifest, RuntimeError>;
    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), RuntimeError>;
    fn is_running(&self, sandbox: &SandboxId) -> bool;

    /// Checks what a create asks for (its image, the snapshot it starts
    /// from) before anything about the sandbox is recorded, so that a create
    /// the runtime would refuse leaves nothing behind. `Err` says what is
    /// wrong in words for the client. The default accepts everything.
    async fn check_create(&self, _options: &CreateOptions) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// A create of `sandbox` with `options` is being recorded in the store:
    /// the runtime may boot its container now, beside those writes, for
    /// [`Self::create`] to take up (decision 23). Returns once that is done
    /// (at once when there is nothing to prepare); a failure only means
    /// `create` boots it itself. No user code runs before `create`.
    async fn prepare_create(&self, _sandbox: &SandboxId, _options: &CreateOptions) {}

    /// The create [`Self::prepare_create`] prepared for will not come.
    fn forget_prepared(&self, _sandbox: &SandboxId) {}

    /// A handoff of `sandbox` to this instance is under way and its
    /// checkpoint image will be `image` (decision 24): the runtime may watch
    /// for it and download it as soon as it exists, for the next
    /// [`Self::restore`] of `sandbox` to use once its digest matches the
    /// manifest. A hint: called again for the same image it does nothing
    /// more, and a restore without it downloads as before. Returns
    /// `Some(landed)` while the image is watched for and not in the store
    /// yet, `landed` completing once it is (or the watch ends): the holder
    /// is still checkpointing, and its transfer comes after the image, so
    /// the waiting taker may look at the lock less often until then
    /// (decision 29). `None`: not watched here (nothing is known).
    fn prefetch_checkpoint(&self, _sandbox: &SandboxId, _image: &ObjectKey) -> Option<ImageLanded> {
        None
    }
    /// The execution a restore brought back (one checkpointed with
    /// `keep_executions` while it ran or before its output was delivered),
    /// once: whoever takes it streams the rest of its output.
    fn take_resumed(&self, _sandbox: &SandboxId) -> Option<Execution> {
        None
    }

    /// One request of the filesystem API on a sandbox running here
    /// (`crate::files`). Runs beside an execution; never waits for one.
    async fn fs(&self, _sandbox: &SandboxId, _request: FsRequest) -> Result<FsReply, FsError> {
        Err(FsError::Unsupported)
    }
}
