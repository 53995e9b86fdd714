//! Lease behaviour on the in-memory store with manual clocks.

use std::sync::Arc;

use chrono::{Duration, TimeZone, Utc};

use super::*;
use crate::api::decode;
use crate::layout::doorbell_key;
use crate::store::{CountingStore, Operation, OperationCounts, PutMode};
use crate::testing::{Fault, ManualClock, MemoryStore};

fn sandbox() -> SandboxId {
    SandboxId::parse("0123456789abcdef0123456789abcdef").unwrap()
}

fn instance(name: &str) -> InstanceId {
    InstanceId::parse(name).unwrap()
}

/// Asserts that `$value` matches `$pattern` (and its guard), showing it if not.
macro_rules! assert_matches {
    ($value:expr, $pattern:pat $(if $guard:expr)?) => {
        match $value {
            $pattern $(if $guard)? => {}
            other => panic!("expected {}, got {other:?}", stringify!($pattern)),
        }
    };
}

fn store_and_clock() -> (Arc<MemoryStore>, ManualClock) {
    (Arc::new(MemoryStore::new()), ManualClock::new())
}

/// Leases of the instances `names` on one empty store, that store, its clock.
fn leases_on_one_store<const N: usize>(
    names: [&str; N],
) -> (Arc<MemoryStore>, ManualClock, [Leases; N]) {
    let (store, clock) = store_and_clock();
    let leases = names.map(|name| leases(store.clone(), &clock, name, 0));
    (store, clock, leases)
}

/// A memory store, its operation counts, and the counted view of it.
fn counted_store() -> (Arc<MemoryStore>, Arc<OperationCounts>, Arc<dyn Store>) {
    let memory = Arc::new(MemoryStore::new());
    let counts = Arc::new(OperationCounts::default());
    let store: Arc<dyn Store> = Arc::new(CountingStore::new(memory.clone(), counts.clone()));
    (memory, counts, store)
}

/// The reads and writes `counts` saw while `run` ran: what a ring cost.
async fn reads_and_writes_of(
    counts: &OperationCounts,
    run: impl Future<Output = ()>,
) -> (u64, u64) {
    let (reads, writes) = (counts.count(Operation::Get), counts.count(Operation::Put));
    run.await;
    (
        counts.count(Operation::Get) - reads,
        counts.count(Operation::Put) - writes,
    )
}

impl LeaseConfig {
    /// The lease settings of these tests and the reconciler's.
    pub(crate) fn for_tests() -> Self {
        Self {
            duration: Duration::seconds(30),
            skew_tolerance: Duration::seconds(5),
            intent_ttl: Duration::seconds(60),
            ring_spacing: std::time::Duration::ZERO,
        }
    }
}

/// `name`'s leases ([`LeaseConfig::for_tests`]) writing a doorbell at most once per `spacing_ms`.
fn leases(store: Arc<dyn Store>, clock: &ManualClock, name: &str, spacing_ms: u64) -> Leases {
    let config = LeaseConfig {
        ring_spacing: std::time::Duration::from_millis(spacing_ms),
        ..LeaseConfig::for_tests()
    };
    let clock = Arc::new(clock.clone());
    let mut leases = Leases::new(store, clock, instance(name), config);
    leases.keep_rung_in(Arc::new(Heard::default()));
    leases
}

/// Keeps the intents rings carry (in the server, a reconciler's slots).
#[derive(Debug, Default)]
struct Heard(std::sync::Mutex<std::collections::HashMap<SandboxId, RungIntent>>);

impl RungIntents for Heard {
    fn rung(&self, sandbox: &SandboxId) -> Option<RungIntent> {
        self.0.lock().unwrap().get(sandbox).cloned()
    }

    fn change_rung(
        &self,
        sandbox: &SandboxId,
        change: &mut dyn FnMut(Option<RungIntent>) -> Option<RungIntent>,
    ) {
        let mut heard = self.0.lock().unwrap();
        if let Some(rung) = change(heard.remove(sandbox)) {
            heard.insert(sandbox.clone(), rung);
        }
    }

    fn forget_expired(&self, now: chrono::DateTime<chrono::Utc>) {
        let mut heard = self.0.lock().unwrap();
        heard.retain(|_, rung| rung.intent.expires_at > now);
    }
}

async fn stored_lease(store: &MemoryStore) -> Lease {
    decode(&store.get(&lock_key(&sandbox())).await.unwrap().data).unwrap()
}

