//! What every request handler can reach: the API layer's own state. The
//! composition root (`server/mod.rs`, `Server::build`) builds it and the
//! router around it; nothing here depends on the server, so dependencies
//! point one way.

use std::sync::Arc;

use controllers::api::InstanceId;
use controllers::clock::Clock;
use controllers::layout::SANDBOXES_PREFIX;
use controllers::runtime::SandboxRuntime;
use controllers::sandboxes::SandboxController;
use controllers::store::{OperationCounts, Store, StoreError};

use super::features::Features;
use crate::workspace::WorkspaceHooks;

/// What every request handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub instance: InstanceId,
    /// Whether the bucket answers, for the readiness check: the API layer's
    /// only reach into the bucket that holds the sandboxes' objects, and it
    /// cannot write (every write of a sandbox's objects is its pass's).
    pub bucket: BucketProbe,
    /// `None` when runsc is unusable here: the server still answers health
    /// checks, reports itself unready, and refuses work with a clear error.
    pub runtime: Option<Arc<dyn SandboxRuntime>>,
    /// The sandbox controller (absent with the runtime).
    pub controller: Option<Arc<SandboxController>>,
    /// The sandboxes this instance serves, as the sessions see them.
    pub live: Arc<crate::api::live::LiveSandboxes>,
    pub features: Features,
    /// Storage operations made by this instance (metadata and checkpoints).
    pub store_operations: Arc<OperationCounts>,
    /// Workspace sync (`None`: not configured on this server).
    pub workspace_hooks: Option<Arc<WorkspaceHooks>>,
    /// Every series `/metrics` reports (`src/metrics.rs`).
    pub metrics: Arc<prometheus_client::registry::Registry>,
    /// What one `POST /execute` may print and how long it may run.
    pub execute: crate::api::limits::ExecuteLimits,
    /// The memory ledger every start passes (`None`: admission is off, as
    /// with no per-sandbox memory limit).
    pub admission: Option<Arc<crate::api::admission::Admission>>,
    /// The concurrency caps of forks and `POST /execute`.
    pub limits: Arc<crate::api::limits::Limits>,
    /// What one client socket may hold and how long it may stay silent.
    pub socket: crate::api::session::SocketSettings,
    /// The bytes of client frames all sockets together may keep while
    /// their handshakes wait (`--ws-early-frames-budget-bytes`).
    pub early_frames: crate::api::session::EarlyBudget,
    /// Set by the server's shutdown once its grace has run out: sockets
    /// still open close with 1001 ([`crate::api::session::ShutdownNotice`]).
    pub shutdown: Arc<tokio::sync::watch::Sender<bool>>,
    /// The sandboxes each caller holds here, and how many it may.
    pub callers: Arc<crate::api::caller::CallerQuota>,
    /// Where filesystem snapshots are kept (their owners' quotas are
    /// counted there); `None`: no quota is checked.
    pub snapshot_store: Option<Arc<dyn Store>>,
    /// The SHA-256 of the operator credential (`--operator-token`), which
    /// opens `/list`, `/metrics`, `/images` and `/readyz`'s detail to a
    /// client that is not on this machine; `None`: only local clients.
    pub operator_token_sha256: Option<String>,
    /// The instance's time, the controller's clock: every reading of wall
    /// or monotonic time in the API goes through it (clippy's
    /// `disallowed-methods` refuses the host's clocks here).
    pub clock: Arc<dyn Clock>,
}

/// How long a bucket that answered counts as answering: `/readyz` needs no
/// authentication, and each listing is a billed Class A request, so a
/// flood of probes costs at most one listing a second.
const PROBE_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// A read-only look at the bucket of the sandboxes' objects: whether it
/// answers a listing. It holds the store privately, so a request handler
/// cannot write `metadata.json` or `lock.json` through it.
#[derive(Debug, Clone)]
pub struct BucketProbe {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    /// When the bucket last answered; held across a listing, so probes that
    /// come meanwhile wait for its answer instead of listing too.
    answered: Arc<tokio::sync::Mutex<Option<tokio::time::Instant>>>,
}

impl BucketProbe {
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            clock,
            answered: Arc::default(),
        }
    }

    /// `Ok` when the bucket answers: it answered a listing of one page of
    /// the sandboxes' prefix within the last [`PROBE_FRESH`], or does now.
    pub async fn answers(&self) -> Result<(), StoreError> {
        let mut answered = self.answered.lock().await;
        let now = self.clock.instant();
        if answered.is_some_and(|at| now < at + PROBE_FRESH) {
            return Ok(());
        }
        self.store.list_page(SANDBOXES_PREFIX, None).await?;
        *answered = Some(self.clock.instant());
        Ok(())
    }
}

/// The header that carries the operator credential.
pub const OPERATOR_HEADER: &str = "x-operator-token";

impl AppState {
    /// True when the request may see the operator surfaces: it comes from
    /// this machine (a loopback peer), or carries the operator credential.
    pub fn is_operator(
        &self,
        headers: &axum::http::HeaderMap,
        client: Option<&crate::api::caller::ClientAddr>,
    ) -> bool {
        if client.is_some_and(|addr| addr.0.ip().is_loopback()) {
            return true;
        }
        let (Some(expected), Some(given)) = (
            &self.operator_token_sha256,
            headers
                .get(OPERATOR_HEADER)
                .and_then(|value| value.to_str().ok()),
        ) else {
            return false;
        };
        crate::token::matches(given.trim(), expected)
    }
}

#[cfg(test)]
mod tests {
    use controllers::clock::SystemClock;
    use controllers::store::{CountingStore, Operation};
    use controllers::testing::MemoryStore;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_of_readiness_probes_lists_the_bucket_once_a_second() {
        let counts = Arc::new(OperationCounts::default());
        let store = Arc::new(CountingStore::new(
            Arc::new(MemoryStore::new()),
            Arc::clone(&counts),
        ));
        let probe = BucketProbe::new(store, Arc::new(SystemClock));
        let probes: Vec<_> = (0..100)
            .map(|_| {
                let probe = probe.clone();
                tokio::spawn(async move { probe.answers().await })
            })
            .collect();
        for probe in probes {
            probe.await.unwrap().unwrap();
        }
        assert_eq!(counts.count(Operation::List), 1);
        tokio::time::sleep(PROBE_FRESH).await;
        probe.answers().await.unwrap();
        assert_eq!(counts.count(Operation::List), 2);
    }
}
