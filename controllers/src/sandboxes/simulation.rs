//! Deterministic simulation of instances converging the same sandboxes on
//! one in-memory store and manual clock (each instance's clock off by up to
//! ±1 s, within the 2 s tolerance): a seeded schedule of passes, intents,
//! executions, clock jumps past the lease, crashes, pauses (zombie holders),
//! storage faults (transient, lost responses that landed), renewals and
//! doorbell answers (never while paused), and rings lost, duplicated or
//! delayed (to never, leaving it to the resync), and drains (SIGTERM: the
//! instance checkpoints what it holds and starts nothing more). Invariants
//! after each step:
//! 1. never two instances running a sandbox while both can vouch for their
//!    lease (a paused zombie may still run it, its lease expired);
//! 2. `status.epoch` and the latest checkpoint's epoch (`status`'s with
//!    the lock's folded in, as every reader counts it) never go down;
//! 3. until deletion, the latest checkpoint is at least as new as every
//!    acknowledged one and restorable (manifest, image, digest);
//! 4. a draining instance starts nothing: what it runs, it ran or was
//!    starting when its drain began;
//! 5. a state once lost never comes back: what a vouched runner's memory
//!    lacks of what an earlier one had never appears in a later one.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use chrono::Duration;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::broadcast;

use super::tests::hooked_store::{BeforeRequest, HookedStore, Request};
use super::tests::{Instance, TOKEN_HASH};
use super::*;
use crate::api::{CheckpointManifest, DesiredState, Lease, SandboxId, SandboxMetadata, decode};
use crate::clock::Clock;
use crate::layout::{checkpoint_id_of_image, checkpoint_manifest_key, lock_key, metadata_key};
use crate::leasing::LeaseConfig;
use crate::runtime::{Command, ExecRequest, SandboxRuntime};
use crate::store::{Store, StoreError};
use crate::testing::{FakeRuntime, Fault, ManualClock, MemoryStore};

/// A node's store: past a pause's countdown, requests block until it ends.
#[derive(Debug)]
struct Gate {
    /// Requests left before blocking; negative: not pausing.
    countdown: AtomicI64,
    open: tokio::sync::watch::Receiver<bool>,
}

#[async_trait::async_trait]
impl BeforeRequest for Gate {
    async fn before(&self, _: Request<'_>, _: &MemoryStore) -> Result<(), StoreError> {
        let left = self.countdown.load(Ordering::Acquire);
        if left > 0 {
            self.countdown.fetch_sub(1, Ordering::AcqRel);
        } else if left == 0 {
            let mut open = self.open.clone();
            let _ = open.wait_for(|open| *open).await;
        }
        Ok(())
    }
}

const STEPS: usize = 150;
const SANDBOXES: u128 = 2;

struct Node {
    controller: Arc<SandboxController>,
    runtime: FakeRuntime,
    /// Skips its turns until this step (a paused process).
    paused_until: usize,
    progress: Vec<broadcast::Receiver<SandboxEvent>>,
    store: Arc<HookedStore<Gate>>,
    open: tokio::sync::watch::Sender<bool>,
    /// A reconcile pass frozen by the pause, finished when it ends.
    frozen: Option<tokio::task::JoinHandle<()>>,
    /// Draining since SIGTERM: what it ran or was starting then and still runs (nothing else may).
    draining: Option<Vec<SandboxId>>,
}

struct Sim {
    rng: StdRng,
    store: Arc<MemoryStore>,
    clock: ManualClock,
    nodes: Vec<Node>,
    next_name: usize,
    sandboxes: Vec<SandboxId>,
    /// Highest epochs seen per sandbox: (status.epoch, latest_checkpoint.epoch).
    seen: HashMap<SandboxId, (u64, u64)>,
    /// Epoch of the newest acknowledged checkpoint per sandbox.
    acknowledged: HashMap<SandboxId, u64>,
    /// Per sandbox: what vouched runners had in memory and what a later one lacked (lost for good).
    memories: HashMap<SandboxId, (HashSet<String>, HashSet<String>)>,
}