async fn intent_in(store: &MemoryStore) -> Option<InstanceId> {
    stored_lease(store)
        .await
        .wanted_by
        .map(|intent| intent.instance)
}

/// Checks that `holder`'s doorbell has a ring for each of `sandboxes`.
pub(crate) async fn assert_rung(store: &MemoryStore, holder: &InstanceId, sandboxes: &[SandboxId]) {
    let bell: crate::api::Doorbell =
        decode(&store.get(&doorbell_key(holder)).await.unwrap().data).unwrap();
    for sandbox in sandboxes {
        let rung = bell.rings.iter().any(|ring| &ring.sandbox == sandbox);
        assert!(rung, "{sandbox} was rung");
    }
}

#[tokio::test]
async fn first_acquire_creates_the_lease_at_epoch_one() {
    let (store, clock, [a]) = leases_on_one_store(["a"]);
    let held = a.acquire(&sandbox()).await.unwrap();
    assert_eq!(held.epoch, 1);
    let lease = stored_lease(&store).await;
    assert_eq!(lease.holder, Some(instance("a")));
    assert_eq!(lease.renewed_at, Some(clock.now()));
    // Acquiring again keeps the epoch and renews the lease.
    clock.advance(Duration::seconds(10));
    assert_eq!(a.acquire(&sandbox()).await.unwrap().epoch, 1);
    assert_eq!(stored_lease(&store).await.renewed_at, Some(clock.now()));
}

#[tokio::test]
async fn a_held_lease_refuses_others_until_it_expires() {
    let (store, clock, [a, b]) = leases_on_one_store(["a", "b"]);
    let held_a = a.acquire(&sandbox()).await.unwrap();

    let err = b.acquire(&sandbox()).await;
    assert_matches!(err, Err(LeaseError::HeldByOther { holder, .. }) if holder == instance("a"));

    // Renewing moves the expiry.
    clock.advance(Duration::seconds(20));
    let held_a = a.renew(&held_a).await.unwrap();
    clock.advance(Duration::seconds(20));
    let refused = b.acquire(&sandbox()).await;
    assert_matches!(refused, Err(LeaseError::HeldByOther { .. })); // renewed 20 s ago, lease 30 s

    // Expiry alone is not enough: the skew tolerance must pass too.
    clock.advance(Duration::seconds(12)); // 32 s after the renewal
    let refused = b.acquire(&sandbox()).await;
    assert_matches!(refused, Err(LeaseError::HeldByOther { .. }));
    clock.advance(Duration::seconds(3)); // 35 s: expired + 5 s tolerance
    let held_b = b.acquire(&sandbox()).await.unwrap();
    assert_eq!(held_b.epoch, held_a.epoch + 1);

    // The old holder finds out it lost the lease and cannot write it.
    let lost = a.renew(&held_a).await;
    assert_matches!(lost, Err(LeaseError::Lost { current_epoch, .. }) if current_epoch == 2);
    assert_matches!(a.release(&held_a).await, Err(LeaseError::Lost { .. }));
    assert_eq!(stored_lease(&store).await.holder, Some(instance("b")));
}

#[tokio::test]
async fn release_clears_the_holder_and_keeps_the_object_and_epoch() {
    let (store, _, [a, b]) = leases_on_one_store(["a", "b"]);
    let held = a.acquire(&sandbox()).await.unwrap();
    a.release(&held).await.unwrap();
    let lease = stored_lease(&store).await;
    assert_eq!(lease.holder, None);
    assert_eq!(lease.epoch, 1);
    // No holder at the hold's own epoch (an operator cleared it): lost.
    let lost = a.renew(&held).await;
    assert_matches!(lost, Err(LeaseError::Lost { holder: None, .. }));
    // Free at once, no expiry wait.
    assert_eq!(b.acquire(&sandbox()).await.unwrap().epoch, 2);
}

#[tokio::test]
async fn an_attach_intent_reserves_the_sandbox_for_the_asking_instance() {
    let (store, clock, [a, b, c]) = leases_on_one_store(["a", "b", "c"]);
    let held = a.acquire(&sandbox()).await.unwrap();

    let intent = b.request_attach(&sandbox()).await.unwrap();
    assert_eq!(intent.expires_at, clock.now() + Duration::seconds(60));
    // The holder renews: the intent survives its writes.
    let held = a.renew(&held).await.unwrap();
    assert_eq!(intent_in(&store).await, Some(instance("b")));

    a.release(&held).await.unwrap();
    let refused = c.acquire(&sandbox()).await;
    assert_matches!(refused, Err(LeaseError::WantedByOther { .. }));
    let held_b = b.acquire(&sandbox()).await.unwrap();
    assert_eq!(held_b.epoch, 2);
    assert_eq!(intent_in(&store).await, None, "fulfilled intent is cleared");
}

