//! The wire protocol of the earlier Python server, which its Python and
//! TypeScript clients speak (`docs/wire-contract.md`):
//! client frames parsed with the upstream's precedence, server frames written
//! byte-for-byte as the clients expect (compact JSON, exact status strings).
//!
//! Departures from upstream, all invisible to its clients:
//! - a malformed frame (binary, not JSON, not an object, too large), an unknown
//!   `action` or a missing field is a [`FrameError`] answered with an `error`
//!   event, never a dropped connection;
//! - `checkpoint` takes an optional `name` (named checkpoints);
//! - an execution may ask for the persistent Python session
//!   (`"language": "python", "session": true`), and a session cell for rich
//!   results (`"results": true`: `result` events, never sent unasked);
//! - `exit_code` is a new server event sent before `SANDBOX_EXECUTION_DONE`;
//! - the init message takes an optional `network` (`none` or `egress`).

use serde_json::{Map, Value, json};

use super::files::call::{CallError, FsCall};
use super::snapshot_owner::{SnapshotProof, split_name_and_proof};

use controllers::runtime::TerminalSize;

mod terminal;
mod utf8;
use terminal::terminal_size;
pub use utf8::Utf8Stream;

/// Largest client frame accepted (code and stdin chunks included).
pub const MAX_FRAME_BYTES: usize = 1 << 20;

/// Messages larger than this are not read at all: the socket is closed with
/// 1009 (message too big) and a reason. Messages between [`MAX_FRAME_BYTES`]
/// and this get an `error` event and the connection stays.
pub const MAX_MESSAGE_BYTES: usize = 4 * MAX_FRAME_BYTES;

/// Default `idle_timeout` when the init message has none (upstream's default).
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 300;

/// Longest `idle_timeout` accepted: 30 days (`null` or 0 ask for none at
/// all). Larger values are refused at parse time; `u64::MAX` seconds once
/// overflowed the idle timer's `Instant` and panicked a worker.
pub const MAX_IDLE_TIMEOUT_S: u64 = controllers::api::MAX_IDLE_TIMEOUT_S;

/// Every status string the server sends, verbatim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Creating,
    Running,
    Restoring,
    NotFound,
    InUse,
    CreationError,
    RestoreError,
    PermissionDenialError,
    Error,
    Deleting,
    Deleted,
    Killing,
    Killed,
    KillError,
    ExecutionRunning,
    ExecutionDone,
    ExecutionError,
    ExecutionUnsupportedLanguageError,
    ExecutionForceKilled,
    ExecutionForceKillError,
    StdinError,
    Checkpointing,
    Checkpointed,
    CheckpointError,
    ExecutionInProgressError,
    FilesystemSnapshotCreating,
    FilesystemSnapshotCreated,
    FilesystemSnapshotError,
    LockAcquiring,
    LockAcquired,
    LockReleaseRequested,
    LockRenewalError,
    LockReleasing,
    LockReleased,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "SANDBOX_CREATING",
            Self::Running => "SANDBOX_RUNNING",
            Self::Restoring => "SANDBOX_RESTORING",
            Self::NotFound => "SANDBOX_NOT_FOUND",
            Self::InUse => "SANDBOX_IN_USE",
            Self::CreationError => "SANDBOX_CREATION_ERROR",
            Self::RestoreError => "SANDBOX_RESTORE_ERROR",
            Self::PermissionDenialError => "SANDBOX_PERMISSION_DENIAL_ERROR",
            Self::Error => "SANDBOX_ERROR",
            Self::Deleting => "SANDBOX_DELETING",
            Self::Deleted => "SANDBOX_DELETED",
            Self::Killing => "SANDBOX_KILLING",
            Self::Killed => "SANDBOX_KILLED",
            Self::KillError => "SANDBOX_KILL_ERROR",
            Self::ExecutionRunning => "SANDBOX_EXECUTION_RUNNING",
            Self::ExecutionDone => "SANDBOX_EXECUTION_DONE",
            Self::ExecutionError => "SANDBOX_EXECUTION_ERROR",
            Self::ExecutionUnsupportedLanguageError => {
                "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR"
            }
            Self::ExecutionForceKilled => "SANDBOX_EXECUTION_FORCE_KILLED",
            Self::ExecutionForceKillError => "SANDBOX_EXECUTION_FORCE_KILL_ERROR",
            Self::StdinError => "SANDBOX_STDIN_ERROR",
            Self::Checkpointing => "SANDBOX_CHECKPOINTING",
            Self::Checkpointed => "SANDBOX_CHECKPOINTED",
            Self::CheckpointError => "SANDBOX_CHECKPOINT_ERROR",
            Self::ExecutionInProgressError => "SANDBOX_EXECUTION_IN_PROGRESS_ERROR",
            Self::FilesystemSnapshotCreating => "SANDBOX_FILESYSTEM_SNAPSHOT_CREATING",
            Self::FilesystemSnapshotCreated => "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED",
            Self::FilesystemSnapshotError => "SANDBOX_FILESYSTEM_SNAPSHOT_ERROR",
            Self::LockAcquiring => "SANDBOX_LOCK_ACQUIRING",
            Self::LockAcquired => "SANDBOX_LOCK_ACQUIRED",
            Self::LockReleaseRequested => "SANDBOX_LOCK_RELEASE_REQUESTED",
            Self::LockRenewalError => "SANDBOX_LOCK_RENEWAL_ERROR",
            Self::LockReleasing => "SANDBOX_LOCK_RELEASING",
            Self::LockReleased => "SANDBOX_LOCK_RELEASED",
        }
    }
}

