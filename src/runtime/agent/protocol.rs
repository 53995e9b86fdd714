//! The messages between the host and the in-sandbox agent, defined once.
//!
//! One JSON object per line: commands host→agent carry `"op"` ([`Request`],
//! with the request id beside it in [`Command`]), events agent→host carry
//! `"ev"` ([`Event`]). `sandbox_agent/protocol.json` lists every message and
//! its fields; `tests` here round-trips every variant against it, and the
//! agent's own unit tests check that it handles every listed op and emits
//! only listed events, so neither side can drift silently.
//!
//! The JSON is exactly what the agent has always read and written (an agent
//! restored from an older checkpoint speaks it too); what may change it is
//! [`AGENT_PROTOCOL_VERSION`], which the agent reports in `hello` and `pong`
//! and every checkpoint records.
//!
//! Version 2 adds raw bytes: a message whose object has `"bytes": N` is
//! followed by exactly N bytes after its newline ([`Command::bytes`], and a
//! `done` whose reply type has `bytes`). File chunks travel so
//! (`fs_read_bytes`, `fs_upload_bytes`), neither base64-encoded nor parsed as
//! JSON. A version-1 agent (restored from an older checkpoint) is never sent
//! one: the host speaks both (decision 19).

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use controllers::files::FsEntry;

use crate::workspace::files::Refused;
use crate::workspace::state::FileEntry;

/// The protocol version of this host's agent (the agent's `VERSION` in
/// `sandbox_agent/protocol.py`, `version` in `protocol.json`).
pub const AGENT_PROTOCOL_VERSION: u32 = 2;

/// The oldest agent this host still speaks to: agents come back with the
/// checkpoints they were taken in, so a host keeps speaking the versions of
/// the checkpoints it may restore.
pub const OLDEST_AGENT_PROTOCOL_VERSION: u32 = 1;

/// The first version whose messages may carry raw bytes.
pub const RAW_BYTES_VERSION: u32 = 2;

/// A command line: the request and, for those that have one, its id (the
/// reply carries it; `ack` has none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Command {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// How many raw bytes follow the line (version 2; set by the connection
    /// that sends them, never by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(flatten)]
    pub request: Request,
}

