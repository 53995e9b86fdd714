//! The critical paths, counted in sequential store requests (decision 18),
//! tens of ms each on GCS. Budgets (`docs/principles.md`, "Performance
//! targets"): create ≤ 3, checkpoint ≤ 4, attach + restore ≤ 4, handoff ≤ 10.
//! Each request takes a tick of paused tokio time (concurrent ones overlap),
//! so a path's ticks from the API layer's first call to the client's event
//! are its sequential requests. Driven by hand with no waits, the count has
//! every read needed to notice (doorbell, poll) but no poll interval. A blob
//! upload is one request here, two on GCS (resumable).

#![allow(
    clippy::disallowed_methods,
    reason = "the paths are measured in ticks of tokio's paused clock, read directly"
)]

use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::hooked_store::{BeforeRequest, HookedStore, Request};
use super::*;
use crate::store::StoreError;

/// One request's latency, in paused time.
const TICK: Duration = Duration::from_millis(10);

/// One tick of paused time before every request.
#[derive(Debug)]
struct Slow;

#[async_trait]
impl BeforeRequest for Slow {
    async fn before(&self, _: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        tokio::time::sleep(TICK).await;
        Ok(())
    }
}

/// The memory store, one tick per request.
fn slow(store: Arc<MemoryStore>) -> Arc<HookedStore<Slow>> {
    Arc::new(HookedStore::new(store, Slow))
}

/// Sequential requests since `start`.
fn requests_since(start: Instant) -> u128 {
    start.elapsed().as_millis() / TICK.as_millis()
}

/// Runs a pass of `id` to its end; the requests from `start` to `done`'s event.
async fn until_event(
    instance: &Instance,
    id: &SandboxId,
    events: &mut broadcast::Receiver<SandboxEvent>,
    start: Instant,
    done: impl Fn(&SandboxEvent) -> bool,
) -> u128 {
    let counted = async {
        while !done(&events.recv().await.unwrap()) {}
        requests_since(start)
    };
    let (count, outcome) = tokio::join!(counted, instance.reconciler().reconcile(id));
    outcome.unwrap();
    count
}

fn running(event: &SandboxEvent) -> bool {
    matches!(event, SandboxEvent::Running { .. })
}

/// The API layer's attach: read both, write the intent (or take a free hold).
async fn attach(instance: &Instance, id: &SandboxId, world: &World) {
    let controller = &instance.controller;
    let read = controller.read_for_attach(id).await.unwrap().unwrap();
    let ask = controller.request_here_from(read, None, world.clock.now());
    controller.serving(id, ask).await.unwrap();
}

async fn create(instance: &Instance, world: &World) -> (SandboxId, u128) {
    let (id, metadata) = world.new_sandbox(true);
    let mut events = instance.controller.subscribe(&id);
    let start = Instant::now();
    instance.create_from(&metadata).await.unwrap();
    let count = until_event(instance, &id, &mut events, start, running).await;
    (id, count)
}

async fn checkpoint(instance: &Instance, id: &SandboxId) -> u128 {
    let mut events = instance.controller.subscribe(id);
    let start = Instant::now();
    instance.ask(id, DesiredState::Checkpointed, None).await;
    let checkpointed = |event: &_| matches!(event, SandboxEvent::Checkpointed { .. });
    until_event(instance, id, &mut events, start, checkpointed).await
}

fn within_budget(what: &str, count: u128, budget: u128) {
    assert!(count <= budget, "{what} took {count} sequential requests");
}

#[tokio::test(start_paused = true)]
async fn create_checkpoint_and_restore_stay_within_their_request_budgets() {
    let (world, _) = World::hooked(Slow);
    let a = world.instance("a");
    // The first create also writes the instance lease: measure a second.
    create(&a, &world).await;
    let (id, create_count) = create(&a, &world).await;
    a.run(&id, "x=1").await;
    let checkpoint_count = checkpoint(&a, &id).await;

    let mut events = a.controller.subscribe(&id);
    let start = Instant::now();
    attach(&a, &id, &world).await;
    let restore_count = until_event(&a, &id, &mut events, start, running).await;
    let memory = a.runtime.memory(&id).unwrap();
    assert_eq!(memory, vec!["x=1"], "the checkpoint's state came back");
    println!(
        "sequential store requests: create {create_count}, checkpoint {checkpoint_count}, attach + restore {restore_count}"
    );
    within_budget("create", create_count, 3);
    // Budget 4; the upload and the hand-back are all it needs (decision 22).
    within_budget("checkpoint", checkpoint_count, 2);
    within_budget("attach + restore", restore_count, 4);
}

#[tokio::test(start_paused = true)]
async fn a_handoff_stays_within_its_request_budget() {
    let (world, _) = World::hooked(Slow);
    let (a, b) = (world.instance("a"), world.instance("b"));
    let (id, _) = create(&a, &world).await;
    a.run(&id, "x=1").await;
    let mut events = b.controller.subscribe(&id);
    let start = Instant::now();
    // B's client attaches: intent written, A rung.
    attach(&b, &id, &world).await;
    // A notices the ring, checkpoints and transfers the hold to B.
    a.answer_doorbell().await;
    a.pass(&id).await;
    // B's next poll finds the hold is its own and restores.
    let count = until_event(&b, &id, &mut events, start, running).await;
    assert_eq!(b.runtime.memory(&id).unwrap(), vec!["x=1"]);
    assert!(!a.runs(&id));
    println!("sequential store requests: handoff {count}");
    within_budget("the handoff", count, 10);
    // The transfer is one fenced write: B holds at the next epoch, and its
    // record followed the client's `RUNNING` (in a task of its own).
    b.reconciler().background_settled().await;
    let lock = world.lease(&id).await;
    assert_eq!(lock.holder, Some(named("b")));
    let status = world.metadata(&id).await.status;
    assert_eq!(status.epoch, lock.epoch);
    assert_eq!(status.holder, Some(named("b")));
    assert_eq!(status.latest_checkpoint, lock.checkpoint);
}

/// Twenty attaches at once on an instance with a stale lease (it held nothing) write it once: each
/// waits for the renewal in flight, not writing its own (GCS: one write/s per object).
#[tokio::test(start_paused = true)]
async fn concurrent_starts_share_one_renewal_of_the_instance_lease() {
    use crate::store::{CountingStore, Operation, OperationCounts};
    let counts = Arc::new(OperationCounts::default());
    let world = World::wrapped(|store| Arc::new(CountingStore::new(slow(store), counts.clone())));
    let (clock, config) = (Arc::new(world.clock.clone()), LeaseConfig::default());
    let b = Leases::new(world.bucket.clone(), clock, named("b"), config);
    let ensured = (0..20).map(|_| {
        let b = b.clone();
        tokio::spawn(async move { b.ensure_instance_lease().await })
    });
    for outcome in futures::future::join_all(ensured).await {
        outcome.unwrap().unwrap();
    }
    let renewals = counts.count(Operation::Put);
    assert_eq!(renewals, 1, "one renewal for twenty starts");
    let lease = b.instance_lease();
    assert!(lease.vouches_for(lease.era()));
}
