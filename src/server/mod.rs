//! The composition root: [`Server::build`] is the one place an instance is
//! wired together, for the binary (`sandboxd serve`), the tests' in-process
//! servers and, through the binary, the benchmark's. Everything an instance
//! depends on comes in [`Parts`] (stores, runtime, clock, features, images),
//! so nothing is patched after construction; the server owns the tasks it
//! starts (the controller's workers) and its connections, and
//! [`Server::run`] takes its listener and shutdown signal as arguments
//! (mini-redis's `run`), so tests bind `127.0.0.1:0`.
//!
//! Shutdown, when the signal completes: stop accepting; let plain HTTP
//! requests finish; checkpoint (or delete) the sandboxes held here, which
//! ends their WebSocket sessions; wait for the last connection; stop the
//! workers.

mod connections;
pub mod origin;
mod routes;
mod warm_pool;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use controllers::api::InstanceId;
use controllers::clock::{Clock, SystemClock};
use controllers::hooks::LifecycleHooks;
use controllers::leasing::{LeaseConfig, Leases};
use controllers::runtime::SandboxRuntime;
use controllers::sandboxes::{Reconciler, ReconcilerConfig, ReconcilerParts, SandboxController};
use controllers::store::{CountingStore, OperationCounts, Store};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::runtime::ImageCatalog;
use crate::workspace::WorkspaceHooks;

pub use crate::api::features::Features;
pub use crate::api::state::AppState;
pub use connections::{
    ConnectionDeadlines, Connections, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, Peer,
};
pub use routes::app;

/// How many connections (WebSocket sessions included) a server keeps open at
/// once by default; more wait at `accept`.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 4096;

/// The parts an instance is built from.
#[derive(Debug, Clone)]
pub struct Parts {
    pub instance: InstanceId,
    pub metadata_store: Arc<dyn Store>,
    pub checkpoint_store: Arc<dyn Store>,
    /// Names recorded in `metadata.json` for checkpoints and snapshots.
    pub checkpoint_bucket: String,
    pub snapshot_bucket: String,
    /// `None` when runsc is unusable here: the server answers health checks,
    /// reports itself unready and refuses work.
    pub runtime: Option<Arc<dyn SandboxRuntime>>,
    /// The sandbox images (`GET /images`); `None` without a runtime.
    pub images: Option<ImageCatalog>,
    pub lease: LeaseConfig,
    pub reconciler: ReconcilerConfig,
    /// The instance's time: the controllers' (leases, intervals) and the
    /// API's (idle timers, deadlines, timestamps); the system clock in
    /// production, a manual one in simulations.
    pub clock: Arc<dyn Clock>,
    /// What clients may ask for (checked on each init message).
    pub features: Features,
    /// Where storage operations are counted; give the runtime's stores the
    /// same counts (wrap them with [`counted`]) so uploads are included.
    pub store_operations: Arc<OperationCounts>,
    /// Workspace sync hooks, if the server syncs workspaces.
    pub workspace_hooks: Option<Arc<WorkspaceHooks>>,
    /// Connections open at once, at most.
    pub max_connections: u32,
    /// How long a connection may take to become a request.
    pub connection_deadlines: ConnectionDeadlines,
    /// How long a shutdown waits for the sandboxes held here to be
    /// checkpointed, and then for the last connection.
    pub shutdown_grace: Duration,
    /// The gVisor runtime whose warm pool `/metrics` reports (`None`: no
    /// pool series).
    pub warm_pool: Option<Arc<crate::runtime::GvisorRuntime>>,
    /// What one `POST /execute` may print and how long it may run.
    pub execute: crate::api::limits::ExecuteLimits,
    /// The instance's memory capacity and each sandbox's share (`None`:
    /// no admission; the binary always sets it, see `src/boot.rs`).
    pub admission: Option<crate::api::admission::AdmissionSettings>,
    /// The concurrency caps of forks and `POST /execute`.
    pub limits: crate::api::limits::LimitSettings,
    /// What one client socket may hold and how long it may stay silent.
    pub socket: crate::api::session::SocketSettings,
    /// Bytes of client frames the sockets whose create or attach waits may
    /// keep between them.
    pub early_frames_budget_bytes: usize,
    /// Which browser origins may call the server.
    pub origins: origin::OriginPolicy,
    /// How long a sandbox may run here, and an execution with no client.
    pub lifetimes: crate::api::live::Lifetimes,
    /// Sandboxes one caller may hold here (`None`: no limit).
    pub max_sandboxes_per_caller: Option<usize>,
    /// Whether the platform verified the bearer ID token callers send
    /// (`--caller-identity-verified`): callers are then their identities,
    /// else their addresses (`api/caller.rs`).
    pub caller_identity_verified: bool,
    /// The credential that opens the operator surfaces to remote clients.
    pub operator_token: Option<String>,
    /// Where filesystem snapshots are kept (for their owners' quotas).
    pub snapshot_store: Option<Arc<dyn Store>>,
}

