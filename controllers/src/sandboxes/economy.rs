//! Storage cost of idle held sandboxes in dollars, on the real worker, instance
//! lease and doorbell loops in virtual time (tokio's paused clock drives timers
//! and lease timestamps). GCS bills a write (Class A) as 12.5 reads (Class B).
//! The earlier server spent $0.0013 per idle sandbox-hour at any count; targets:
//! at most $0.006/instance-hour fixed, $0.0006/sandbox-hour with 10 held
//! (`docs/principles.md`, `docs/decisions/0007-instance-leases-and-doorbells.md`).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::tests::Instance;
use super::*;
use crate::api::{SandboxId, SandboxMetadata};
use crate::clock::Clock;
use crate::leasing::LeaseConfig;
use crate::store::{CountingStore, OperationCounts, StorageBill, Store};
use crate::testing::MemoryStore;

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

/// What the clients of the held sandboxes do during the measured hours.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Clients {
    /// Attached, sending nothing (past the active window).
    Quiet,
    /// Left (after the setup; the detach window is measured separately).
    Detached,
    /// Attached, each sending a frame every 5 s.
    Active,
}

/// What an instance holding `held` sandboxes spends per virtual hour after a
/// setup (create, attach, let fast windows pass): (per hour, detach window).
async fn idle_bill(held: usize, clients: Clients, hours: u64) -> (StorageBill, StorageBill) {
    let counts = Arc::new(OperationCounts::default());
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let store: Arc<dyn Store> = Arc::new(CountingStore::new(memory, counts.clone()));
    #[allow(
        clippy::disallowed_methods,
        reason = "the test's clock itself: wall time that follows tokio's paused clock"
    )]
    let clock: Arc<dyn Clock> = Arc::new(TokioClock {
        base: Utc::now(),
        start: tokio::time::Instant::now(),
    });
    let (lease, config) = (LeaseConfig::default(), ReconcilerConfig::default());
    let controller = Instance::build(store, clock.clone(), "economy", lease, config, |_| {
        Arc::new(crate::hooks::NoHooks)
    })
    .controller;
    let workers = controller.spawn_workers();
    let mut ids = Vec::new();
    for _ in 0..held {
        let id = SandboxId::random();
        let mut metadata = SandboxMetadata::new(id.clone(), clock.now(), "a".repeat(64));
        metadata.spec.enable_checkpoint = true;
        metadata.spec.enable_sandbox_handoff = true;
        controller.create(&metadata).await.unwrap();
        while !controller.is_held_here(&id) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        controller.client_attached(&id, true);
        ids.push(id);
    }
    // Past every setup effect (the first resync) before measuring.
    tokio::time::sleep(Duration::from_secs(61)).await;
    let window_start = counts.bill();
    if clients == Clients::Detached {
        for id in &ids {
            controller.client_attached(id, false);
        }
    }
    tokio::time::sleep(ReconcilerConfig::default().detached_window + Duration::from_secs(1)).await;
    let window = counts.bill().since(&window_start);
    let before = counts.bill();
    let measured = tokio::time::sleep(Duration::from_secs(3600 * hours));
    if clients == Clients::Active {
        let frames = async {
            loop {
                for id in &ids {
                    controller.client_active(id);
                }
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        };
        tokio::select! {
            () = measured => {}
            () = frames => {}
        }
    } else {
        measured.await;
    }
    let spent = counts.bill().since(&before);
    for id in &ids {
        assert!(controller.is_held_here(id), "still held after {hours} h");
    }
    workers.abort();
    let per_hour = StorageBill {
        class_a: spent.class_a / hours,
        class_b: spent.class_b / hours,
    };
    (per_hour, window)
}

#[tokio::test(start_paused = true)]
async fn idle_held_sandboxes_cost_what_the_targets_allow_in_dollars() {
    let (one, _) = idle_bill(1, Clients::Quiet, 3).await;
    let (ten, window) = idle_bill(10, Clients::Detached, 3).await;
    let (active, _) = idle_bill(1, Clients::Active, 1).await;
    // total(n) = fixed + n × marginal.
    let marginal = (ten.dollars() - one.dollars()) / 9.0;
    let fixed = one.dollars() - marginal;
    println!(
        "storage cost at production defaults (GCS list prices: Class A $0.005, Class B $0.0004 per 1,000):\n\
         - one instance holding 1 idle sandbox: {} writes + {} reads an hour = ${:.5}/h\n\
         - one instance holding 10 idle sandboxes: {} writes + {} reads an hour = ${:.5}/h\n\
         - fixed per instance-hour: ${fixed:.5} (target ≤ $0.006)\n\
         - per idle held sandbox-hour: ${:.5} with 1 held, ${:.5} with 10 held (target ≤ $0.0006 at 10; earlier server $0.0013); marginal ${marginal:.6}\n\
         - the first minute after a client leaves (fast lock polling), once per sandbox: {} reads = ${:.6}\n\
         - one instance whose attached client is active (a frame every 5 s; doorbell read every 200 ms): {} writes + {} reads an hour = ${:.5}/h",
        one.class_a,
        one.class_b,
        one.dollars(),
        ten.class_a,
        ten.class_b,
        ten.dollars(),
        one.dollars(),
        ten.dollars() / 10.0,
        window.class_b / 10,
        window.dollars() / 10.0,
        active.class_a,
        active.class_b,
        active.dollars(),
    );
    assert!(fixed <= 0.006, "fixed ${fixed:.5} per instance-hour");
    assert!(
        ten.dollars() / 10.0 <= 0.0006,
        "${:.5} per sandbox-hour at 10 held",
        ten.dollars() / 10.0
    );
    assert_eq!(
        ten.class_a, one.class_a,
        "an idle held sandbox writes nothing of its own"
    );
    // An active client only doubles doorbell reads (fast polling ends with it).
    assert!(
        active.class_b >= one.class_b + 8_000 && active.class_b <= one.class_b + 10_000,
        "active {} vs quiet {} reads an hour",
        active.class_b,
        one.class_b
    );
    assert_eq!(active.class_a, one.class_a);
}
