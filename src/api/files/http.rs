//! The filesystem API over HTTP, for one-shot use with the sandbox token
//! (`Authorization: Bearer <token>`, or `?sandbox_token=`):
//!
//! - `POST /sandboxes/{id}/files` with a call as JSON (`{"op": "stat",
//!   "path": "/x"}`): `200` and the call's result, or an error status with
//!   `{"code": "ENOENT", "message": …}`;
//! - `PUT /sandboxes/{id}/files/content?path=…[&mode=&sha256=&parents=]`:
//!   the body, streamed, becomes the file (renamed into place only when
//!   whole and, given `sha256`, matching);
//! - `GET /sandboxes/{id}/files/content?path=…`: the file, streamed, with
//!   `content-length` and `x-sandbox-file-mode`; a file that changes while
//!   it is sent ends the body short (the length tells).
//!
//! Each request attaches like a WebSocket attach (the token checked first,
//! the sandbox restored here if it is held elsewhere or checkpointed), takes
//! the one attach slot for its length (`409` while a client is attached:
//! use that client's session) and detaches at the end.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use controllers::api::SandboxId;
use controllers::files::FsError;
use controllers::sandboxes::SandboxController;
use futures::StreamExt;
use serde_json::{Value, json};

use super::call::{FsCall, FsOp, is_sha256_hex};
use super::transfer::{Download, UploadTarget, upload};
use super::{error_parts, http_status, run_simple};
use crate::api::caller::ClientAddr;
use crate::api::connect::{RestoreRefused, adopt_resumed_execution, controller_or_error, restore};
use crate::api::live::{LiveSandbox, SandboxOptions};
use crate::api::session::Out;
use crate::api::state::AppState;
use crate::token;

/// A sandbox attached for one HTTP request; detached when dropped.
struct Held {
    state: AppState,
    controller: Arc<SandboxController>,
    live: Arc<LiveSandbox>,
    attachment: u64,
    id: SandboxId,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.live.touch();
        self.state.live.detach(&self.live, self.attachment);
        self.controller.client_attached(&self.id, false);
    }
}

fn refusal(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"code": code, "message": message.into()})),
    )
        .into_response()
}

fn fs_refusal(sandbox: &SandboxId, err: &FsError) -> Response {
    let (code, message) = error_parts(sandbox, err);
    refusal(http_status(err), &code, message)
}

/// The token of the request: `X-Sandbox-Token`, else the bearer header,
/// else the query parameter.
/// What a request says of itself: its sandbox token and its caller.
struct Asker<'a> {
    headers: &'a HeaderMap,
    query: &'a HashMap<String, String>,
    client: Option<&'a ClientAddr>,
}

/// Checks the token, takes the attach slot and brings the sandbox here
/// (counted against the caller's quota).
async fn hold(state: &AppState, raw_id: &str, asker: Asker<'_>) -> Result<Held, Response> {
    let token = token::of_request(asker.headers, asker.query, true);
    let caller = &state.callers.caller(asker.headers, asker.client);
    let not_found = || refusal(StatusCode::NOT_FOUND, "ENOENT", "no such sandbox");
    let Some((token, source)) = token else {
        return Err(refusal(
            StatusCode::UNAUTHORIZED,
            "EACCES",
            "the sandbox token is missing (X-Sandbox-Token: <token>)",
        ));
    };
    let Ok(id) = SandboxId::parse(raw_id) else {
        return Err(not_found());
    };
    let controller = controller_or_error(state)
        .map_err(|message| refusal(StatusCode::SERVICE_UNAVAILABLE, "EIO", message))?;
    let read = match controller.read_for_attach(&id).await {
        Ok(Some(read)) => read,
        Ok(None) => return Err(not_found()),
        Err(err) => {
            return Err(refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "EIO",
                err.to_string(),
            ));
        }
    };
    let metadata = read.metadata.0.clone();
    if !token::matches(&token, &metadata.spec.token_sha256) {
        // Answered as an unknown id: a wrong token learns nothing about
        // which ids exist.
        tracing::warn!(sandbox = %id, %source, "refused a file request: wrong sandbox token");
        return Err(not_found());
    }
    if metadata.is_deleted() {
        return Err(not_found());
    }
    let Ok((live, attachment)) = state.live.attach(&id) else {
        return Err(refusal(
            StatusCode::CONFLICT,
            "EBUSY",
            "a client is attached to this sandbox: use its session's fs_* actions",
        ));
    };
    let mut progress = controller.subscribe(&id);
    let runs_here = controller.is_held_here(&id);
    if !runs_here && !metadata.spec.enable_checkpoint {
        state.live.detach(&live, attachment);
        return Err(not_found());
    }
    if !runs_here
        && let Err(refused) = restore(
            state,
            &controller,
            &Out::sink(),
            &mut progress,
            read,
            None,
            caller,
        )
        .await
    {
        state.live.detach(&live, attachment);
        // A caller at its quota is told to wait, not that the server failed.
        let (status, code) = match refused {
            RestoreRefused::Quota(_) => (StatusCode::TOO_MANY_REQUESTS, "EAGAIN"),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "EIO"),
        };
        return Err(refusal(status, code, refused.message(&id)));
    }
    state
        .live
        .started(&live, SandboxOptions::of(&metadata), &controller);
    adopt_resumed_execution(&live, &controller, &id);
    controller.client_attached(&id, true);
    live.touch();
    Ok(Held {
        state: state.clone(),
        controller,
        live,
        attachment,
        id,
    })
}

