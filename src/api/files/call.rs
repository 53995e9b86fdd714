//! A filesystem call as clients send it: over the WebSocket as an action
//! (`{"action":"fs_stat","request_id":"1","path":"/x"}`), over HTTP as the
//! same object with `op` (`{"op":"stat","path":"/x"}`). Parsing is strict
//! (a wrong type is an error naming the field) and bounded (paths, ids,
//! inline data).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use controllers::files::{MAX_LIST_DEPTH, MAX_LIST_ENTRIES, MAX_PATH_BYTES, MAX_READ_BYTES};
use serde_json::{Map, Value};

/// Longest `request_id` echoed back.
const MAX_REQUEST_ID: usize = 128;

/// One filesystem call and the id the client gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsCall {
    pub request_id: Option<String>,
    pub op: FsOp,
}

/// What a call asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsOp {
    Stat {
        path: String,
    },
    List {
        path: String,
        depth: u32,
        max_entries: u32,
    },
    Read {
        path: String,
        offset: u64,
        length: u64,
    },
    Write {
        path: String,
        data: Vec<u8>,
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
    /// `size` bytes follow as binary frames (WebSocket only).
    Upload {
        path: String,
        size: u64,
        sha256: Option<String>,
        mode: Option<u32>,
        parents: bool,
    },
    /// The file follows as binary frames (WebSocket only).
    Download {
        path: String,
    },
}

impl FsOp {
    /// The op's name on the wire (`stat`, `list`, …).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Stat { .. } => "stat",
            Self::List { .. } => "list",
            Self::Read { .. } => "read",
            Self::Write { .. } => "write",
            Self::Mkdir { .. } => "mkdir",
            Self::Remove { .. } => "remove",
            Self::Rename { .. } => "rename",
            Self::Upload { .. } => "upload",
            Self::Download { .. } => "download",
        }
    }
}

/// Why a call could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    #[error(
        "unknown filesystem op {0:?}; expected stat, list, read, write, mkdir, remove, rename, upload or download"
    )]
    UnknownOp(String),
    #[error("field {field:?} must be {expected}")]
    Field {
        field: &'static str,
        expected: &'static str,
    },
}

fn field(field: &'static str, expected: &'static str) -> CallError {
    CallError::Field { field, expected }
}

fn path_of(map: &Map<String, Value>, name: &'static str) -> Result<String, CallError> {
    match map.get(name) {
        Some(Value::String(path))
            if !path.is_empty() && !path.contains('\0') && path.len() <= MAX_PATH_BYTES =>
        {
            Ok(path.clone())
        }
        _ => Err(field(name, "a path: 1 to 4096 bytes, no NUL")),
    }
}

fn flag(map: &Map<String, Value>, name: &'static str, default: bool) -> Result<bool, CallError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(value)) => Ok(*value),
        Some(_) => Err(field(name, "a boolean")),
    }
}

/// The largest file offset a call may name (a signed 64-bit `off_t`).
const MAX_OFFSET: u64 = i64::MAX as u64;

fn number(
    map: &Map<String, Value>,
    name: &'static str,
    expected: &'static str,
    max: u64,
) -> Result<Option<u64>, CallError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(value) if value <= max => Ok(Some(value)),
            _ => Err(field(name, expected)),
        },
        Some(_) => Err(field(name, expected)),
    }
}

fn mode(map: &Map<String, Value>) -> Result<Option<u32>, CallError> {
    let expected = "a permission mode: an integer from 0 to 4095 (0o7777)";
    Ok(number(map, "mode", expected, 0o7777)?.and_then(|mode| u32::try_from(mode).ok()))
}