impl Parts {
    /// An instance on `store` (metadata, checkpoints and snapshots) with the
    /// defaults: system clock, checkpoints and snapshots allowed, no egress,
    /// default leases and intervals.
    pub fn new(
        instance: InstanceId,
        store: Arc<dyn Store>,
        runtime: Option<Arc<dyn SandboxRuntime>>,
    ) -> Self {
        Self {
            instance,
            metadata_store: Arc::clone(&store),
            checkpoint_store: Arc::clone(&store),
            checkpoint_bucket: "local".to_owned(),
            snapshot_bucket: "local".to_owned(),
            runtime,
            images: None,
            lease: LeaseConfig::default(),
            reconciler: ReconcilerConfig::default(),
            clock: Arc::new(SystemClock),
            features: Features::default(),
            store_operations: Arc::default(),
            workspace_hooks: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            connection_deadlines: ConnectionDeadlines::default(),
            shutdown_grace: Duration::from_secs(10),
            warm_pool: None,
            execute: crate::api::limits::ExecuteLimits::default(),
            admission: None,
            limits: crate::api::limits::LimitSettings::default(),
            socket: crate::api::session::SocketSettings::default(),
            early_frames_budget_bytes: crate::api::session::DEFAULT_EARLY_FRAMES_BUDGET_BYTES,
            origins: origin::OriginPolicy {
                allowed: Vec::new(),
                same_origin: true,
            },
            lifetimes: crate::api::live::Lifetimes::default(),
            max_sandboxes_per_caller: None,
            caller_identity_verified: false,
            operator_token: None,
            snapshot_store: Some(store),
        }
    }
}

/// `store`, counting its operations into `counts`.
pub fn counted(store: Arc<dyn Store>, counts: &Arc<OperationCounts>) -> Arc<dyn Store> {
    Arc::new(CountingStore::new(store, Arc::clone(counts)))
}

/// One instance: its state, the worker tasks it started and its connections.
#[derive(Debug)]
pub struct Server {
    state: AppState,
    /// The sandbox images `GET /images` lists; `None` without a runtime.
    images: Option<ImageCatalog>,
    origins: Arc<origin::OriginPolicy>,
    /// The controller's worker, lease and doorbell loops (with a runtime).
    workers: Option<JoinHandle<()>>,
    connections: Connections,
    shutdown_grace: Duration,
}

impl Server {
    /// Wires the controller to the stores and the runtime, starts its
    /// workers (when there is a runtime) and registers the metrics. Call
    /// inside a tokio runtime.
    pub fn build(mut parts: Parts) -> Self {
        let store_operations = Arc::clone(&parts.store_operations);
        parts.metadata_store = counted(parts.metadata_store, &store_operations);
        let controller = parts
            .runtime
            .as_ref()
            .map(|runtime| controller(&parts, Arc::clone(runtime)));
        let workers = controller.as_ref().map(|c| c.spawn_workers());
        let mut metrics = crate::metrics::registry(
            &store_operations,
            controller.as_ref(),
            parts.workspace_hooks.as_ref(),
        );
        if let Some(runtime) = &parts.warm_pool {
            crate::metrics::register_warm_pool(&mut metrics, runtime);
        }
        let live = Arc::new(crate::api::live::LiveSandboxes::new(
            parts.lifetimes,
            Arc::clone(&parts.clock),
        ));
        let admission = match (parts.admission, &controller) {
            (Some(settings), Some(controller)) => {
                let residents = crate::api::admission::LocalResidents {
                    controller: Arc::clone(controller),
                    live: Arc::clone(&live),
                };
                let pool = parts
                    .warm_pool
                    .clone()
                    .map(|runtime| runtime as Arc<dyn crate::api::admission::WarmPoolControl>);
                let admission = crate::api::admission::Admission::new(
                    settings,
                    Arc::new(residents),
                    pool,
                    Arc::clone(&parts.clock),
                );
                admission.spawn_pool_governor();
                crate::metrics::register_admission(&mut metrics, &admission);
                Some(admission)
            }
            _ => None,
        };
        let images = parts.runtime.as_ref().and(parts.images);
        let state = AppState {
            instance: parts.instance,
            bucket: crate::api::state::BucketProbe::new(
                parts.metadata_store,
                Arc::clone(&parts.clock),
            ),
            runtime: parts.runtime,
            controller,
            live,
            features: parts.features,
            store_operations,
            workspace_hooks: parts.workspace_hooks,
            metrics: Arc::new(metrics),
            execute: parts.execute,
            admission,
            limits: Arc::new(crate::api::limits::Limits::new(parts.limits)),
            socket: parts.socket,
            early_frames: crate::api::session::EarlyBudget::new(parts.early_frames_budget_bytes),
            shutdown: Arc::new(tokio::sync::watch::channel(false).0),
            callers: Arc::new(crate::api::caller::CallerQuota::new(
                parts.max_sandboxes_per_caller,
                parts.caller_identity_verified,
            )),
            snapshot_store: parts.snapshot_store.clone(),
            operator_token_sha256: parts.operator_token.as_deref().map(crate::token::digest),
            clock: Arc::clone(&parts.clock),
        };
        Self {
            state,
            images,
            origins: Arc::new(parts.origins),
            workers,
            connections: Connections::with_deadlines(
                parts.max_connections,
                parts.connection_deadlines,
                Arc::clone(&parts.clock),
            ),
            shutdown_grace: parts.shutdown_grace,
        }
    }

