//! Admission against a fake instance (held sandboxes whose evictions
//! complete when the test says) and a fake warm pool, with waits of a few
//! hundred milliseconds.

use std::sync::Mutex;

use tokio::time::Instant;

use super::*;

const MIB: u64 = 1 << 20;
/// How long an eviction takes to complete.
const LEAVE: Duration = Duration::from_millis(200);
/// An admission's wait when it must run out, and when it must not.
const SHORT: Duration = Duration::from_millis(400);
const LONG: Duration = Duration::from_secs(20);

/// Held sandboxes; an eviction takes `leave_after` to complete (`None`: never).
#[derive(Debug)]
struct FakeResidents {
    held: Mutex<Vec<Candidate>>,
    evicted: Mutex<Vec<SandboxId>>,
    leave_after: Option<Duration>,
}

impl FakeResidents {
    fn new(leave_after: Option<Duration>) -> Arc<Self> {
        Arc::new(Self {
            held: Mutex::default(),
            evicted: Mutex::default(),
            leave_after,
        })
    }

    /// Holds sandbox `n`, last active `age_s` ago.
    fn hold(&self, n: u128, age_s: u64, attached: bool) {
        self.held.lock().unwrap().push(Candidate {
            id: SandboxId::from_u128(n),
            attached,
            executing: false,
            checkpointable: true,
            last_activity: Instant::now() - Duration::from_secs(age_s),
        });
    }

    fn evicted(&self) -> Vec<SandboxId> {
        self.evicted.lock().unwrap().clone()
    }
}

#[async_trait]
impl Residents for Arc<FakeResidents> {
    fn held(&self) -> Vec<SandboxId> {
        self.held
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.id.clone())
            .collect()
    }

    fn candidates(&self) -> Vec<Candidate> {
        self.held.lock().unwrap().clone()
    }

    async fn evict(&self, sandbox: &SandboxId) -> Result<(), String> {
        self.evicted.lock().unwrap().push(sandbox.clone());
        if let Some(after) = self.leave_after {
            let (me, sandbox) = (Arc::clone(self), sandbox.clone());
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                me.held.lock().unwrap().retain(|c| c.id != sandbox);
            });
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct FakePool {
    /// (target, ready); each warm sandbox uses 22 MiB.
    sizes: Mutex<(usize, usize)>,
}

impl WarmPoolControl for FakePool {
    fn stats(&self) -> WarmPoolStats {
        let (target, ready) = *self.sizes.lock().unwrap();
        WarmPoolStats {
            target,
            ready,
            memory_bytes: ready as u64 * 22 * MIB,
            ..WarmPoolStats::default()
        }
    }

    fn resize(&self, size: usize) {
        let mut sizes = self.sizes.lock().unwrap();
        *sizes = (size, sizes.1.min(size));
    }
}

fn admission(
    residents: &Arc<FakeResidents>,
    pool: Option<Arc<FakePool>>,
    capacity_mib: u64,
    wait: Duration,
) -> Arc<Admission> {
    Admission::new(
        AdmissionSettings {
            capacity_bytes: capacity_mib * MIB,
            sandbox_bytes: 1024 * MIB,
            wait,
            warm_pool: 2,
        },
        Arc::new(Arc::clone(residents)),
        pool.map(|pool| pool as Arc<dyn WarmPoolControl>),
        Arc::new(controllers::clock::SystemClock),
    )
}