#[tokio::test]
async fn an_intent_is_withdrawn_only_by_its_instance_and_a_stale_one_stops_blocking() {
    let (store, clock, [b, c]) = leases_on_one_store(["b", "c"]);
    b.request_attach(&sandbox()).await.unwrap();
    c.withdraw_attach(&sandbox()).await.unwrap();
    assert_eq!(intent_in(&store).await, Some(instance("b")));
    b.withdraw_attach(&sandbox()).await.unwrap();
    assert_eq!(intent_in(&store).await, None);
    b.request_attach(&sandbox()).await.unwrap();
    let refused = c.acquire(&sandbox()).await;
    assert_matches!(refused, Err(LeaseError::WantedByOther { .. }));
    clock.advance(Duration::seconds(61));
    assert_eq!(c.acquire(&sandbox()).await.unwrap().epoch, 1);
    assert_eq!(intent_in(&store).await, None, "expired intent is cleared");
}

#[tokio::test]
async fn instances_whose_clocks_disagree_by_three_seconds_never_overlap() {
    let (store, clock_a) = store_and_clock();
    let clock_b = clock_a.skewed(Duration::seconds(3)); // B runs 3 s ahead
    let a = leases(store.clone(), &clock_a, "a", 0);
    let b = leases(store.clone(), &clock_b, "b", 0);
    let advance = |secs| {
        clock_a.advance(Duration::seconds(secs));
        clock_b.advance(Duration::seconds(secs));
    };

    let mut held = a.acquire(&sandbox()).await.unwrap();
    // A renews every 10 s (a third of the lease): B never sees it expire.
    for _ in 0..6 {
        advance(10);
        assert!(a.is_safe(&held));
        let refused = b.acquire(&sandbox()).await;
        assert_matches!(refused, Err(LeaseError::HeldByOther { .. }));
        held = a.renew(&held).await.unwrap();
    }

    // A stops renewing: unsafe by its clock after 25 s, before any takeover.
    advance(26);
    assert!(!a.is_safe(&held));
    // B sees it 3 s early, held off until A's +32 (30 - 3 + 5) by the skew.
    let refused = b.acquire(&sandbox()).await;
    assert_matches!(refused, Err(LeaseError::HeldByOther { .. }));
    advance(5); // A's +31
    let refused = b.acquire(&sandbox()).await;
    assert_matches!(refused, Err(LeaseError::HeldByOther { .. }));
    advance(1); // A's +32
    let held_b = b.acquire(&sandbox()).await.unwrap();
    assert_eq!(held_b.epoch, 2);

    // A's clock running behind cannot revive its claim.
    assert!(matches!(a.renew(&held).await, Err(LeaseError::Lost { .. })));
}

#[tokio::test]
async fn an_invalid_lock_is_reported_by_field_and_never_overwritten() {
    let (store, _, [a]) = leases_on_one_store(["a"]);
    let text = "{\n  \"apiVersion\": \"sandboxd.dev/v1\",\n  \"holder\": null,\n  \"epoch\": \"three\",\n  \"lease_duration_s\": 30\n}\n";
    let key = lock_key(&sandbox());
    store.put(&key, text.into(), PutMode::Create).await.unwrap();
    let err = a.acquire(&sandbox()).await.unwrap_err();
    assert_matches!(&err, LeaseError::Invalid { source, .. } if source.field() == Some("epoch"));
    assert!(err.to_string().contains("epoch"), "{err}");
    assert_eq!(store.get(&key).await.unwrap().data, text);
}

#[tokio::test]
async fn of_ten_concurrent_acquirers_exactly_one_wins() {
    let (store, clock) = store_and_clock();
    let attempts = (0..10).map(|i| {
        let leases = leases(store.clone(), &clock, &format!("i{i}"), 0);
        tokio::spawn(async move { leases.acquire(&sandbox()).await })
    });
    let results = futures::future::join_all(attempts).await;
    let winners = results.iter().filter(|r| matches!(r, Ok(Ok(_)))).count();
    assert_eq!(winners, 1);
    assert_eq!(stored_lease(&store).await.epoch, 1);
}

