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
use controllers::clock::{Clock, SystemClock};
use controllers::hooks::LifecycleHooks;
use controllers::layout::SANDBOXES_PREFIX;
use controllers::leasing::{LeaseConfig, Leases};
use controllers::runtime::SandboxRuntime;
use controllers::sandboxes::{
    ProgressBus, Reconciler, ReconcilerConfig, ReconcilerParts, SandboxController,
};
use controllers::store::{CountingStore, Operation, OperationCounts, Store};
use serde_json::json;
use tokio::net::TcpListener;

use crate::workspace::WorkspaceHooks;

pub use crate::api::state::{AppState, Features};

/// The parts an instance is built from.
#[derive(Debug, Clone)]
pub struct Parts {
    pub instance: InstanceId,
    pub metadata_store: Arc<dyn Store>,
    pub checkpoint_store: Arc<dyn Store>,
    /// Names recorded in `metadata.json` for checkpoints and snapshots.
    pub checkpoint_bucket: String,
    pub snapshot_bucket: String,
    pub runtime: Option<Arc<dyn SandboxRuntime>>,
    pub lease: LeaseConfig,
    pub reconciler: ReconcilerConfig,
    /// Where storage operations are counted; give the runtime's stores the
    /// same counts (wrap them with [`counted`]) so uploads are included.
    pub store_operations: Arc<OperationCounts>,
    /// Workspace sync hooks, if the server syncs workspaces.
    pub workspace_hooks: Option<Arc<WorkspaceHooks>>,
}

/// `store`, counting its operations into `counts`.
pub fn counted(store: Arc<dyn Store>, counts: &Arc<OperationCounts>) -> Arc<dyn Store> {
    Arc::new(CountingStore::new(store, Arc::clone(counts)))
}

impl AppState {
    /// Wires the controller to the stores and the runtime and starts its
    /// workers (when there is a runtime).
    pub fn assemble(mut parts: Parts) -> Self {
        let store_operations = Arc::clone(&parts.store_operations);
        parts.metadata_store = counted(parts.metadata_store, &store_operations);
        let controller = parts.runtime.as_ref().map(|runtime| {
            let bus = ProgressBus::default();
            let clock: Arc<dyn Clock> = Arc::new(SystemClock);
            let leases = Leases::new(
                Arc::clone(&parts.metadata_store),
                Arc::clone(&clock),
                parts.instance.clone(),
                parts.lease.clone(),
            );
            let reconciler = Reconciler::new(ReconcilerParts {
                metadata: Arc::clone(&parts.metadata_store),
                checkpoints: Arc::clone(&parts.checkpoint_store),
                checkpoint_bucket: parts.checkpoint_bucket.clone(),
                snapshot_bucket: parts.snapshot_bucket.clone(),
                runtime: Arc::clone(runtime),
                leases,
                clock,
                bus: bus.clone(),
                config: parts.reconciler.clone(),
            });
            let reconciler = match &parts.workspace_hooks {
                Some(hooks) => reconciler.with_hooks(Arc::clone(hooks) as Arc<dyn LifecycleHooks>),
                None => reconciler,
            };
            let controller = SandboxController::new(reconciler, bus);
            controller.spawn_workers();
            controller
        });
        Self {
            instance: parts.instance,
            metadata_store: parts.metadata_store,
            runtime: parts.runtime,
            controller,
            live: Arc::default(),
            features: Features {
                checkpoint: true,
                snapshot: true,
                network_egress: false,
            },
            store_operations,
            workspace_hooks: parts.workspace_hooks,
            images: None,
        }
    }
}

/// The router, apart from `main`, so tests can drive it.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/", get(root))
        .route("/status", get(status))
        .route("/healthz", get(status))
        .route("/readyz", get(readyz))
        .route("/list", get(list))
        .route("/images", get(images))
        .route("/metrics", get(metrics))
        .route("/execute", post(crate::api::execute::execute))
        .route("/create", get(crate::api::connect::create))
        .route("/attach/{sandbox_id}", get(crate::api::connect::attach))
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` completes.
///
/// Every accepted socket gets `TCP_NODELAY`: the protocol is many small
/// frames (`EXECUTION_RUNNING`, a short `stdout`, `exit_code`, `DONE`), and
/// with Nagle's algorithm each one after the first waits for the client's
/// delayed ACK (about 40 ms with the Python and TypeScript clients).
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|socket| {
        if let Err(err) = socket.set_nodelay(true) {
            tracing::warn!(%err, "cannot set TCP_NODELAY on an accepted socket");
        }
    });
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

/// The sandboxes running on this instance (upstream listed runsc's default
/// root, which never held its sandboxes: bug B15). `containers` keeps
/// upstream's key, as a text table; `sandboxes` is the same as objects.
async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
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
    Json(json!({"containers": table, "sandboxes": sandboxes}))
}

/// The sandbox images this server has: digest, names, packages, which one is
/// the default (`sandboxctl images`).
async fn images(State(state): State<AppState>) -> impl IntoResponse {
    let Some(catalog) = &state.images else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "this server has no sandbox runtime"})),
        );
    };
    let catalog = catalog.clone();
    match tokio::task::spawn_blocking(move || catalog.list().map(|list| (catalog.default, list)))
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
    }
}

/// Prometheus text: storage operations by kind, sandboxes held here.
async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let mut text = String::from(
        "# HELP sandboxd_store_operations_total Storage operations (GCS requests) made by this instance.\n\
         # TYPE sandboxd_store_operations_total counter\n",
    );
    for operation in Operation::ALL {
        text.push_str(&format!(
            "sandboxd_store_operations_total{{op=\"{}\"}} {}\n",
            operation.as_str(),
            state.store_operations.count(operation)
        ));
    }
    let held = state
        .controller
        .as_ref()
        .map_or(0, |controller| controller.held_sandboxes().len());
    let errors = state
        .controller
        .as_ref()
        .map_or(0, |controller| controller.reconcile_errors());
    if let Some(controller) = &state.controller {
        text.push_str(&controller.reconciler().metrics().render(held));
    }
    if let Some(hooks) = &state.workspace_hooks {
        text.push_str(&hooks.metrics().render());
    }
    text.push_str(&format!(
        "# HELP sandboxd_reconcile_errors_total Failed reconcile passes (storage errors, invalid documents; each is logged with its reason).\n\
         # TYPE sandboxd_reconcile_errors_total counter\nsandboxd_reconcile_errors_total {errors}\n"
    ));
    text.push_str(&format!(
        "# HELP sandboxd_sandboxes_held Sandboxes running on this instance.\n\
         # TYPE sandboxd_sandboxes_held gauge\nsandboxd_sandboxes_held {held}\n"
    ));
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
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
