//! The storage economy of an idle held sandbox, measured on the real worker
//! loop in virtual time (tokio's paused clock drives both the requeue timers
//! and the lease timestamps): how many storage operations one sandbox costs
//! per hour while nothing happens to it. The earlier server spent about 1,920
//! (a lock read every 2 s, a rewrite every 30 s); the target is at most 380.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::*;
use crate::api::{InstanceId, SandboxId, SandboxMetadata};
use crate::clock::Clock;
use crate::leasing::{LeaseConfig, Leases};
use crate::store::{CountingStore, OperationCounts, Store};
use crate::testing::{FakeRuntime, MemoryStore};

/// Wall time that follows tokio's (paused) clock.
#[derive(Debug)]
struct TokioClock {
    base: DateTime<Utc>,
    start: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> DateTime<Utc> {
        self.base + chrono::Duration::from_std(self.start.elapsed()).unwrap_or_default()
    }
}

/// Operations spent on one idle sandbox over `hours` of virtual time, after a
/// setup phase (create, then the client leaves and its fast-poll window ends
/// when `detach` is true). Returns (per hour, during the detach window).
async fn idle_cost(detach: bool, hours: u64) -> (u64, u64) {
    let counts = Arc::new(OperationCounts::default());
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let store: Arc<dyn Store> = Arc::new(CountingStore::new(memory, counts.clone()));
    let clock: Arc<dyn Clock> = Arc::new(TokioClock {
        base: Utc::now(),
        start: tokio::time::Instant::now(),
    });
    let bus = ProgressBus::default();
    let runtime = FakeRuntime::new(store.clone());
    let reconciler = Reconciler::new(ReconcilerParts {
        metadata: store.clone(),
        checkpoints: store.clone(),
        checkpoint_bucket: "b".into(),
        snapshot_bucket: "b".into(),
        runtime: Arc::new(runtime),
        leases: Leases::new(
            store.clone(),
            clock.clone(),
            InstanceId::parse("economy").unwrap(),
            LeaseConfig::default(),
        ),
        clock: clock.clone(),
        bus: bus.clone(),
        config: ReconcilerConfig::default(),
    });
    let controller = SandboxController::new(reconciler, bus);
    let workers = controller.spawn_workers();
    let id = SandboxId::random();
    let mut metadata = SandboxMetadata::new(id.clone(), clock.now(), "a".repeat(64));
    metadata.spec.enable_checkpoint = true;
    metadata.spec.enable_sandbox_handoff = true;
    controller.create(&metadata).await.unwrap();
    while !controller.is_held_here(&id) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let window_start = counts.for_sandbox(id.as_str());
    if detach {
        controller.client_attached(&id, false);
    }
    tokio::time::sleep(ReconcilerConfig::default().detached_window + Duration::from_secs(1)).await;
    let window = counts.for_sandbox(id.as_str()) - window_start;
    let before = counts.for_sandbox(id.as_str());
    tokio::time::sleep(Duration::from_secs(3600 * hours)).await;
    let per_hour = (counts.for_sandbox(id.as_str()) - before) / hours;
    assert!(controller.is_held_here(&id), "still held after {hours} h");
    workers.abort();
    (per_hour, window)
}

#[tokio::test(start_paused = true)]
async fn an_idle_held_sandbox_costs_at_most_380_operations_an_hour() {
    let (attached, _) = idle_cost(false, 3).await;
    let (detached, window) = idle_cost(true, 3).await;
    println!(
        "storage operations per idle held sandbox-hour: {attached} (client attached), \
         {detached} (client gone); the first minute after a client leaves costs {window}"
    );
    assert!(
        attached <= 380,
        "{attached} operations/hour with the client attached"
    );
    assert!(
        detached <= 380,
        "{detached} operations/hour after the client left"
    );
}