#[tokio::test]
async fn an_acquire_whose_response_was_lost_is_recognised_on_retry() {
    let (store, _, [a]) = leases_on_one_store(["a"]);
    // The read succeeds, the write lands but its response is lost.
    store.inject([Fault::Pass, Fault::LostResponse]);
    let err = a.acquire(&sandbox()).await;
    assert_matches!(err, Err(LeaseError::Store(ref e)) if e.is_transient());
    let held = a.acquire(&sandbox()).await.unwrap();
    let once = "the retry sees its own earlier write, no second epoch";
    assert_eq!(held.epoch, 1, "{once}");
}

/// A mass reconnect (30 rings to one holder in a second) is coalesced: at
/// most one doorbell write per `ring_spacing` plus the first, naming all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_rings_to_one_holder_is_coalesced_under_the_write_rate() {
    let (memory, counts, store) = counted_store();
    let ringer = leases(store, &ManualClock::new(), "b", 300);
    let sandboxes: Vec<SandboxId> = (0..30u128).map(SandboxId::from_u128).collect();
    #[allow(clippy::disallowed_methods, reason = "the test measures its own run")]
    let started = std::time::Instant::now();
    let rings = sandboxes.iter().cloned().map(|sandbox| {
        let rings = ringer.instance_lease().clone();
        tokio::spawn(async move { rings.ring(&instance("a"), &sandbox, None).await })
    });
    for ring in futures::future::join_all(rings).await {
        ring.unwrap().unwrap();
    }
    let writes = counts.count(Operation::Put);
    let coalesced = (1..=3).contains(&writes);
    assert!(coalesced, "30 rings: {writes} doorbell writes");
    let answered = started.elapsed() < std::time::Duration::from_secs(2);
    assert!(answered, "every ringer was answered within the spacing");
    assert_rung(&memory, &instance("a"), &sandboxes).await;
}

/// A ringer's next ring to a holder is one write from its own copy, no read;
/// another's ring in between fails its precondition: it reads, keeps both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ring_to_one_holder_is_one_write_and_keeps_other_rings() {
    let (memory, counts, store) = counted_store();
    let clock = ManualClock::new();
    let ringer = leases(store, &clock, "b", 0);
    let (rings, holder) = (ringer.instance_lease(), instance("a"));
    let [first, second, third, other] = [1u128, 2, 3, 4].map(SandboxId::from_u128);
    // Another instance's ring to the same holder.
    let ring_by_c = || ring_doorbell(memory.as_ref(), clock.now(), &holder, &other, "c");
    rings.ring(&holder, &first, None).await.unwrap();
    let second_ring = async { rings.ring(&holder, &second, None).await.unwrap() };
    let cost = reads_and_writes_of(&counts, second_ring).await;
    assert_eq!(cost, (0, 1), "a second ring is one write, no read");
    // C's ring makes the remembered doorbell stale; it must not be dropped.
    ring_by_c().await.unwrap();
    rings.ring(&holder, &third, None).await.unwrap();
    let all = [first.clone(), second, third, other.clone()];
    assert_rung(&memory, &holder, &all).await;
    // Found stale once, the ringer reads first for a while: rings in turn
    // with another ringer would otherwise cost a refused write each.
    let ring_in_turn = async {
        ring_by_c().await.unwrap();
        rings.ring(&holder, &first, None).await.unwrap();
    };
    let cost = reads_and_writes_of(&counts, ring_in_turn).await;
    assert_eq!(cost, (1, 1), "a read and one write, no refused write");
}

/// Two ringers in a burst: a batch that waited for the spacing reads first,
/// not writing its own stale copy (a refused write spends the write rate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_burst_reads_first_and_no_write_is_refused() {
    let (memory, counts, store) = counted_store();
    let clock = ManualClock::new();
    let [b, c] = ["b", "c"].map(|name| leases(store.clone(), &clock, name, 200));
    let (b, c) = (b.instance_lease(), c.instance_lease());
    let [first, second, third] = [1u128, 2, 3].map(SandboxId::from_u128);
    let holder = instance("a");
    b.ring(&holder, &first, None).await.unwrap();
    c.ring(&holder, &second, None).await.unwrap();
    let writes = counts.count(Operation::Put);
    assert_eq!(writes, 2, "each first ring is one write");
    // B again within its spacing: a batch of the burst.
    b.ring(&holder, &third, None).await.unwrap();
    let batch = counts.count(Operation::Put) - writes;
    let once = "the batch was written once, not refused and written again";
    assert_eq!(batch, 1, "{once}");
    assert_rung(&memory, &holder, &[first, second, third]).await;
}