/// A frame the server sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerFrame {
    /// `{"event":"status_update","status":S}`, with `message` on errors.
    Status {
        status: Status,
        message: Option<String>,
    },
    /// `{"event":"sandbox_id","sandbox_id":…,"sandbox_token":…}` (create only).
    SandboxId {
        sandbox_id: String,
        sandbox_token: String,
    },
    Stdout(String),
    Stderr(String),
    /// `{"event":"error","message":…}`: always right after an error status.
    Error(String),
    /// Extension: `{"event":"exit_code","exit_code":N}` before EXECUTION_DONE.
    ExitCode(i32),
    /// Extension: an event of the filesystem API (`fs_result`, `fs_error`,
    /// `fs_download`), built by `api::files`.
    Event(Value),
    /// Extension: `{"event":"result","kind":…,"data":{MIME bundle}}`, a rich
    /// result of a session cell that asked for them; with the size of its
    /// JSON (for the replay log's bound).
    Result(Value, usize),
}

impl ServerFrame {
    pub fn status(status: Status) -> Self {
        Self::Status {
            status,
            message: None,
        }
    }

    pub fn status_with(status: Status, message: impl Into<String>) -> Self {
        Self::Status {
            status,
            message: Some(message.into()),
        }
    }

    /// The frame as compact JSON text.
    pub fn to_text(&self) -> String {
        let value = match self {
            Self::Status {
                status,
                message: None,
            } => json!({"event": "status_update", "status": status.as_str()}),
            Self::Status {
                status,
                message: Some(message),
            } => json!({"event": "status_update", "status": status.as_str(), "message": message}),
            Self::SandboxId {
                sandbox_id,
                sandbox_token,
            } => {
                json!({"event": "sandbox_id", "sandbox_id": sandbox_id, "sandbox_token": sandbox_token})
            }
            Self::Stdout(data) => json!({"event": "stdout", "data": data}),
            Self::Stderr(data) => json!({"event": "stderr", "data": data}),
            Self::Error(message) => json!({"event": "error", "message": message}),
            Self::ExitCode(code) => json!({"event": "exit_code", "exit_code": code}),
            Self::Event(value) => return value.to_string(),
            Self::Result(result, _) => {
                json!({"event": "result", "kind": result["kind"], "data": result["data"]})
            }
        };
        value.to_string()
    }
}