impl Sim {
    fn new(seed: u64) -> Self {
        let mut sim = Self {
            rng: StdRng::seed_from_u64(seed),
            store: Arc::new(MemoryStore::new()),
            clock: ManualClock::new(),
            nodes: Vec::new(),
            next_name: 0,
            sandboxes: (1..=SANDBOXES).map(SandboxId::from_u128).collect(),
            seen: HashMap::new(),
            acknowledged: HashMap::new(),
            memories: HashMap::new(),
        };
        for _ in 0..3 {
            let node = sim.node();
            sim.nodes.push(node);
        }
        sim
    }

    fn node(&mut self) -> Node {
        self.next_name += 1;
        let name = format!("node-{}", self.next_name);
        let skew_ms = self.rng.random_range(-1_000..=1_000);
        let clock: Arc<dyn Clock> = Arc::new(self.clock.offset(Duration::milliseconds(skew_ms)));
        let (open, receiver) = tokio::sync::watch::channel(true);
        let gate = Gate {
            countdown: AtomicI64::new(-1),
            open: receiver,
        };
        let store = Arc::new(HookedStore::new(self.store.clone(), gate));
        let lease = LeaseConfig {
            ring_spacing: std::time::Duration::ZERO,
            ..LeaseConfig::default()
        };
        let config = ReconcilerConfig::default();
        let no_hooks = |_: &FakeRuntime| Arc::new(crate::hooks::NoHooks) as _;
        let node = Instance::build(store.clone(), clock, &name, lease, config, no_hooks);
        let (controller, runtime) = (node.controller, node.runtime);
        let progress = self
            .sandboxes
            .iter()
            .map(|id| controller.subscribe(id))
            .collect();
        Node {
            controller,
            runtime,
            paused_until: 0,
            progress,
            store,
            open,
            frozen: None,
            draining: None,
        }
    }

    async fn setup(&mut self) {
        for id in self.sandboxes.clone() {
            let mut metadata =
                SandboxMetadata::new(id.clone(), self.clock.now(), TOKEN_HASH.into());
            metadata.spec.enable_checkpoint = true;
            metadata.spec.enable_sandbox_handoff = true;
            let node = self.rng.random_range(0..self.nodes.len());
            let controller = &self.nodes[node].controller;
            controller
                .serving(&id, controller.create(&metadata))
                .await
                .unwrap();
        }
    }

    /// Ends the pauses due at `step`: the frozen pass resumes and finishes.
    async fn wake(&mut self, step: usize) {
        for node in &mut self.nodes {
            if node.paused_until <= step {
                node.store.hook.countdown.store(-1, Ordering::Release);
                let _ = node.open.send(true);
                if let Some(frozen) = node.frozen.take() {
                    let _ = frozen.await;
                }
            }
        }
    }

    /// Awake nodes renew their instance lease with `probability` (their loop).
    async fn heartbeats(&mut self, step: usize, probability: f64) {
        for n in 0..self.nodes.len() {
            if self.nodes[n].paused_until <= step && self.rng.random_bool(probability) {
                renew_instance_lease(&self.nodes[n].controller).await;
            }
        }
    }