/// A hand-back is one write: the hold to the live intent, with the checkpoint it took over at the
/// new epoch. A later acquisition that read `status` names the newer of its latest and the lock's
/// (the manifest dropped if it no longer describes it); one that read nothing (a tombstone's) names
/// nothing, and the field stops counting.
#[tokio::test]
async fn a_hand_back_transfers_hold_and_checkpoint_and_a_new_hold_names_what_it_took_over() {
    let (store, clock, [a, b]) = leases_on_one_store(["a", "b"]);
    let held = a.acquire(&sandbox()).await.unwrap();
    b.request_attach(&sandbox()).await.unwrap();
    let read = a.read(&sandbox()).await.unwrap();
    let (manifest, reference) = handed_checkpoint(&clock);
    let lease = handed_to_b(&a, &held, read, &store, &clock).await;
    assert_eq!(lease.holder, Some(instance("b")));
    assert_eq!(lease.epoch, 2);
    assert!(lease.wanted_by.is_none());
    assert_eq!(lease.checkpoint.as_ref(), Some(&reference));
    assert_eq!(lease.carried_manifest(), Some(&manifest));
    assert_eq!(lease.checkpoint_taken_over_at, Some(2));
    // The old holder can no longer act on it.
    assert!(matches!(a.renew(&held).await, Err(LeaseError::Lost { .. })));
    // A second hand-back of the same hold is refused: it is not A's.
    let again = a.hand_back(&held, None, &reference, &manifest).await;
    assert!(matches!(again, Err(LeaseError::Lost { .. })));
    let held_b = b.adopt(&sandbox(), &lease, Generation(0)).await.unwrap();
    b.release(&held_b).await.unwrap();

    // `status` recorded a newer one (a periodic checkpoint of B's hold).
    let newer = crate::api::CheckpointRef {
        path: "sandbox_checkpoints/c2/checkpoint.img".into(),
        epoch: 2,
        ..reference.clone()
    };
    let (id, latest) = (sandbox(), Recorded::Latest(Some(&newer)));
    let read = a.read(&id).await.unwrap();
    a.acquire_from(&id, read, latest).await.unwrap();
    let lease = stored_lease(&store).await;
    assert_eq!((lease.epoch, lease.checkpoint_taken_over_at), (3, Some(3)));
    assert_eq!(lease.checkpoint.as_ref(), Some(&newer));
    let manifest = lease.carried_manifest();
    assert_eq!(manifest, None, "the manifest was the older one's");
    // An older one recorded: the lock's stays.
    clock.advance(Duration::seconds(120));
    let older = Recorded::Latest(Some(&reference));
    let read = b.read(&id).await.unwrap();
    b.acquire_from(&id, read, older).await.unwrap();
    let lease = stored_lease(&store).await;
    assert_eq!(lease.checkpoint.as_ref(), Some(&newer));
    assert_eq!(lease.checkpoint_taken_over_at, Some(4));

    clock.advance(Duration::seconds(120));
    a.acquire(&sandbox()).await.unwrap();
    let lease = stored_lease(&store).await;
    assert_eq!((lease.epoch, lease.checkpoint_taken_over_at), (5, Some(4)));
}

#[tokio::test]
async fn a_holder_read_live_is_not_read_again_within_a_second_unless_run_out_gone_is_always_read() {
    let (store, clock, [a, b]) = leases_on_one_store(["a", "b"]);
    a.instance_lease().renew().await.unwrap();
    let watcher = b.instance_lease();

    let before = store.operations();
    // Each row: time passed, then the answer and the reads made so far.
    for (passed_ms, live, reads, why) in [
        (0, true, 1, "the first answer is read"),
        (900, true, 1, "live, read 0.9 s ago: no read"),
        (200, true, 2, "read 1.1 s ago: read again"),
        // 34.5 s after the renewal: live for 0.5 s more (30 s lease, 5 s skew).
        (33_400, true, 3, "read 33.4 s ago: read again"),
        (600, false, 4, "read 0.6 s ago, but expired since: gone"),
        // Past the lease and the skew: found gone, on a read, every time.
        (36_000, false, 5, "gone, read"),
        (0, false, 6, "gone again, read again"),
    ] {
        clock.advance(Duration::milliseconds(passed_ms));
        let answer = watcher.is_live(&instance("a")).await.unwrap();
        assert_eq!(answer, live, "{why}");
        assert_eq!(store.operations(), before + reads, "{why}");
    }
}

