//! The filesystem API (an extension; the earlier server's clients never send
//! its actions): stat, list, read, write, mkdir, remove, rename, and chunked
//! uploads and downloads of large files with a SHA-256 check. Over the
//! attached WebSocket as `fs_*` actions (`session/files.rs`), and over HTTP
//! for one-shot use with the sandbox token (`http.rs`), which attaches (and
//! restores) like any attach. Every call is one request of the runtime port
//! (`controllers::files`), carried out inside the sandbox by its agent; see
//! `docs/decisions/0016-filesystem-api.md`.

pub mod call;
pub mod http;
pub mod transfer;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use controllers::api::SandboxId;
use controllers::files::{FsError, FsReply, FsRequest};
use controllers::runtime::RuntimeError;
use controllers::sandboxes::SandboxController;
use serde_json::{Value, json};

use super::protocol::ServerFrame;

pub use call::{CallError, FsCall, FsOp};

/// Runs a call that is one request and one reply (every op but upload and
/// download); the reply as the `result` object clients get.
pub async fn run_simple(
    controller: &SandboxController,
    sandbox: &SandboxId,
    op: FsOp,
) -> Result<Value, FsError> {
    let request = match op {
        FsOp::Stat { path } => FsRequest::Stat { path },
        FsOp::List {
            path,
            depth,
            max_entries,
        } => FsRequest::List {
            path,
            depth,
            max_entries,
        },
        FsOp::Read {
            path,
            offset,
            length,
        } => FsRequest::Read {
            path,
            offset,
            length,
        },
        FsOp::Write {
            path,
            data,
            mode,
            parents,
        } => FsRequest::Write {
            path,
            data: data.into(),
            mode,
            parents,
        },
        FsOp::Mkdir {
            path,
            parents,
            mode,
        } => FsRequest::Mkdir {
            path,
            parents,
            mode,
        },
        FsOp::Remove { path, recursive } => FsRequest::Remove { path, recursive },
        FsOp::Rename {
            path,
            to,
            overwrite,
        } => FsRequest::Rename {
            path,
            to,
            overwrite,
        },
        FsOp::Upload { .. } | FsOp::Download { .. } => {
            return Err(FsError::Invalid(
                "upload and download stream their bytes; they are not one request".into(),
            ));
        }
    };
    Ok(result_json(controller.fs(sandbox, request).await?))
}

/// A reply as the client's `result`.
pub fn result_json(reply: FsReply) -> Value {
    match reply {
        FsReply::Entry(entry) => json!({"entry": entry}),
        FsReply::Entries { entries, truncated } => {
            json!({"entries": entries, "truncated": truncated})
        }
        FsReply::Data(read) => json!({
            "data": BASE64.encode(&read.data),
            "size": read.size,
            "mode": read.mode,
            "eof": read.eof,
        }),
        FsReply::Written(size) => json!({"size": size}),
        FsReply::Done => json!({}),
    }
}

/// The error's POSIX name, and a message that says which sandbox when the
/// sandbox itself is the problem.
pub fn error_parts(sandbox: &SandboxId, err: &FsError) -> (String, String) {
    let message = match err {
        FsError::Posix { message, .. } => message.clone(),
        FsError::Runtime(RuntimeError::NotFound(_)) => {
            format!("sandbox {sandbox} is not running here; attach again")
        }
        other => other.to_string(),
    };
    (err.code().to_owned(), message)
}

/// `{"event":"fs_result","request_id":…,"op":…,"result":{…}}`.
pub fn result_frame(request_id: Option<&str>, op: &str, result: Value) -> ServerFrame {
    ServerFrame::Event(json!({
        "event": "fs_result",
        "request_id": request_id,
        "op": op,
        "result": result,
    }))
}

/// `{"event":"fs_error","request_id":…,"op":…,"code":"ENOENT","message":…}`.
pub fn error_frame(request_id: Option<&str>, op: &str, code: &str, message: &str) -> ServerFrame {
    ServerFrame::Event(json!({
        "event": "fs_error",
        "request_id": request_id,
        "op": op,
        "code": code,
        "message": message,
    }))
}

/// The HTTP status for an error of the filesystem API.
pub fn http_status(err: &FsError) -> axum::http::StatusCode {
    use axum::http::StatusCode;
    match err {
        FsError::Runtime(_) => StatusCode::SERVICE_UNAVAILABLE,
        FsError::BadAnswer(_) => StatusCode::BAD_GATEWAY,
        FsError::Unsupported => StatusCode::NOT_IMPLEMENTED,
        FsError::Invalid(_) => StatusCode::BAD_REQUEST,
        FsError::Posix { code, .. } => match code.as_str() {
            "ENOENT" => StatusCode::NOT_FOUND,
            "EACCES" | "EPERM" | "EROFS" => StatusCode::FORBIDDEN,
            "EEXIST" | "ENOTEMPTY" | "ESTALE" | "EBUSY" | "ETXTBSY" => StatusCode::CONFLICT,
            "EFBIG" | "ENOSPC" | "EDQUOT" => StatusCode::INSUFFICIENT_STORAGE,
            "EISDIR" | "ENOTDIR" | "EINVAL" | "ELOOP" | "ENAMETOOLONG" | "EXDEV" => {
                StatusCode::BAD_REQUEST
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
    }
}