fn id(n: u128) -> SandboxId {
    SandboxId::from_u128(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_count_until_dropped_and_a_full_instance_with_no_idle_sandbox_refuses() {
    let residents = FakeResidents::new(Some(LEAVE));
    let admission = admission(&residents, None, 2048, SHORT);
    let first = admission.admit(&id(10)).await.expect("fits");
    let second = admission.admit(&id(11)).await.expect("fits");
    assert_eq!(admission.headroom().free_bytes, 0);
    let refused = admission.admit(&id(12)).await.expect_err("full");
    assert_eq!(refused.why, NOTHING_IDLE);
    assert!(
        refused.to_string().contains("at capacity")
            && refused.to_string().contains("2048 MiB of its 2048 MiB"),
        "{refused}"
    );
    drop(first);
    let third = admission.admit(&id(12)).await.expect("a claim dropped");
    // A claim and a hold of the same sandbox count once.
    residents.hold(11, 0, true);
    assert_eq!(admission.headroom().sandboxes, 2);
    drop((second, third));
    assert_eq!(admission.headroom().refusals, 1);
    assert!(residents.evicted().is_empty(), "nothing was idle to evict");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_pool_shrinks_before_any_sandbox_is_evicted() {
    let residents = FakeResidents::new(Some(LEAVE));
    residents.hold(1, 600, false);
    let pool = Arc::new(FakePool::default());
    pool.resize(2);
    *pool.sizes.lock().unwrap() = (2, 2);
    // Room for two sandboxes and one warm one.
    let admission = admission(&residents, Some(Arc::clone(&pool)), 2048 + 30, LONG);
    let claim = admission
        .admit(&id(10))
        .await
        .expect("fits once the pool shrinks");
    assert_eq!(*pool.sizes.lock().unwrap(), (1, 1));
    assert!(residents.evicted().is_empty(), "{:?}", residents.evicted());
    // The governor keeps it there while the room is taken, and regrows
    // it (up to its size) when a sandbox leaves.
    admission.fit_warm_pool();
    assert_eq!(pool.stats().target, 1);
    residents.held.lock().unwrap().clear();
    drop(claim);
    admission.fit_warm_pool();
    assert_eq!(pool.stats().target, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_least_recently_used_idle_sandbox_is_evicted_and_the_admission_waits_for_it() {
    let residents = FakeResidents::new(Some(LEAVE));
    residents.hold(1, 30, false); // idle, used 30 s ago
    residents.hold(2, 900, true); // older but attached
    residents.hold(3, 300, false); // idle, used 5 min ago: the LRU idle one
    let pool = Arc::new(FakePool::default());
    *pool.sizes.lock().unwrap() = (2, 2);
    let admission = admission(&residents, Some(Arc::clone(&pool)), 3 * 1024, LONG);
    let started = Instant::now();
    let _claim = admission.admit(&id(10)).await.expect("room was made");
    assert_eq!(residents.evicted(), vec![id(3)]);
    assert!(started.elapsed() >= LEAVE, "admitted only once it left");
    assert_eq!(pool.stats().ready, 0, "the pool went first");
    let headroom = admission.headroom();
    assert_eq!((headroom.sandboxes, headroom.evictions), (3, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_admissions_evict_one_sandbox_each() {
    let residents = FakeResidents::new(Some(LEAVE));
    for n in 1..=3 {
        residents.hold(n, 100 * n as u64, false);
    }
    let admission = admission(&residents, None, 3 * 1024, LONG);
    let (first, second) = (id(10), id(11));
    let (a, b) = tokio::join!(admission.admit(&first), admission.admit(&second));
    let (_a, _b) = (a.expect("a"), b.expect("b"));
    let mut evicted = residents.evicted();
    evicted.sort();
    assert_eq!(evicted, vec![id(2), id(3)], "the two least recently used");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_that_does_not_complete_in_time_is_a_refusal() {
    let residents = FakeResidents::new(None);
    residents.hold(1, 60, false);
    let admission = admission(&residents, None, 1024, SHORT);
    let started = Instant::now();
    let refused = admission.admit(&id(10)).await.expect_err("never left");
    assert_eq!(refused.why, NOT_IN_TIME);
    assert!(started.elapsed() >= SHORT);
    assert_eq!(residents.evicted(), vec![id(1)], "evicted once, not again");
}

/// The buffers counted with each sandbox are the sum of their bounds: 60 MiB
/// at the default reply budget (the figure docs/security.md gives).
#[test]
fn a_sandbox_counts_its_sessions_buffers_at_their_bounds() {
    use crate::api::session::DEFAULT_REPLY_BUDGET_BYTES;
    assert_eq!(
        super::session_buffer_bytes(DEFAULT_REPLY_BUDGET_BYTES),
        60 << 20
    );
    assert_eq!(
        super::session_buffer_bytes(1 << 20),
        super::session_buffer_bytes(0) + (1 << 20),
        "the reply budget is counted as set"
    );
}
