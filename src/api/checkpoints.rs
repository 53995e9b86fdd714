//! `GET /sandboxes/{id}/checkpoints` (extension): a sandbox's checkpoint
//! history as its `metadata.json` records it (the latest, the superseded ones
//! still kept, every named one), newest first, for the holder of the sandbox
//! token (`?sandbox_token=`, or `Authorization: Bearer <token>` without one:
//! behind Cloud Run IAM the header carries the Google ID token). Reading it
//! neither attaches nor restores the sandbox. `sandboxctl checkpoints` is the
//! operator's view of the same history (with each checkpoint's image).

use std::collections::HashMap;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use controllers::api::{CheckpointRef, SandboxId, SandboxStatus};
use controllers::layout::checkpoint_id_of_image;
use serde_json::{Value, json};

use crate::api::connect::controller_or_error;
use crate::api::state::AppState;
use crate::token;

/// The sandbox token: the query parameter, else the bearer header.
fn token_of(headers: &HeaderMap, query: &HashMap<String, String>) -> Option<String> {
    query
        .get("sandbox_token")
        .cloned()
        .or_else(|| {
            headers
                .get(header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.strip_prefix("Bearer "))
                .map(|token| token.trim().to_owned())
        })
        .filter(|token| !token.is_empty())
}

fn refusal(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": message.into()}))).into_response()
}

/// The history's rows, newest first: role (`latest`, `previous`, `named`),
/// name, checkpoint id, creation time and size.
pub fn history(status: &SandboxStatus) -> Vec<Value> {
    let mut all: Vec<(&str, Option<&str>, &CheckpointRef)> = Vec::new();
    if let Some(latest) = &status.latest_checkpoint {
        all.push(("latest", latest.name.as_deref(), latest));
    }
    for previous in &status.previous_checkpoints {
        all.push(("previous", previous.name.as_deref(), previous));
    }
    for (name, named) in &status.named_checkpoints {
        all.push(("named", Some(name.as_str()), named));
    }
    all.sort_by_key(|entry| std::cmp::Reverse(entry.2.created_at));
    all.into_iter()
        .map(|(role, name, reference)| {
            json!({
                "role": role,
                "name": name,
                "checkpoint_id": checkpoint_id_of_image(&reference.path),
                "created_at": reference.created_at,
                "size": reference.size,
            })
        })
        .collect()
}

/// `GET /sandboxes/{id}/checkpoints`: `200 {"sandbox_id", "checkpoints": [...]}`;
/// `401` without a token, `404` for an unknown or deleted sandbox and for
/// a wrong token (answered alike, so a token learns nothing of other ids), `503` when the store cannot be read.
pub async fn list(
    Path(sandbox_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Response {
    let not_found = || refusal(StatusCode::NOT_FOUND, "no such sandbox");
    let Some(token) = token_of(&headers, &query) else {
        return refusal(
            StatusCode::UNAUTHORIZED,
            "the sandbox token is missing (Authorization: Bearer <token>)",
        );
    };
    let Ok(id) = SandboxId::parse(&sandbox_id) else {
        return not_found();
    };
    let controller = match controller_or_error(&state) {
        Ok(controller) => controller,
        Err(message) => return refusal(StatusCode::SERVICE_UNAVAILABLE, message),
    };
    let metadata = match controller.read_for_attach(&id).await {
        Ok(Some(read)) => read.metadata.0,
        Ok(None) => return not_found(),
        Err(err) => return refusal(StatusCode::SERVICE_UNAVAILABLE, err.to_string()),
    };
    if !token::matches(&token, &metadata.spec.token_sha256) {
        // Answered as an unknown id: a wrong token learns nothing.
        return not_found();
    }
    if metadata.is_deleted() {
        return not_found();
    }
    Json(json!({
        "sandbox_id": id.to_string(),
        "checkpoints": history(&metadata.status),
    }))
    .into_response()
}