/// What the host asks of the agent. Field by field as `protocol.json` lists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Starts an execution: `argv`, or a cell (`code`) of the persistent
    /// Python session. Reply: `started` (or `error`), then `out`s and `exit`.
    Exec {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        argv: Option<Vec<String>>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        session: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        env: Option<BTreeMap<String, String>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        resumable: bool,
        /// A pseudo-terminal (`cols`, `rows`) instead of pipes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pty: Option<BTreeMap<String, u16>>,
        /// A session cell reports rich results (`out` events on fd 3).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        results: bool,
        /// Bytes of stdin the host may send ahead of what the program has
        /// read: an agent that grants it (`started`'s `stdin_window`) reports
        /// what the program takes (`stdin_taken`), so the host waits instead
        /// of the agent dropping input. An agent that does not ignores it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stdin_window: Option<u64>,
    },
    /// Resizes the execution's terminal. No reply.
    Resize { cols: u16, rows: u16 },
    /// Bytes (base64) for the execution's stdin. No reply.
    Stdin { data: String },
    /// Closes the execution's stdin. No reply.
    StdinClose,
    /// Kills the execution's process tree. No reply (its `exit` follows).
    Kill,
    /// Reply: `pong` with the agent's version and running executions.
    Ping,
    /// Reply: `ready` ([`CheckpointReady`]) or `error` (an execution runs).
    PrepareCheckpoint {
        force: bool,
        keep: bool,
        /// The last event of each kept execution a client got.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        acked: Option<BTreeMap<String, u64>>,
    },
    /// Events up to `seq` of execution `exec` were delivered. No reply.
    Ack { exec: String, seq: u64 },
    /// Reply: `journals` ([`JournalsReply`]).
    Journals,
    /// Ends a checkpoint's pause. Reply: `resumed`.
    Resume { replay: bool },
    /// Reply: `ready` ([`ConnectionsClosed`]).
    CloseConnections,
    /// A gzipped tar of `paths` as `chunk`s, then `done` ([`ArchiveDone`]).
    Archive {
        paths: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<f64>,
    },
    /// Part (base64) of an archive to unpack. No reply.
    ExtractChunk { data: String },
    /// Reply: `done` ([`ExtractDone`]) or `error`.
    ExtractEnd,
    /// Reply: `done` ([`ScanDone`]) or `error`.
    WsScan {
        root: String,
        max_file_bytes: Option<u64>,
        max_total_bytes: Option<u64>,
        max_files: Option<u64>,
        stale_s: u64,
    },
    /// `chunk`s, then `done` ([`ReadDone`]) or `error`.
    WsRead {
        root: String,
        path: String,
        max_file_bytes: u64,
    },
    /// Part (base64) of a file being written. No reply (an `error` if it fails).
    WsWriteChunk { root: String, data: String },
    /// Checks and renames the file written. Reply: `done` or `error`.
    WsWriteEnd {
        root: String,
        path: String,
        checksum: String,
        modified_at: i64,
    },
    /// Drops a file being written. Reply: `done`.
    WsWriteAbort,
    /// Reply: `done` ([`DeleteDone`]) or `error`.
    WsDelete { root: String, paths: Vec<String> },
    /// Writes the workspace's state file. Reply: `done` or `error`.
    WsState { root: String, content: String },
    /// The filesystem API (`sandbox_agent/files.py`); every `fs_*` reply is
    /// `done` or an `error` whose message starts with the errno's name.
    /// Reply: `done` ([`EntryDone`]).
    FsStat { path: String },
    /// Reply: `done` ([`ListDone`]).
    FsList {
        path: String,
        depth: u32,
        max_entries: u32,
    },
    /// Reply: `done` ([`FsReadDone`]).
    FsRead {
        path: String,
        offset: u64,
        length: u64,
    },
    /// `fs_read` with the bytes raw after the reply (version 2).
    /// Reply: `done` ([`FsReadBytesDone`]).
    FsReadBytes {
        path: String,
        offset: u64,
        length: u64,
    },
    /// `data` is base64. Reply: `done` ([`EntryDone`]).
    FsWrite {
        path: String,
        data: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
        parents: bool,
    },
    /// Reply: `done` ([`EntryDone`]).
    FsMkdir {
        path: String,
        parents: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
    },
    /// Reply: `done`.
    FsRemove { path: String, recursive: bool },
    /// Reply: `done` ([`EntryDone`]).
    FsRename {
        path: String,
        to: String,
        overwrite: bool,
    },
    /// Reply: `done`.
    FsUploadOpen {
        upload: String,
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
        parents: bool,
    },
    /// `data` is base64. Reply: `done` ([`ChunkDone`]).
    FsUploadChunk { upload: String, data: String },
    /// `fs_upload_chunk` with the bytes raw after the command (version 2).
    /// Reply: `done` ([`ChunkDone`]).
    FsUploadBytes { upload: String },
    /// Reply: `done` ([`EntryDone`]).
    FsUploadCommit { upload: String, size: u64 },
    /// Reply: `done`.
    FsUploadAbort { upload: String },
}