    async fn step(&mut self, step: usize) {
        self.wake(step).await;
        let node = self.rng.random_range(0..self.nodes.len());
        let awake = self.nodes[node].paused_until <= step;
        let index = self.rng.random_range(0..self.sandboxes.len());
        let id = self.sandboxes[index].clone();
        let controller = Arc::clone(&self.nodes[node].controller);
        match self.rng.random_range(0..100) {
            0..30 if awake => {
                let _ = controller.reconciler().reconcile(&id).await;
            }
            30..35 if awake => {
                renew_instance_lease(&controller).await;
            }
            35..38 if awake => {
                // The doorbell loop: answer, then run the passes it queued.
                if let Ok(rung) = controller.answer_doorbell().await {
                    for rung in rung {
                        let _ = controller.reconciler().reconcile(&rung).await;
                    }
                }
            }
            38..39 => {
                // A ring lost: the doorbell object is gone.
                let instance = controller.reconciler().leases().instance().clone();
                let _ = self
                    .store
                    .delete(&crate::layout::doorbell_key(&instance))
                    .await;
            }
            39..40 => {
                // A ring duplicated: rung again for the same sandbox.
                if let Some(lock) = self.lock(&id).await
                    && let Some(holder) = lock.holder
                {
                    let (store, now) = (self.store.as_ref(), self.clock.now());
                    let _ = crate::leasing::ring_doorbell(store, now, &holder, &id, "sim").await;
                }
            }
            40..52 if awake => {
                let ask = controller.request_here(&id, None, self.clock.now());
                let _ = controller.serving(&id, ask).await;
            }
            roll @ 52..64 if awake => {
                let desired = match roll {
                    52..58 => DesiredState::Checkpointed,
                    58..60 => DesiredState::Deleted,
                    _ => DesiredState::Running,
                };
                let ask = controller.request_state(&id, desired, None);
                let _ = controller.serving(&id, ask).await;
            }
            64..72 if awake => {
                let request = ExecRequest::new(Command::Bash(format!("step {step}")));
                if let Ok(mut execution) = controller.exec(&id, request).await {
                    // An unvouched exit is held back until re-verified or lost.
                    tokio::spawn(async move { while execution.events.recv().await.is_some() {} });
                }
            }
            72..76 if awake => {
                let attached = self.rng.random_bool(0.5);
                controller.client_attached(&id, attached);
            }
            76..84 => {
                self.clock
                    .advance(Duration::milliseconds(self.rng.random_range(0..20_000)));
                // Live instances renewed their lease meanwhile (mostly).
                self.heartbeats(step, 0.8).await;
            }
            84..87 => {
                self.clock
                    .advance(Duration::seconds(self.rng.random_range(30..70)));
                self.heartbeats(step, 0.3).await;
            }
            89..90 if awake && self.nodes[node].draining.is_none() => {
                // A SIGTERM: the drain asks what is held here to checkpoint
                // (served by its later passes) and starts nothing more.
                let reconciler = controller.reconciler();
                let kept = self.sandboxes.iter().filter(|id| {
                    self.nodes[node].runtime.is_running(id) || reconciler.is_starting(id)
                });
                self.nodes[node].draining = Some(kept.cloned().collect());
                let _ = controller.drain(std::time::Duration::ZERO).await;
            }
            87..90 => {
                // A crash: a new process (new instance id) takes its place.
                if let Some(frozen) = self.nodes[node].frozen.take() {
                    frozen.abort();
                }
                let fresh = self.node();
                self.nodes[node] = fresh;
            }
            90..94 if awake => {
                // Freeze the node partway through a pass on `id`.
                let left = self.rng.random_range(0..6);
                let target = &mut self.nodes[node];
                target.paused_until = step + self.rng.random_range(5..40);
                let _ = target.open.send(false);
                target.store.hook.countdown.store(left, Ordering::Release);
                target.frozen = Some(tokio::spawn(async move {
                    let _ = controller.reconciler().reconcile(&id).await;
                }));
                // Let the pass run up to its gate.
                for _ in 0..8 {
                    tokio::task::yield_now().await;
                }
            }
            94..100 => {
                let fault = if self.rng.random_bool(0.5) {
                    Fault::Transient
                } else {
                    Fault::LostResponse
                };
                let skip = self.rng.random_range(0..3);
                self.store
                    .inject(std::iter::repeat_n(Fault::Pass, skip).chain([fault]));
            }
            _ => {}
        }
    }