/// The init message of `/create`. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitMessage {
    /// `None`: never expires (the client sent 0 or null).
    pub idle_timeout_s: Option<u64>,
    pub enable_checkpoint: bool,
    pub enable_idle_timeout_auto_checkpoint: bool,
    pub enable_sandbox_handoff: bool,
    pub filesystem_snapshot_name: Option<String>,
    /// Extension: the owner's proof for `filesystem_snapshot_name`, from
    /// `"filesystem_snapshot_token"` or a `NAME@TOKEN` name (what the
    /// earlier clients can send; `api::snapshot_owner`).
    pub filesystem_snapshot_proof: Option<SnapshotProof>,
    /// Extension: `"network": "none" | "egress"` (absent: `none`).
    pub network: controllers::api::NetworkMode,
    /// Extension: `"image": NAME`, the sandbox image (absent: the default;
    /// upstream clients never send it).
    pub image: Option<String>,
    /// Sync `/workspace` with the store (an extension: upstream clients never
    /// send it).
    pub workspace: Option<WorkspaceRequest>,
    /// Extension: `"from_checkpoint": {"sandbox_id", "sandbox_token",
    /// "name"?}` starts a fork of that sandbox's checkpoint (named, else
    /// the latest) instead of a fresh sandbox.
    pub from_checkpoint: Option<ForkRequest>,
    /// Extension: `"keep_executions": true`, a move (handoff, eviction,
    /// drain) checkpoints a running execution instead of killing it.
    pub keep_executions: bool,
    /// Extension: `"labels": {"key": "value", ...}`, the client's own
    /// tags, stored in `metadata.json`'s `spec.labels` for operators and
    /// tools (bounded: [`MAX_LABELS`], keys as [`is_label_key`], values up to
    /// [`MAX_LABEL_VALUE_LEN`] bytes).
    pub labels: std::collections::BTreeMap<String, String>,
}

/// Most labels one sandbox may carry.
pub const MAX_LABELS: usize = 32;

/// Longest label value, in bytes.
pub const MAX_LABEL_VALUE_LEN: usize = 256;

/// A label key: 1-63 characters of ASCII letters, digits, `-`, `_` and `.`.
pub fn is_label_key(key: &str) -> bool {
    (1..=63).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The init message's `from_checkpoint`: whose checkpoint to fork, proved
/// by that sandbox's token.
#[derive(Clone, PartialEq, Eq)]
pub struct ForkRequest {
    pub sandbox_id: String,
    pub sandbox_token: String,
    pub name: Option<String>,
}

/// Never prints the token (init messages are logged when refused).
impl std::fmt::Debug for ForkRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkRequest")
            .field("sandbox_id", &self.sandbox_id)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The init message's workspace options: `enable_workspace_sync`,
/// `workspace_id` (default: the sandbox id; naming one enables sync),
/// `workspace_token` (the secret that owns a named workspace),
/// `workspace_template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkspaceRequest {
    pub id: Option<String>,
    pub token: Option<String>,
    pub template: Option<String>,
}

/// Shortest `workspace_token` accepted (a guessable one would hand the
/// workspace's files to anyone).
pub const MIN_WORKSPACE_TOKEN_LEN: usize = 16;

/// The languages an execution may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Python,
    Bash,
}

/// A client frame after setup, by upstream's precedence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientFrame {
    Checkpoint {
        name: Option<String>,
    },
    SnapshotFilesystem {
        name: String,
        /// Extension: `"filesystem_snapshot_token"`, to write under the
        /// owner it proves (absent: the sandbox's own).
        proof: Option<SnapshotProof>,
    },
    KillProcess,
    KillSandbox,
    Stdin {
        data: String,
    },
    Reconnect,
    Exec {
        language: Language,
        code: String,
        session: bool,
        /// Extension: `"pty": {"cols", "rows"}`, a terminal.
        pty: Option<TerminalSize>,
        /// Extension: `"results": true` (a session cell only), rich results
        /// as `result` events.
        results: bool,
    },
    /// Extension: `{"action":"resize","cols":N,"rows":N}`, the terminal's size.
    Resize(TerminalSize),
    /// Extension: `{"action":"fs_<op>", …}`, the filesystem API.
    Fs(FsCall),
}