    /// What the handlers reach (tests inspect it).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// The server's connections (open now, limit).
    pub fn connections(&self) -> &Connections {
        &self.connections
    }

    /// Serves on `listener` until `shutdown` completes, then shuts down (see
    /// the module doc).
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let listener = self.connections.listen(listener);
        let app = app(self.state.clone(), self.images.clone())
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&self.origins),
                origin::check_origin,
            ))
            .layer(axum::middleware::from_fn(connections::track_requests))
            .into_make_service_with_connect_info::<Peer>();
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await?;
        self.shut_down().await;
        Ok(())
    }

    /// Checkpoints what is held here, waits for the connections, stops the
    /// workers.
    async fn shut_down(mut self) {
        let clock = Arc::clone(&self.state.clock);
        let deadline = clock.instant() + self.shutdown_grace;
        if let Some(controller) = &self.state.controller {
            let held = controller.held_sandboxes().len();
            tracing::info!(
                held,
                grace_s = self.shutdown_grace.as_secs(),
                "shutting down: checkpointing the sandboxes held here"
            );
            let left = controller.drain(self.shutdown_grace).await;
            if left > 0 {
                tracing::warn!(
                    left,
                    "shutdown grace ran out; these sandboxes are lost since their last checkpoint"
                );
            }
        }
        // The sessions end with their sandboxes; what is left of the grace
        // (a moment at least) lets them send their last frames. Sockets
        // still open then (a checkpoint the grace did not cover, a handshake
        // still waiting) are told 1001 rather than dropped with the process.
        let left = deadline.saturating_duration_since(clock.instant());
        let mut open = self
            .connections
            .closed(left.max(Duration::from_millis(200)))
            .await;
        if open > 0 {
            self.state.shutdown.send_replace(true);
            open = self.connections.closed(Duration::from_millis(500)).await;
        }
        if open > 0 {
            tracing::warn!(open, "closing with connections still open");
        }
        if let Some(workers) = self.workers.take() {
            workers.abort();
            let _ = workers.await;
        }
    }
}

impl Drop for Server {
    /// A server dropped without running (or a test's, when its runtime
    /// ends) stops its workers too.
    fn drop(&mut self) {
        if let Some(workers) = &self.workers {
            workers.abort();
        }
    }
}

/// The sandbox controller of an instance with a runtime.
fn controller(parts: &Parts, runtime: Arc<dyn SandboxRuntime>) -> Arc<SandboxController> {
    let leases = Leases::new(
        Arc::clone(&parts.metadata_store),
        Arc::clone(&parts.clock),
        parts.instance.clone(),
        parts.lease.clone(),
    );
    let reconciler = Reconciler::new(ReconcilerParts {
        metadata: Arc::clone(&parts.metadata_store),
        checkpoints: Arc::clone(&parts.checkpoint_store),
        checkpoint_bucket: parts.checkpoint_bucket.clone(),
        snapshot_bucket: parts.snapshot_bucket.clone(),
        runtime,
        leases,
        clock: Arc::clone(&parts.clock),
        config: parts.reconciler.clone(),
    });
    let reconciler = match &parts.workspace_hooks {
        Some(hooks) => reconciler.with_hooks(Arc::clone(hooks) as Arc<dyn LifecycleHooks>),
        None => reconciler,
    };
    SandboxController::new(reconciler)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::Message;

    /// A socket still open when the server's grace has run out (here one
    /// waiting for its init; in a drain, a start the grace did not cover) is
    /// told 1001 with a reason, not dropped without a word when the process
    /// ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_socket_still_open_at_shutdown_is_closed_with_going_away() {
        let instance = controllers::api::InstanceId::parse("shutting-down").unwrap();
        let store: Arc<dyn controllers::store::Store> =
            Arc::new(controllers::testing::MemoryStore::new());
        let mut parts = super::Parts::new(instance, store, None);
        parts.shutdown_grace = Duration::from_secs(1);
        let server = super::Server::build(parts);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.run(listener, async {
            let _ = stopped.await;
        }));
        let url = format!("ws://{addr}/create");
        let (mut socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        // No init sent: the server waits for it (its init timeout is 10 s).
        stop.send(()).unwrap();
        let close = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match socket.next().await {
                    Some(Ok(Message::Close(frame))) => return frame,
                    Some(Ok(_)) => {}
                    other => panic!("the socket ended without a close frame: {other:?}"),
                }
            }
        })
        .await
        .expect("closed at the shutdown, not at the init timeout");
        let close = close.expect("a close frame with a code");
        assert_eq!(u16::from(close.code), 1001);
        assert!(close.reason.contains("shutting down"), "{}", close.reason);
        serving.await.unwrap().unwrap();
    }
}