    async fn check(&mut self, seed: u64, step: usize) {
        let faults = self.store.take_faults();
        self.collect_acknowledgements().await;
        // 4. A draining instance starts nothing.
        for node in &mut self.nodes {
            let Some(kept) = &mut node.draining else {
                continue;
            };
            for id in &self.sandboxes {
                assert!(
                    kept.contains(id) || !node.runtime.is_running(id),
                    "seed {seed} step {step}: {id} started on an instance draining since before"
                );
            }
            let reconciler = node.controller.reconciler();
            kept.retain(|id| node.runtime.is_running(id) || reconciler.is_starting(id));
        }
        for id in self.sandboxes.clone() {
            // 1. One vouching runner at most.
            let vouching = |node: &Node| {
                let reconciler = node.controller.reconciler();
                let safe = |held| reconciler.leases().is_safe(&held);
                node.runtime.is_running(&id) && reconciler.held(&id).is_some_and(safe)
            };
            let runners: Vec<usize> = (0..self.nodes.len())
                .filter(|&n| vouching(&self.nodes[n]))
                .collect();
            assert!(
                runners.len() <= 1,
                "seed {seed} step {step}: {id} runs on {runners:?} with valid leases"
            );
            // 5. A lost state never comes back.
            if let Some(&runner) = runners.first() {
                let memory = self.nodes[runner].runtime.memory(&id).unwrap_or_default();
                let (held, lost) = self.memories.entry(id.clone()).or_default();
                let back: Vec<_> = memory.iter().filter(|e| lost.contains(*e)).collect();
                assert!(
                    back.is_empty(),
                    "seed {seed} step {step}: {id}: {back:?} came back"
                );
                lost.extend(held.iter().filter(|entry| !memory.contains(entry)).cloned());
                held.extend(memory);
            }
            // 2. Epochs never go down.
            let Ok(object) = self.store.get(&metadata_key(&id)).await else {
                continue;
            };
            let metadata: SandboxMetadata = decode(&object.data).unwrap();
            // The latest every reader counts: with the lock's checkpoint folded
            // in (decision 18), a former holder's late record not counted.
            let mut folded = metadata.status.clone();
            if let Some(lock) = self.lock(&id).await {
                record_carried(&mut folded, &lock, usize::MAX);
            }
            let checkpoint_epoch = folded.latest_checkpoint.as_ref().map_or(0, |c| c.epoch);
            let (seen_epoch, seen_checkpoint) = self.seen.get(&id).copied().unwrap_or((0, 0));
            assert!(
                metadata.status.epoch >= seen_epoch,
                "seed {seed} step {step}: {id} status.epoch went from {seen_epoch} to {}",
                metadata.status.epoch
            );
            assert!(
                checkpoint_epoch >= seen_checkpoint,
                "seed {seed} step {step}: {id} checkpoint epoch went from {seen_checkpoint} to {checkpoint_epoch}"
            );
            self.seen
                .insert(id.clone(), (metadata.status.epoch, checkpoint_epoch));
            // 3. Acknowledged checkpoints stay covered and restorable until
            // deletion (a purge removes checkpoints before the metadata).
            if let Some(&acknowledged) = self.acknowledged.get(&id)
                && metadata.status.phase != crate::api::Phase::Deleted
            {
                let Some(latest) = folded.latest_checkpoint.as_ref() else {
                    panic!("seed {seed} step {step}: {id} lost its acknowledged checkpoint")
                };
                assert!(
                    latest.epoch >= acknowledged,
                    "seed {seed} step {step}: {id} points at epoch {} below acknowledged {acknowledged}",
                    latest.epoch
                );
                let manifest = self.manifest(&latest.path).await;
                let scratch = FakeRuntime::new(self.store.clone());
                scratch
                    .restore(&SandboxId::from_u128(u128::MAX), &manifest)
                    .await
                    .unwrap_or_else(|err| {
                        panic!(
                            "seed {seed} step {step}: {id} latest checkpoint unrestorable: {err}"
                        )
                    });
            }
        }
        self.store.inject(faults);
    }

    /// The checkpoints acknowledged since the last call, with their epochs.
    async fn collect_acknowledgements(&mut self) {
        let mut images = Vec::new();
        for node in &mut self.nodes {
            for (index, receiver) in node.progress.iter_mut().enumerate() {
                while let Ok(event) = receiver.try_recv() {
                    if let SandboxEvent::Checkpointed { image } = event {
                        images.push((self.sandboxes[index].clone(), image));
                    }
                }
            }
        }
        for (id, image) in images {
            let manifest = self.manifest(&image).await;
            let epoch = self.acknowledged.entry(id).or_insert(0);
            *epoch = (*epoch).max(manifest.epoch);
        }
    }

    /// The manifest of `image`'s checkpoint; a missing one is itself a failure.
    async fn manifest(&self, image: &str) -> CheckpointManifest {
        let key = checkpoint_manifest_key(&checkpoint_id_of_image(image).unwrap());
        decode(&self.store.get(&key).await.unwrap().data).unwrap()
    }

    async fn lock(&self, id: &SandboxId) -> Option<Lease> {
        let object = self.store.get(&lock_key(id)).await.ok()?;
        decode(&object.data).ok()
    }
}