/// Hands `held` back from `a` (from `read`), checks B got it; the stored lock.
async fn handed_to_b(
    a: &Leases,
    held: &HeldLease,
    read: Option<ReadLease>,
    store: &MemoryStore,
    clock: &ManualClock,
) -> Lease {
    let (manifest, reference) = handed_checkpoint(clock);
    let outcome = a.hand_back(held, read, &reference, &manifest).await;
    let to_b = HandBack::TransferredTo {
        instance: instance("b"),
        epoch: held.epoch + 1,
    };
    assert_eq!(outcome.unwrap(), to_b);
    stored_lease(store).await
}

/// A checkpoint to hand back with: its manifest and its record.
fn handed_checkpoint(
    clock: &ManualClock,
) -> (crate::api::CheckpointManifest, crate::api::CheckpointRef) {
    let manifest: crate::api::CheckpointManifest = serde_json::from_value(serde_json::json!({
        "apiVersion": "sandboxd.dev/v1", "checkpoint_id": "c1", "sandbox_id": sandbox(),
        "epoch": 1, "created_at": clock.now(), "runsc_version": "x", "platform": "ptrace",
        "image": {"key": "sandbox_checkpoints/c1/checkpoint.img", "size": 3, "sha256": "ab"}
    }))
    .unwrap();
    let reference = serde_json::from_value(serde_json::json!({
        "bucket": "b", "path": manifest.image.key, "epoch": 1, "sha256": "ab", "size": 3,
        "created_at": clock.now()
    }))
    .unwrap();
    (manifest, reference)
}

/// A non-holder's attach sends its intent by ring, not `lock.json` (decision
/// 27): the ringer counts it at once, the holder once its doorbell brings it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_intent_goes_by_ring_and_the_transfer_is_the_locks_next_write() {
    let (store, clock, [a, b]) = leases_on_one_store(["a", "b"]);
    let held = a.acquire(&sandbox()).await.unwrap();
    let before = store.get(&lock_key(&sandbox())).await.unwrap().generation;

    let (id, me) = (sandbox(), instance("a"));
    let read = b.read(&id).await.unwrap();
    let (intent, _) = b.request_attach_writing(&id, read, None).await.unwrap();
    let generation = store.get(&lock_key(&sandbox())).await.unwrap().generation;
    assert_eq!(generation, before, "the lock is not written");
    assert_eq!(stored_lease(&store).await.wanted_by, None);
    let (seen_by_b, _) = b.read(&sandbox()).await.unwrap().unwrap();
    assert!(seen_by_b.wanted_by_me(&instance("b"), clock.now()));

    // The holder's doorbell carries it; until heard, the holder sees none.
    let (bell, _) = a.instance_lease().read_doorbell().await.unwrap().unwrap();
    let ring = bell.rings.iter().find(|ring| ring.sandbox == sandbox());
    let carried = ring.and_then(|ring| ring.intent.clone());
    let rung = carried.expect("the ring carries the intent");
    assert_eq!((rung.epoch, &rung.intent), (held.epoch, &intent));
    let (unheard, _) = a.read(&sandbox()).await.unwrap().unwrap();
    assert!(unheard.wanted_elsewhere(&me, clock.now()).is_none());
    a.hear(&sandbox(), rung.clone());
    let (heard, _) = a.read(&sandbox()).await.unwrap().unwrap();
    let wanted = heard.wanted_elsewhere(&me, clock.now());
    assert_eq!(wanted.map(|intent| &intent.instance), Some(&instance("b")));

    // Heard again on a re-read lock (a failed precondition): still to B.
    let lease = handed_to_b(&a, &held, None, &store, &clock).await;
    assert_eq!(lease.holder, Some(instance("b")));
    assert_eq!(lease.wanted_by, None);
    // Spent: the next hold (epoch + 1) is wanted by nobody, on either side.
    let (after_a, _) = a.read(&sandbox()).await.unwrap().unwrap();
    let (after_b, _) = b.read(&sandbox()).await.unwrap().unwrap();
    assert_eq!((after_a.wanted_by, after_b.wanted_by), (None, None));
}

