//! The HTTP routes: the router the API's handlers hang from, and the small
//! handlers that are the server's own (health, readiness, `/list`, `/images`,
//! `/metrics`). The WebSocket and `/execute` handlers live in `crate::api`.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::json;

use crate::api::caller::ClientAddr;
use crate::api::state::AppState;
use crate::runtime::ImageCatalog;

/// The client of a request, as the connection layer recorded it.
type Client = Option<axum::Extension<ClientAddr>>;

/// `None` when the request may see the operator surfaces, else the refusal.
fn operator_only(state: &AppState, headers: &HeaderMap, client: &Client) -> Option<Response> {
    if state.is_operator(headers, client.as_deref()) {
        return None;
    }
    tracing::info!(client = %ClientAddr::describe(client.as_deref()), "refused an operator surface to a client without the operator credential");
    Some(
        (
            StatusCode::FORBIDDEN,
            Json(json!({"error": "this is for operators: send the operator credential (X-Operator-Token, --operator-token)"})),
        )
            .into_response(),
    )
}

/// The router, apart from `main`, so tests can drive it.
pub fn app(state: AppState, images: Option<ImageCatalog>) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/status", get(status))
        .route("/healthz", get(status))
        .route("/readyz", get(readyz))
        .route("/list", get(list))
        .route("/images", get(list_images).layer(Extension(images)))
        .route("/metrics", get(metrics))
        .route("/execute", post(crate::api::execute::execute))
        .route("/create", get(crate::api::connect::create))
        .route("/attach/{sandbox_id}", get(crate::api::connect::attach))
        .route(
            "/sandboxes/{sandbox_id}/files",
            post(crate::api::files::http::call),
        )
        .route(
            "/sandboxes/{sandbox_id}/checkpoints",
            get(crate::api::checkpoints::list),
        )
        .route(
            "/sandboxes/{sandbox_id}/files/content",
            get(crate::api::files::http::get_content).put(crate::api::files::http::put_content),
        )
        .with_state(state)
}

async fn root() -> Json<serde_json::Value> {
    Json(json!({"message": "Server is running"}))
}

async fn status() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// The sandboxes running on this instance (upstream listed runsc's default
/// root, which never held its sandboxes: bug B15). `containers` keeps
/// upstream's key, as a text table; `sandboxes` is the same as objects.
async fn list(State(state): State<AppState>, headers: HeaderMap, client: Client) -> Response {
    if let Some(refused) = operator_only(&state, &headers, &client) {
        return refused;
    }
    let mut ids = state
        .controller
        .as_ref()
        .map(|controller| controller.held_sandboxes())
        .unwrap_or_default();
    ids.sort();
    let mut table = String::from("SANDBOX_ID                        ATTACHED  EXECUTING\n");
    let mut sandboxes = Vec::with_capacity(ids.len());
    for id in ids {
        let live = state.live.get(&id);
        let attached = live.as_ref().is_some_and(|live| live.is_attached());
        let executing = live.as_ref().is_some_and(|live| live.execution_running());
        let operations = state.store_operations.for_sandbox(id.as_str());
        table.push_str(&format!("{id}  {attached:<8}  {executing}\n"));
        sandboxes.push(json!({
            "sandbox_id": id,
            "attached": attached,
            "execution_running": executing,
            "store_operations": operations,
        }));
    }
    Json(json!({"containers": table, "sandboxes": sandboxes})).into_response()
}

/// The sandbox images this server has: digest, names, packages, which one is
/// the default (`sandboxctl images`).
async fn list_images(
    State(state): State<AppState>,
    Extension(images): Extension<Option<ImageCatalog>>,
    headers: HeaderMap,
    client: Client,
) -> Response {
    if let Some(refused) = operator_only(&state, &headers, &client) {
        return refused;
    }
    let Some(catalog) = images else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "this server has no sandbox runtime"})),
        )
            .into_response();
    };
    let answer = match tokio::task::spawn_blocking(move || {
        catalog.list().map(|list| (catalog.default, list))
    })
    .await
    {
        Ok(Ok((default, images))) => (
            StatusCode::OK,
            Json(json!({"default": default, "images": images})),
        ),
        Ok(Err(err)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": err.to_string()})),
        ),
        Err(err) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": err.to_string()})),
        ),
    };
    answer.into_response()
}

/// The registry's series in the OpenMetrics text format (`src/metrics.rs`).
async fn metrics(State(state): State<AppState>, headers: HeaderMap, client: Client) -> Response {
    if let Some(refused) = operator_only(&state, &headers, &client) {
        return refused;
    }
    let answer = match crate::metrics::encode(&state.metrics) {
        Ok(text) => (
            StatusCode::OK,
            [(
                axum::http::header::CONTENT_TYPE,
                crate::metrics::CONTENT_TYPE,
            )],
            text,
        ),
        Err(err) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; charset=utf-8",
            )],
            format!("cannot encode the metrics: {err}"),
        ),
    };
    answer.into_response()
}

/// The memory ledger as `/readyz` shows it: capacity, committed, free.
fn headroom(headroom: &crate::api::admission::Headroom) -> serde_json::Value {
    json!({
        "capacity_bytes": headroom.capacity_bytes,
        "committed_bytes": headroom.committed_bytes,
        "free_bytes": headroom.free_bytes,
        "sandbox_limit_bytes": headroom.sandbox_bytes,
        "sandboxes": headroom.sandboxes,
        "warm_pool_bytes": headroom.warm_pool_bytes,
        "evicting": headroom.evicting,
        "sandboxes_that_fit": headroom.free_bytes.checked_div(headroom.sandbox_bytes).unwrap_or(0),
    })
}

/// Ready when the sandbox runtime works and the metadata store answers a listing.
/// Only operators see what runs here (the instance, its memory).
async fn readyz(
    State(state): State<AppState>,
    headers: HeaderMap,
    client: Client,
) -> impl IntoResponse {
    let operator = state.is_operator(&headers, client.as_deref());
    if state.runtime.is_none() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({"status": "unavailable", "error": "the sandbox runtime (runsc) is not available"}),
            ),
        );
    }
    match state.bucket.answers().await {
        Ok(_) => {
            let mut body = json!({"status": "ready"});
            if operator {
                body["instance"] = json!(state.instance);
                if let Some(admission) = &state.admission {
                    body["memory"] = headroom(&admission.headroom());
                }
            }
            (StatusCode::OK, Json(body))
        }
        Err(err) => {
            tracing::warn!(%err, "readiness probe: metadata store unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"status": "unavailable", "error": err.to_string()})),
            )
        }
    }
}