/// The instance lease loop's renewal: renew, then queue the unvouched.
async fn renew_instance_lease(controller: &SandboxController) {
    let reconciler = controller.reconciler();
    let _ = reconciler.leases().instance_lease().renew().await;
    for unvouched in reconciler.unvouched() {
        controller.enqueue(&unvouched);
    }
}

async fn run_seed(seed: u64) {
    let mut sim = Sim::new(seed);
    sim.setup().await;
    for step in 0..STEPS {
        tracing::debug!(step, "simulation step");
        sim.step(step).await;
        sim.check(seed, step).await;
    }
    // Heal (no faults, all awake, drained ones gone): each sandbox runs in one place or says why.
    sim.store.take_faults();
    for n in 0..sim.nodes.len() {
        if sim.nodes[n].draining.is_some() {
            if let Some(frozen) = sim.nodes[n].frozen.take() {
                frozen.abort();
            }
            sim.nodes[n] = sim.node();
        }
    }
    for node in &mut sim.nodes {
        node.paused_until = 0;
    }
    sim.wake(usize::MAX).await;
    sim.clock.advance(Duration::seconds(120));
    for id in sim.sandboxes.clone() {
        let controller = &sim.nodes[0].controller;
        let ask = controller.request_state(&id, DesiredState::Running, None);
        let _ = controller.serving(&id, ask).await;
        let ask = controller.request_here(&id, None, sim.clock.now());
        let _ = controller.serving(&id, ask).await;
        for _ in 0..6 {
            for node in &sim.nodes {
                let _ = node.controller.reconciler().reconcile(&id).await;
            }
            sim.clock.advance(Duration::seconds(1));
        }
        let running: Vec<usize> = (0..sim.nodes.len())
            .filter(|&n| sim.nodes[n].runtime.is_running(&id))
            .collect();
        assert!(
            running.len() <= 1,
            "seed {seed}: {id} runs on {running:?} after healing"
        );
        let Ok(object) = sim.store.get(&metadata_key(&id)).await else {
            // Deleted, and its tombstone purged after the retention: gone.
            assert!(
                running.is_empty(),
                "seed {seed}: {id} was purged but runs on {running:?}"
            );
            continue;
        };
        let metadata: SandboxMetadata = decode(&object.data).unwrap();
        if running.is_empty() && metadata.status.phase != crate::api::Phase::Deleted {
            assert!(
                metadata.status.last_error.is_some()
                    || metadata.spec.desired_state != DesiredState::Running,
                "seed {seed}: {id} neither runs nor says why: {:?} lock {:?}",
                metadata.status,
                sim.lock(&id).await
            );
        }
    }
}

/// Seeds 0 to 999 (CI's) in four tests, spread over the runner's threads.
mod a_thousand_seeded_schedules_keep_the_invariants {
    use super::run_seed;

    async fn seeds(seeds: std::ops::Range<u64>) {
        for seed in seeds {
            run_seed(seed).await;
        }
    }

    #[tokio::test]
    async fn seeds_0_to_249() {
        seeds(0..250).await;
    }

    #[tokio::test]
    async fn seeds_250_to_499() {
        seeds(250..500).await;
    }

    #[tokio::test]
    async fn seeds_500_to_749() {
        seeds(500..750).await;
    }

    #[tokio::test]
    async fn seeds_750_to_999() {
        seeds(750..1000).await;
    }
}

/// The number in the environment variable `name`, else `default`.
fn env_seed(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[tokio::test]
#[ignore = "soak: SIM_SEEDS=10000 cargo test -p controllers --release --features testing -- --ignored simulation_soak"]
async fn simulation_soak() {
    let seeds = env_seed("SIM_SEEDS", 10_000);
    for seed in 0..seeds {
        run_seed(seed).await;
    }
}

/// One seed, to study a failure: `SIM_SEED=686 RUST_LOG=controllers=debug cargo test -p controllers
/// --features testing --lib one_seed` (seed 0 by default; `RUST_LOG` prints each pass's decision).
#[tokio::test]
async fn one_seed() {
    let seed = env_seed("SIM_SEED", 0);
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    run_seed(seed).await;
}
