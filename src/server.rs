//! The HTTP server: routes, shared state, and a `run` that takes its listener and
//! shutdown signal as arguments so tests can bind `127.0.0.1:0`.

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use controllers::api::InstanceId;
use controllers::layout::SANDBOXES_PREFIX;
use controllers::runtime::SandboxRuntime;
use controllers::store::Store;
use serde_json::json;
use tokio::net::TcpListener;

/// What every request handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub instance: InstanceId,
    pub metadata_store: Arc<dyn Store>,
    /// `None` when runsc is unusable here: the server still answers health
    /// checks, reports itself unready, and refuses work with a clear error.
    pub runtime: Option<Arc<dyn SandboxRuntime>>,
}

/// The router, apart from `main`, so tests can drive it.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/status", get(status))
        .route("/healthz", get(status))
        .route("/readyz", get(readyz))
        .route("/execute", post(crate::api::execute::execute))
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn root() -> Json<serde_json::Value> {
    Json(json!({"message": "Server is running"}))
}

async fn status() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// Ready when the sandbox runtime works and the metadata store answers a listing.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.runtime.is_none() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({"status": "unavailable", "error": "the sandbox runtime (runsc) is not available"}),
            ),
        );
    }
    match state.metadata_store.list_page(SANDBOXES_PREFIX, None).await {
        Ok(_) => (
            StatusCode::OK,
            Json(json!({"status": "ready", "instance": state.instance})),
        ),
        Err(err) => {
            tracing::warn!(%err, "readiness probe: metadata store unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"status": "unavailable", "error": err.to_string()})),
            )
        }
    }
}