impl Request {
    /// The `op` of this request (an exhaustive list: a new variant must be
    /// named here, and the schema test then asks for it in `protocol.json`).
    pub fn op(&self) -> &'static str {
        match self {
            Self::Exec { .. } => "exec",
            Self::Stdin { .. } => "stdin",
            Self::StdinClose => "stdin_close",
            Self::Kill => "kill",
            Self::Resize { .. } => "resize",
            Self::Ping => "ping",
            Self::PrepareCheckpoint { .. } => "prepare_checkpoint",
            Self::Ack { .. } => "ack",
            Self::Journals => "journals",
            Self::Resume { .. } => "resume",
            Self::CloseConnections => "close_connections",
            Self::Archive { .. } => "archive",
            Self::ExtractChunk { .. } => "extract_chunk",
            Self::ExtractEnd => "extract_end",
            Self::WsScan { .. } => "ws_scan",
            Self::WsRead { .. } => "ws_read",
            Self::WsWriteChunk { .. } => "ws_write_chunk",
            Self::WsWriteEnd { .. } => "ws_write_end",
            Self::WsWriteAbort => "ws_write_abort",
            Self::WsDelete { .. } => "ws_delete",
            Self::WsState { .. } => "ws_state",
            Self::FsStat { .. } => "fs_stat",
            Self::FsList { .. } => "fs_list",
            Self::FsRead { .. } => "fs_read",
            Self::FsReadBytes { .. } => "fs_read_bytes",
            Self::FsWrite { .. } => "fs_write",
            Self::FsMkdir { .. } => "fs_mkdir",
            Self::FsRemove { .. } => "fs_remove",
            Self::FsRename { .. } => "fs_rename",
            Self::FsUploadOpen { .. } => "fs_upload_open",
            Self::FsUploadChunk { .. } => "fs_upload_chunk",
            Self::FsUploadBytes { .. } => "fs_upload_bytes",
            Self::FsUploadCommit { .. } => "fs_upload_commit",
            Self::FsUploadAbort { .. } => "fs_upload_abort",
        }
    }

    /// This request under `id`.
    pub fn with_id(self, id: impl Into<String>) -> Command {
        Command {
            id: Some(id.into()),
            bytes: None,
            request: self,
        }
    }

    /// This request without an id (`ack`).
    pub fn without_id(self) -> Command {
        Command {
            id: None,
            bytes: None,
            request: self,
        }
    }
}

/// What the agent tells the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// Once, when a fresh agent is up.
    Hello {
        version: u32,
        pid: u32,
    },
    Started {
        id: String,
        pid: u32,
        /// The stdin window granted (the `exec` asked for one, the agent
        /// knows them); absent: input flows without one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stdin_window: Option<u64>,
    },
    /// Bytes of an execution's stdin its program took (or that were let go:
    /// stdin closed, the program gone), handed back to its window.
    StdinTaken {
        id: String,
        /// Not `bytes`: that names raw bytes following a line.
        count: u64,
    },
    /// Output of an execution; `data` is base64 (absent: reported as lost).
    Out {
        id: String,
        fd: u8,
        #[serde(default)]
        data: Option<String>,
        /// The agent's number for it (resumable executions only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
    },
    Exit {
        id: String,
        code: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
    },
    /// Part (base64) of an archive or a file being read.
    Chunk {
        id: String,
        #[serde(default)]
        data: Option<String>,
    },
    /// A request failed (`id: null`: a command that could not be read).
    Error {
        #[serde(default)]
        id: Option<String>,
        message: String,
    },
    Pong {
        #[serde(default)]
        id: Option<String>,
        version: u32,
        #[serde(default)]
        running: Vec<String>,
    },
    /// The reply to `prepare_checkpoint` or `close_connections`.
    Ready {
        id: String,
        #[serde(flatten)]
        body: Map<String, Value>,
    },
    Journals {
        id: String,
        paused: bool,
        executions: Vec<JournalEntry>,
    },
    Resumed {
        id: String,
    },
    /// The end of a request; what it carries depends on the request.
    Done {
        id: String,
        #[serde(flatten)]
        body: Map<String, Value>,
    },
}