/// Why a client frame was refused, with the status to answer it with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("binary frames are not supported; send JSON text frames")]
    Binary,
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("{0}; frames are limited to {MAX_FRAME_BYTES} bytes")]
    MessageTooBig(String),
    #[error("frame is not valid JSON: {0}")]
    NotJson(String),
    #[error("frame must be a JSON object")]
    NotObject,
    #[error(
        "unknown action {0:?}; expected checkpoint, snapshot_filesystem, kill_process, kill_sandbox, reconnect or fs_*"
    )]
    UnknownAction(String),
    #[error("Unsupported language: {0}. Supported languages are: python, bash")]
    UnsupportedLanguage(String),
    #[error(
        "Invalid message format. 'language' and 'code' fields are required. Supported languages are: python, bash"
    )]
    MissingCode,
    #[error("Invalid stdin message format. 'data' field is required.")]
    MissingStdinData,
    #[error("snapshot_filesystem needs a string 'name'")]
    MissingSnapshotName,
    #[error("field {field:?} must be {expected}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    /// A filesystem call that could not be read (answered with `fs_error`).
    #[error("{error}")]
    Fs {
        request_id: Option<String>,
        op: String,
        error: CallError,
    },
}

impl FrameError {
    /// The status that answers this error on the wire (none for frames that are
    /// not requests at all: those get only an `error` event).
    pub fn status(&self) -> Option<Status> {
        match self {
            Self::UnsupportedLanguage(_) => Some(Status::ExecutionUnsupportedLanguageError),
            Self::MissingCode => Some(Status::ExecutionError),
            Self::MissingStdinData => Some(Status::StdinError),
            Self::MissingSnapshotName => Some(Status::FilesystemSnapshotError),
            _ => None,
        }
    }
}

/// Parses a text frame into a JSON object.
fn object(text: &str) -> Result<Map<String, Value>, FrameError> {
    if text.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(text.len()));
    }
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(FrameError::NotObject),
        Err(err) => Err(FrameError::NotJson(err.to_string())),
    }
}

fn optional_bool(map: &Map<String, Value>, field: &'static str) -> Result<bool, FrameError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(value)) => Ok(*value),
        Some(_) => Err(FrameError::WrongType {
            field,
            expected: "a boolean",
        }),
    }
}

fn optional_string(
    map: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, FrameError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(value)) => Ok(Some(value.clone())),
        Some(_) => Err(FrameError::WrongType {
            field,
            expected: "a string",
        }),
    }
}