/// `POST /sandboxes/{id}/files`: one call.
pub async fn call(
    Path(sandbox_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    State(state): State<AppState>,
    headers: HeaderMap,
    client: Option<axum::Extension<ClientAddr>>,
    body: BytesMut,
) -> Response {
    // Read into one buffer (axum's `Json` keeps every piece of a chunked
    // body apart until the end: 2 MB sent a byte a chunk held 75 MB), and
    // the parsed document dropped before the sandbox is held: only the
    // call waits for a restore.
    let parsed = serde_json::from_slice::<Value>(&body);
    drop(body);
    let body = match parsed {
        Ok(body) => body,
        Err(err) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                "EINVAL",
                format!("the body is not JSON: {err}"),
            );
        }
    };
    let Some(map) = body.as_object() else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "EINVAL",
            "the body must be a JSON object",
        );
    };
    let op = map.get("op").and_then(Value::as_str).unwrap_or_default();
    let parsed = FsCall::parse(op, map);
    drop(body);
    let call = match parsed {
        Ok(FsCall {
            op: FsOp::Upload { .. } | FsOp::Download { .. },
            ..
        }) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                "EINVAL",
                "upload and download: PUT and GET /sandboxes/{id}/files/content?path=…",
            );
        }
        Ok(call) => call,
        Err(err) => return refusal(StatusCode::BAD_REQUEST, "EINVAL", err.to_string()),
    };
    let asker = Asker {
        headers: &headers,
        query: &query,
        client: client.as_deref(),
    };
    let held = match hold(&state, &sandbox_id, asker).await {
        Ok(held) => held,
        Err(response) => return response,
    };
    match run_simple(&held.controller, &held.id, call.op).await {
        Ok(result) => Json(result).into_response(),
        Err(err) => fs_refusal(&held.id, &err),
    }
}

fn query_path(query: &HashMap<String, String>) -> Option<String> {
    query
        .get("path")
        .filter(|path| !path.is_empty() && path.len() <= controllers::files::MAX_PATH_BYTES)
        .cloned()
}

fn no_path() -> Response {
    refusal(
        StatusCode::BAD_REQUEST,
        "EINVAL",
        "the path query parameter is required (1 to 4096 bytes)",
    )
}

/// `PUT /sandboxes/{id}/files/content?path=…`: an upload of the body.
pub async fn put_content(
    Path(sandbox_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    State(state): State<AppState>,
    headers: HeaderMap,
    client: Option<axum::Extension<ClientAddr>>,
    body: Body,
) -> Response {
    let Some(path) = query_path(&query) else {
        return no_path();
    };
    let mode = match query.get("mode").map(|mode| u32::from_str_radix(mode, 8)) {
        None => None,
        Some(Ok(mode)) if mode <= 0o7777 => Some(mode),
        Some(_) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                "EINVAL",
                "mode: octal, at most 7777",
            );
        }
    };
    let sha256 = match query.get("sha256") {
        None => None,
        Some(digest) if is_sha256_hex(digest) => Some(digest.to_ascii_lowercase()),
        Some(_) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                "EINVAL",
                "sha256: 64 hexadecimal digits",
            );
        }
    };
    let parents = query.get("parents").is_none_or(|value| value != "false");
    let asker = Asker {
        headers: &headers,
        query: &query,
        client: client.as_deref(),
    };
    let held = match hold(&state, &sandbox_id, asker).await {
        Ok(held) => held,
        Err(response) => return response,
    };
    let target = UploadTarget {
        path,
        mode,
        parents,
        size: None,
        sha256,
    };
    let chunks = body.into_data_stream();
    match upload(&held.controller, &held.id, target, chunks).await {
        Ok(done) => Json(json!({"entry": done.entry, "size": done.size, "sha256": done.sha256}))
            .into_response(),
        Err(err) => fs_refusal(&held.id, &err),
    }
}

/// `GET /sandboxes/{id}/files/content?path=…`: the file, streamed.
pub async fn get_content(
    Path(sandbox_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    State(state): State<AppState>,
    headers: HeaderMap,
    client: Option<axum::Extension<ClientAddr>>,
) -> Response {
    let Some(path) = query_path(&query) else {
        return no_path();
    };
    let asker = Asker {
        headers: &headers,
        query: &query,
        client: client.as_deref(),
    };
    let held = match hold(&state, &sandbox_id, asker).await {
        Ok(held) => held,
        Err(response) => return response,
    };
    let download = match Download::start(Arc::clone(&held.controller), held.id.clone(), path).await
    {
        Ok(download) => download,
        Err(err) => return fs_refusal(&held.id, &err),
    };
    let (size, mode) = (download.size, download.mode);
    // The hold lives as long as the body: the sandbox stays attached while
    // the file streams.
    let body = futures::stream::unfold((download, held), |(mut download, held)| async move {
        match download.next().await {
            Some(Ok(data)) => Some((Ok::<_, FsError>(data), (download, held))),
            Some(Err(err)) => {
                tracing::info!(sandbox = %held.id, %err, "download ended early");
                Some((Err(err), (download, held)))
            }
            None => None,
        }
    })
    .boxed();
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, size)
        .header("x-sandbox-file-mode", format!("{mode:o}"))
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| refusal(StatusCode::INTERNAL_SERVER_ERROR, "EIO", "response"))
}