impl Event {
    /// The `ev` of this event.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Hello { .. } => "hello",
            Self::Started { .. } => "started",
            Self::Out { .. } => "out",
            Self::Exit { .. } => "exit",
            Self::StdinTaken { .. } => "stdin_taken",
            Self::Chunk { .. } => "chunk",
            Self::Error { .. } => "error",
            Self::Pong { .. } => "pong",
            Self::Ready { .. } => "ready",
            Self::Journals { .. } => "journals",
            Self::Resumed { .. } => "resumed",
            Self::Done { .. } => "done",
        }
    }

    /// The request id it answers or belongs to.
    pub fn id(&self) -> Option<&str> {
        match self {
            Self::Hello { .. } => None,
            Self::Error { id, .. } | Self::Pong { id, .. } => id.as_deref(),
            Self::Started { id, .. }
            | Self::Out { id, .. }
            | Self::Exit { id, .. }
            | Self::StdinTaken { id, .. }
            | Self::Chunk { id, .. }
            | Self::Ready { id, .. }
            | Self::Journals { id, .. }
            | Self::Resumed { id }
            | Self::Done { id, .. } => Some(id),
        }
    }

    /// This reply read as the request's reply type `T` (fields it does not
    /// name, such as `ev` and `id`, are ignored).
    pub fn reply<T: DeserializeOwned>(self) -> Result<T, MalformedReply> {
        let kind = self.kind();
        serde_json::to_value(self)
            .and_then(serde_json::from_value)
            .map_err(|source| MalformedReply { kind, source })
    }
}

/// A reply that does not have the fields its request's reply has.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox agent's {kind:?} reply is malformed: {source}")]
pub struct MalformedReply {
    pub kind: &'static str,
    #[source]
    pub source: serde_json::Error,
}

/// One journaled execution a restore brought back (`journals`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub id: String,
    pub acked: u64,
    pub running: bool,
    /// The stdin window the execution's host was granted, and the room
    /// left in it (the window less the input waiting for the program):
    /// what the next host may send ahead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_window: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_room: Option<u64>,
}

/// `pong`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    pub version: u32,
    #[serde(default)]
    pub running: Vec<String>,
}

/// `journals`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalsReply {
    pub paused: bool,
    pub executions: Vec<JournalEntry>,
}

/// `ready` to `prepare_checkpoint`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointReady {
    #[serde(default)]
    pub killed_host_fd_holders: Vec<u32>,
    /// Executions still running (they would be frozen half-way).
    #[serde(default)]
    pub running: Vec<String>,
    /// Executions paused and kept in the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<Vec<String>>,
}

/// `ready` to `close_connections`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionsClosed {
    /// Processes killed for holding a connection.
    #[serde(default)]
    pub killed: Vec<u32>,
    /// Remote addresses (hex, as in /proc/net/tcp) of connections still open.
    #[serde(default)]
    pub remaining: Vec<String>,
}

/// `done` to `archive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveDone {
    pub size: u64,
    pub entries: u64,
}

/// `done` to `extract_end`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtractDone {
    pub entries: u64,
}

/// `done` to `ws_scan`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScanDone {
    pub files: Vec<FileEntry>,
    #[serde(default)]
    pub refused: Vec<Refused>,
    /// The sandbox's own state file's entries: user code can write that file,
    /// so each entry is checked (by the caller) and the malformed ones ignored.
    #[serde(default)]
    pub synced: Vec<Value>,
    #[serde(default)]
    pub hashed: u64,
    #[serde(default)]
    pub scanned_at: i64,
}

/// `done` to `ws_read`: the md5 and size of exactly the bytes sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadDone {
    pub checksum: String,
    pub size: u64,
}

/// `done` to `ws_delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteDone {
    pub deleted: u64,
}

/// `done` to `fs_stat`, `fs_write`, `fs_mkdir`, `fs_rename`,
/// `fs_upload_commit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EntryDone {
    pub entry: FsEntry,
}

/// `done` to `fs_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListDone {
    pub entries: Vec<FsEntry>,
    pub truncated: bool,
}

/// `done` to `fs_read`: base64 `data` and the file as it was read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsReadDone {
    pub data: String,
    pub size: u64,
    pub mode: u32,
    pub ino: u64,
    pub mtime_ns: i64,
    pub eof: bool,
}

/// `done` to `fs_read_bytes`: the bytes that follow (raw) and the file as
/// it was read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsReadBytesDone {
    pub bytes: u64,
    pub size: u64,
    pub mode: u32,
    pub ino: u64,
    pub mtime_ns: i64,
    pub eof: bool,
}

/// `done` to `fs_upload_chunk` and `fs_upload_bytes`: the bytes written so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkDone {
    pub size: u64,
}

#[cfg(test)]
#[path = "protocol_tests.rs"]
mod tests;