impl InitMessage {
    /// Parses the first frame of `/create`.
    pub fn parse(text: &str) -> Result<Self, FrameError> {
        let map = object(text)?;
        const IDLE_TIMEOUT: FrameError = FrameError::WrongType {
            field: "idle_timeout",
            expected: "an integer number of seconds from 0 (no timeout) to 2592000 (30 days)",
        };
        let idle_timeout_s = match map.get("idle_timeout") {
            None => Some(DEFAULT_IDLE_TIMEOUT_S),
            Some(Value::Null) => None,
            Some(Value::Number(n)) => match n.as_u64() {
                Some(0) => None,
                Some(seconds) if seconds <= MAX_IDLE_TIMEOUT_S => Some(seconds),
                _ => return Err(IDLE_TIMEOUT),
            },
            Some(_) => return Err(IDLE_TIMEOUT),
        };
        let snapshot_token = optional_string(&map, "filesystem_snapshot_token")?;
        let snapshot = optional_string(&map, "filesystem_snapshot_name")?
            .map(|name| split_name_and_proof(&name, snapshot_token.as_deref()));
        Ok(Self {
            idle_timeout_s,
            enable_checkpoint: optional_bool(&map, "enable_checkpoint")?,
            enable_idle_timeout_auto_checkpoint: optional_bool(
                &map,
                "enable_idle_timeout_auto_checkpoint",
            )?,
            enable_sandbox_handoff: optional_bool(&map, "enable_sandbox_handoff")?,
            filesystem_snapshot_name: snapshot.as_ref().map(|(name, _)| name.clone()),
            filesystem_snapshot_proof: snapshot.and_then(|(_, proof)| proof),
            image: optional_string(&map, "image")?,
            network: match optional_string(&map, "network")? {
                None => controllers::api::NetworkMode::None,
                Some(name) => name.parse().map_err(|_| FrameError::WrongType {
                    field: "network",
                    expected: "\"none\" or \"egress\"",
                })?,
            },
            workspace: workspace_request(&map)?,
            from_checkpoint: fork_request(&map)?,
            keep_executions: optional_bool(&map, "keep_executions")?,
            labels: labels(&map)?,
        })
    }
}

fn labels(
    map: &Map<String, Value>,
) -> Result<std::collections::BTreeMap<String, String>, FrameError> {
    const WRONG: FrameError = FrameError::WrongType {
        field: "labels",
        expected: "an object of at most 32 string values (up to 256 bytes each) under keys of \
                   1-63 letters, digits, '-', '_' and '.'",
    };
    let fields = match map.get("labels") {
        None | Some(Value::Null) => return Ok(Default::default()),
        Some(Value::Object(fields)) if fields.len() <= MAX_LABELS => fields,
        Some(_) => return Err(WRONG),
    };
    fields
        .iter()
        .map(|(key, value)| match value {
            Value::String(value) if is_label_key(key) && value.len() <= MAX_LABEL_VALUE_LEN => {
                Ok((key.clone(), value.clone()))
            }
            _ => Err(WRONG),
        })
        .collect()
}

fn fork_request(map: &Map<String, Value>) -> Result<Option<ForkRequest>, FrameError> {
    const EXPECTED: &str = "an object with string fields sandbox_id and sandbox_token, \
                            and optionally name (a checkpoint name)";
    let wrong = || FrameError::WrongType {
        field: "from_checkpoint",
        expected: EXPECTED,
    };
    let fields = match map.get("from_checkpoint") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(fields)) => fields,
        Some(_) => return Err(wrong()),
    };
    let required = |name: &str| match fields.get(name) {
        Some(Value::String(value)) if !value.is_empty() => Ok(value.clone()),
        _ => Err(wrong()),
    };
    let name = match fields.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) if controllers::api::is_resource_name(name) => Some(name.clone()),
        Some(_) => {
            return Err(FrameError::WrongType {
                field: "from_checkpoint.name",
                expected: "a checkpoint name: 1-63 characters of lowercase letters, digits, '-' and '_'",
            });
        }
    };
    Ok(Some(ForkRequest {
        sandbox_id: required("sandbox_id")?,
        sandbox_token: required("sandbox_token")?,
        name,
    }))
}

fn workspace_request(map: &Map<String, Value>) -> Result<Option<WorkspaceRequest>, FrameError> {
    let enabled = optional_bool(map, "enable_workspace_sync")?;
    let id = optional_string(map, "workspace_id")?;
    let template = optional_string(map, "workspace_template")?;
    let token = optional_string(map, "workspace_token")?;
    if token
        .as_ref()
        .is_some_and(|t| t.len() < MIN_WORKSPACE_TOKEN_LEN || t.len() > 256)
    {
        return Err(FrameError::WrongType {
            field: "workspace_token",
            expected: "a secret of 16 to 256 characters",
        });
    }
    if id.is_some() && token.is_none() {
        return Err(FrameError::WrongType {
            field: "workspace_token",
            expected: "a secret of 16 to 256 characters (required with workspace_id: it owns the workspace)",
        });
    }
    if !enabled && id.is_none() {
        if template.is_some() {
            return Err(FrameError::WrongType {
                field: "workspace_template",
                expected: "absent unless enable_workspace_sync is true or workspace_id is given",
            });
        }
        return Ok(None);
    }
    Ok(Some(WorkspaceRequest {
        id,
        token,
        template,
    }))
}

