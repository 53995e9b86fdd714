//! The filesystem API's part of the runtime port: one request, one reply,
//! on a sandbox running on this host ([`crate::runtime::SandboxRuntime::fs`]).
//!
//! Each request is small and bounded (a read returns at most
//! [`MAX_READ_BYTES`], a listing at most [`MAX_LIST_ENTRIES`]); large files
//! move as many requests (reads at offsets, upload chunks), which the API
//! layer pipelines. Errors are POSIX errors by name ([`FsError::Posix`]), as
//! the sandbox's kernel gave them.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::runtime::error::RuntimeError;

/// Most bytes one read returns.
pub const MAX_READ_BYTES: u64 = 4 << 20;
/// Most entries one listing returns.
pub const MAX_LIST_ENTRIES: u32 = 10_000;
/// Deepest listing.
pub const MAX_LIST_DEPTH: u32 = 64;
/// Longest path accepted (bytes).
pub const MAX_PATH_BYTES: usize = 4096;

/// One filesystem request. Paths are the sandbox's own: absolute, or
/// relative to the sandbox user's home.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsRequest {
    Stat {
        path: String,
    },
    /// Entries under a directory, `depth` levels deep (1: its children).
    List {
        path: String,
        depth: u32,
        max_entries: u32,
    },
    /// Up to `length` bytes at `offset` (at most [`MAX_READ_BYTES`]).
    Read {
        path: String,
        offset: u64,
        length: u64,
    },
    /// A whole (small) file, created or truncated.
    Write {
        path: String,
        data: Bytes,
        mode: Option<u32>,
        parents: bool,
    },
    Mkdir {
        path: String,
        parents: bool,
        mode: Option<u32>,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Rename {
        path: String,
        to: String,
        overwrite: bool,
    },
    /// Starts a chunked upload under `upload` (letters and digits) into a
    /// temporary file beside `path`.
    UploadOpen {
        upload: String,
        path: String,
        mode: Option<u32>,
        parents: bool,
    },
    UploadChunk {
        upload: String,
        data: Bytes,
    },
    /// Renames the upload into place once `size` bytes arrived.
    UploadCommit {
        upload: String,
        size: u64,
    },
    UploadAbort {
        upload: String,
    },
}

/// What a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Directory,
    Symlink,
    Other,
}

/// A file as `stat` sees it (symlinks not followed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FsEntry {
    /// The absolute path (in a listing: relative to the listed directory).
    pub path: String,
    /// The last component (in a listing: the path relative to the listed
    /// directory).
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`0o7777`).
    pub mode: u32,
    /// Seconds since the epoch.
    pub mtime: f64,
    /// A symlink's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// Bytes read, with what the file was when they were.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadData {
    pub data: Bytes,
    /// The file's size.
    pub size: u64,
    pub mode: u32,
    /// The file's identity: a reader of many pieces sees it change.
    pub ino: u64,
    pub mtime_ns: i64,
    pub eof: bool,
}

/// The answer to an [`FsRequest`].
#[derive(Debug, Clone, PartialEq)]
pub enum FsReply {
    /// Stat, Write, Mkdir, Rename, UploadCommit.
    Entry(FsEntry),
    Entries {
        entries: Vec<FsEntry>,
        truncated: bool,
    },
    Data(ReadData),
    /// UploadChunk: bytes written so far.
    Written(u64),
    /// Remove, UploadOpen, UploadAbort.
    Done,
}

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The sandbox's kernel refused: `code` is the errno's name (`ENOENT`).
    #[error("{code}: {message}")]
    Posix { code: String, message: String },
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The sandbox answered something that is not a valid reply.
    #[error("the sandbox answered badly: {0}")]
    BadAnswer(String),
    #[error("this runtime has no filesystem API")]
    Unsupported,
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl FsError {
    pub fn posix(code: &str, message: impl Into<String>) -> Self {
        Self::Posix {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// The POSIX name of this error (`EIO` for failures that are not the
    /// sandbox kernel's).
    pub fn code(&self) -> &str {
        match self {
            Self::Posix { code, .. } => code,
            Self::Invalid(_) => "EINVAL",
            Self::Unsupported => "ENOSYS",
            Self::BadAnswer(_) | Self::Runtime(_) => "EIO",
        }
    }
}

/// A path a request may carry: non-empty, no NUL, at most
/// [`MAX_PATH_BYTES`].
pub fn check_path(path: &str) -> Result<(), FsError> {
    if path.is_empty() || path.contains('\0') || path.len() > MAX_PATH_BYTES {
        return Err(FsError::Invalid(format!(
            "a path must be 1 to {MAX_PATH_BYTES} bytes without NUL"
        )));
    }
    Ok(())
}