impl FsCall {
    /// Parses a call: `op` is the op's name (`stat`, or the action's
    /// `fs_stat` without its prefix), `map` the frame or body.
    pub fn parse(op: &str, map: &Map<String, Value>) -> Result<Self, CallError> {
        let request_id = match map.get("request_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) if id.len() <= MAX_REQUEST_ID => Some(id.clone()),
            Some(_) => return Err(field("request_id", "a string of at most 128 bytes")),
        };
        let op = match op {
            "stat" => FsOp::Stat {
                path: path_of(map, "path")?,
            },
            "list" => FsOp::List {
                path: path_of(map, "path")?,
                depth: match number(
                    map,
                    "depth",
                    "an integer from 1 to 64",
                    MAX_LIST_DEPTH.into(),
                )? {
                    None => 1,
                    Some(0) => return Err(field("depth", "an integer from 1 to 64")),
                    Some(depth) => u32::try_from(depth).unwrap_or(u32::MAX),
                },
                max_entries: number(
                    map,
                    "max_entries",
                    "an integer from 1 to 10000",
                    MAX_LIST_ENTRIES.into(),
                )?
                .map_or(MAX_LIST_ENTRIES, |max| max.max(1) as u32),
            },
            "read" => FsOp::Read {
                path: path_of(map, "path")?,
                offset: number(map, "offset", "an integer from 0 to 2^63 - 1", MAX_OFFSET)?
                    .unwrap_or(0),
                length: number(map, "length", "an integer up to 4194304", MAX_READ_BYTES)?
                    .unwrap_or(MAX_READ_BYTES),
            },
            "write" => FsOp::Write {
                path: path_of(map, "path")?,
                data: inline_data(map)?,
                mode: mode(map)?,
                parents: flag(map, "parents", true)?,
            },
            "mkdir" => FsOp::Mkdir {
                path: path_of(map, "path")?,
                parents: flag(map, "parents", false)?,
                mode: mode(map)?,
            },
            "remove" => FsOp::Remove {
                path: path_of(map, "path")?,
                recursive: flag(map, "recursive", false)?,
            },
            "rename" => FsOp::Rename {
                path: path_of(map, "path")?,
                to: path_of(map, "to")?,
                overwrite: flag(map, "overwrite", true)?,
            },
            "upload" => FsOp::Upload {
                path: path_of(map, "path")?,
                size: number(map, "size", "the file's size in bytes", u64::MAX)?
                    .ok_or_else(|| field("size", "the file's size in bytes"))?,
                sha256: match map.get("sha256") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(digest)) if is_sha256_hex(digest) => {
                        Some(digest.to_ascii_lowercase())
                    }
                    Some(_) => return Err(field("sha256", "64 hexadecimal digits")),
                },
                mode: mode(map)?,
                parents: flag(map, "parents", true)?,
            },
            "download" => FsOp::Download {
                path: path_of(map, "path")?,
            },
            other => return Err(CallError::UnknownOp(other.chars().take(64).collect())),
        };
        Ok(Self { request_id, op })
    }
}

/// `data` (base64) or `text` (UTF-8) of a write.
fn inline_data(map: &Map<String, Value>) -> Result<Vec<u8>, CallError> {
    match (map.get("data"), map.get("text")) {
        (Some(Value::String(data)), None) => BASE64
            .decode(data.as_bytes())
            .map_err(|_| field("data", "base64")),
        (None, Some(Value::String(text))) => Ok(text.as_bytes().to_vec()),
        _ => Err(field(
            "data",
            "base64 (or \"text\", a string), exactly one of the two",
        )),
    }
}

pub fn is_sha256_hex(digest: &str) -> bool {
    digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(op: &str, value: Value) -> Result<FsCall, CallError> {
        FsCall::parse(op, value.as_object().expect("an object"))
    }

    #[test]
    fn calls_parse_with_their_defaults() {
        let call = parse("list", json!({"path": "/a", "request_id": "7"})).expect("parses");
        assert_eq!(call.request_id.as_deref(), Some("7"));
        assert_eq!(
            call.op,
            FsOp::List {
                path: "/a".into(),
                depth: 1,
                max_entries: MAX_LIST_ENTRIES
            }
        );
        let write = parse("write", json!({"path": "a", "text": "hi", "mode": 0o600})).expect("ok");
        assert_eq!(
            write.op,
            FsOp::Write {
                path: "a".into(),
                data: b"hi".to_vec(),
                mode: Some(0o600),
                parents: true
            }
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let err = |op, value| parse(op, value).expect_err("refused").to_string();
        assert!(err("stat", json!({})).contains("\"path\""));
        assert!(err("stat", json!({"path": "a\u{0}b"})).contains("\"path\""));
        assert!(err("read", json!({"path": "a", "length": 1 << 30})).contains("\"length\""));
        assert!(err("write", json!({"path": "a", "data": "!!"})).contains("base64"));
        assert!(err("mkdir", json!({"path": "a", "mode": 70000})).contains("\"mode\""));
        assert!(err("upload", json!({"path": "a"})).contains("\"size\""));
        assert!(err("upload", json!({"path": "a", "size": 1, "sha256": "x"})).contains("sha256"));
        assert!(err("chmod", json!({"path": "a"})).contains("unknown filesystem op"));
        assert!(err("list", json!({"path": "a", "depth": 0})).contains("\"depth\""));
        assert!(err("read", json!({"path": "a", "offset": 1u64 << 63})).contains("\"offset\""));
        assert!(parse("read", json!({"path": "a", "offset": (1u64 << 63) - 1})).is_ok());
    }
}