/// The acquire write's guard, row by row, on the lock as the write finds it.
#[test]
fn the_acquire_guard_takes_only_a_free_or_gone_hold_no_other_instance_wants() {
    use Grant::{HeldByOther, Renew, Take, WantedByOther};
    let (me, other) = (instance("a"), instance("b"));
    let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
    let held_by = |holder: &InstanceId, renewed_secs_ago: i64| Lease {
        holder: Some(holder.clone()),
        epoch: 4,
        renewed_at: Some(now - Duration::seconds(renewed_secs_ago)),
        ..Lease::unheld(15)
    };
    let intent = |instance: &InstanceId, expires_in: i64| AttachIntent {
        instance: instance.clone(),
        requested_at: now,
        expires_at: now + Duration::seconds(expires_in),
        extra: ExtraFields::new(),
    };
    let wanted_by = |lease: Lease, instance: &InstanceId, expires_in: i64| Lease {
        wanted_by: Some(intent(instance, expires_in)),
        ..lease
    };
    let found_gone = (other.clone(), 4);
    let gone = Some(&found_gone);
    let free = Lease::unheld(15);
    let retaken = Lease {
        epoch: 5,
        ..held_by(&other, 60)
    };
    let wanted = wanted_by(free.clone(), &other, 30);
    let gone_but_wanted = wanted_by(held_by(&other, 60), &other, 30);
    let stale_intent = wanted_by(free.clone(), &other, -1);
    let own_intent = wanted_by(free.clone(), &me, 30);
    let wanted_by_other = WantedByOther(intent(&other, 30));
    // Each row: the lock, the hold found gone (if any), the answer, why.
    let rows = [
        (free, None, Take, "never held"),
        (held_by(&me, 60), None, Renew, "ours, even expired"),
        (held_by(&other, 1), None, HeldByOther, "live"),
        (held_by(&other, 60), None, HeldByOther, "not found gone"),
        (held_by(&other, 60), gone, Take, "gone"),
        (held_by(&other, 16), gone, HeldByOther, "within the skew"),
        (held_by(&other, 1), gone, HeldByOther, "renewed since"),
        (retaken, gone, HeldByOther, "a later hold"),
        (wanted, None, wanted_by_other.clone(), "another's intent"),
        (stale_intent, None, Take, "expired intent"),
        (own_intent, None, Take, "our own intent"),
        (gone_but_wanted, gone, wanted_by_other, "gone, but wanted"),
    ];
    for (lock, gone, expected, why) in rows {
        let skew = Duration::seconds(2);
        assert_eq!(grant(&lock, &me, gone, now, skew), expected, "{why}");
    }
}

/// A lock written before the lease lapsed but answered after (a freeze
/// mid-write) isn't vouched for by the new era (a takeover may lie between).
#[tokio::test]
async fn an_era_that_began_after_a_holds_lock_lease_ran_out_does_not_vouch_for_it() {
    let (_store, clock, [a, b]) = leases_on_one_store(["inst-a", "inst-b"]);
    let id = sandbox();
    let held = a.acquire(&id).await.unwrap();
    assert!(a.is_safe(&held));
    let written = held.lease.clone();

    // A freezes past both of its leases; B takes the sandbox over.
    clock.advance(Duration::seconds(40));
    let taken = b.acquire(&id).await.unwrap();
    assert_eq!(taken.epoch, held.epoch + 1);

    // A thaws: renews (a new era), then takes up a pre-freeze write's answer.
    a.instance_lease().renew().await.unwrap();
    let late = a.adopt(&id, &written, held.generation).await.unwrap();
    assert_eq!(late.era, NO_ERA);
    assert!(
        !a.is_safe(&late),
        "a hold written before the lapse was vouched for by the era after it"
    );

    // A hold taken after the lapse outlives its lock's lease (25 s) on renewal.
    let other = SandboxId::parse("fedcba9876543210fedcba9876543210").unwrap();
    let hold = a.acquire(&other).await.unwrap();
    clock.advance(Duration::seconds(20));
    a.instance_lease().renew().await.unwrap();
    clock.advance(Duration::seconds(10));
    let kept = a.is_safe(&hold);
    assert!(kept, "a hold taken after the lapse lost its era");
}