impl ClientFrame {
    /// Parses a text frame received after setup.
    pub fn parse(text: &str) -> Result<Self, FrameError> {
        let map = object(text)?;
        match map.get("action") {
            Some(Value::String(action)) => return Self::action(action, &map),
            Some(Value::Null) | None => {}
            Some(_) => {
                return Err(FrameError::WrongType {
                    field: "action",
                    expected: "a string",
                });
            }
        }
        if map.get("event").and_then(Value::as_str) == Some("stdin") {
            return match map.get("data") {
                Some(Value::String(data)) => Ok(Self::Stdin { data: data.clone() }),
                _ => Err(FrameError::MissingStdinData),
            };
        }
        let language = match map.get("language") {
            Some(Value::String(language)) if language == "python" => Language::Python,
            Some(Value::String(language)) if language == "bash" => Language::Bash,
            Some(Value::String(language)) => {
                return Err(FrameError::UnsupportedLanguage(format!("'{language}'")));
            }
            Some(other) => return Err(FrameError::UnsupportedLanguage(other.to_string())),
            None => return Err(FrameError::UnsupportedLanguage("'None'".to_owned())),
        };
        let code = match map.get("code") {
            Some(Value::String(code)) => code.clone(),
            _ => return Err(FrameError::MissingCode),
        };
        let session = optional_bool(&map, "session")? && language == Language::Python;
        let pty = match map.get("pty") {
            None | Some(Value::Null) => None,
            Some(size) if !session => Some(terminal_size(size)?),
            Some(_) => {
                return Err(FrameError::WrongType {
                    field: "pty",
                    expected: "absent in a session cell",
                });
            }
        };
        let results = optional_bool(&map, "results")?;
        if results && !session {
            return Err(FrameError::WrongType {
                field: "results",
                expected: "true only in a Python session cell (\"language\": \"python\", \"session\": true)",
            });
        }
        Ok(Self::Exec {
            language,
            code,
            session,
            pty,
            results,
        })
    }

    fn action(action: &str, map: &Map<String, Value>) -> Result<Self, FrameError> {
        match action {
            "checkpoint" => Ok(Self::Checkpoint {
                name: optional_string(map, "name")?,
            }),
            "snapshot_filesystem" => match map.get("name") {
                Some(Value::String(name)) => Ok(Self::SnapshotFilesystem {
                    name: name.clone(),
                    proof: optional_string(map, "filesystem_snapshot_token")?
                        .map(SnapshotProof::new),
                }),
                _ => Err(FrameError::MissingSnapshotName),
            },
            "kill_process" => Ok(Self::KillProcess),
            "kill_sandbox" => Ok(Self::KillSandbox),
            "reconnect" => Ok(Self::Reconnect),
            "resize" => Ok(Self::Resize(terminal_size(&Value::Object(map.clone()))?)),
            fs if fs.starts_with("fs_") => {
                let op = &fs["fs_".len()..];
                FsCall::parse(op, map)
                    .map(Self::Fs)
                    .map_err(|error| FrameError::Fs {
                        request_id: map
                            .get("request_id")
                            .and_then(Value::as_str)
                            .map(str::to_owned),
                        op: op.chars().take(64).collect(),
                        error,
                    })
            }
            other => Err(FrameError::UnknownAction(other.chars().take(64).collect())),
        }
    }
}

#[cfg(test)]
mod tests;
