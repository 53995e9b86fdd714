//! Admission: an instance never commits more memory to sandboxes than it
//! has (docs/security.md). Every sandbox that starts here (a create, a fork, an
//! attach that restores here, a `POST /execute`) is admitted first, which
//! claims its memory limit in the instance's ledger until it runs (then its
//! hold counts it) or, for `/execute`, until it is destroyed.
//!
//! When one more does not fit, room is made in this order (decision 20):
//! 1. the warm pool shrinks (it only ever uses memory nothing else claims,
//!    and grows back into free room by itself);
//! 2. the least recently used idle sandboxes held here (no client attached,
//!    no execution running, created with checkpoints) are asked to leave by
//!    the intent an operator's `sandboxctl evict` writes, `desired_state:
//!    checkpointed`: the reconcile loop checkpoints and releases them, and
//!    they restore on their next attach, here or elsewhere;
//! 3. the admission waits, a bounded time, for them to go;
//! 4. and only if that cannot or did not make room, it is refused with
//!    [`AtCapacity`], whose message names the capacity.
//!
//! The arithmetic is `ledger`'s (pure, unit-tested); what is held here and
//! how to evict comes through [`Residents`] (the controller and the
//! sessions in production, a fake in the unit tests), the warm pool through
//! [`WarmPoolControl`]. Only intents are written, as everywhere in the API
//! layer.

pub mod capacity;
pub mod ledger;
mod residents;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use controllers::api::SandboxId;
use controllers::clock::Clock;
use controllers::runtime::WarmPoolStats;

pub use ledger::{Candidate, Ledger, Plan, PoolUsage, Usage};
pub use residents::LocalResidents;

/// The most memory the server's own buffers for one sandbox held here can
/// pin, each at its bound, with replies budgeted `reply_budget_bytes`: the
/// client's message being read (`MAX_MESSAGE_BYTES`), its frames queued for
/// the session (`QUEUED_BYTES`), the replies it has not read, the output of
/// its execution queued by the agent's reader (`MAX_QUEUED_OUTPUT_BYTES`)
/// and kept for replay (`MAX_BUFFERED_BYTES`), the commands queued for the
/// agent (`MAX_QUEUED_COMMAND_BYTES`) and one agent message's raw bytes
/// (`MAX_AGENT_PAYLOAD_BYTES`). A sandbox runs one execution at a time and
/// has one attached session, so its tenant can fill each of them once.
/// Admission counts it with each sandbox's memory: the reserve alone would
/// cover a few sandboxes' buffers, not a full instance's.
pub fn session_buffer_bytes(reply_budget_bytes: usize) -> u64 {
    use crate::api::output::MAX_BUFFERED_BYTES;
    use crate::api::protocol::MAX_MESSAGE_BYTES;
    use crate::api::session::QUEUED_BYTES;
    use crate::runtime::agent::{
        MAX_AGENT_PAYLOAD_BYTES, MAX_QUEUED_COMMAND_BYTES, MAX_QUEUED_OUTPUT_BYTES,
    };
    [
        MAX_MESSAGE_BYTES,
        QUEUED_BYTES,
        reply_budget_bytes,
        MAX_QUEUED_OUTPUT_BYTES,
        MAX_BUFFERED_BYTES,
        MAX_QUEUED_COMMAND_BYTES,
        MAX_AGENT_PAYLOAD_BYTES,
    ]
    .into_iter()
    .map(|bytes| bytes as u64)
    .sum()
}

/// How often a waiting admission looks again.
const POLL: Duration = Duration::from_millis(50);
/// How long a start that nothing could make room for still looks for
/// sandboxes leaving on their own before it is refused.
const LEAVING_GRACE: Duration = Duration::from_secs(2);
/// How often the warm pool's size is fitted to the free room.
const POOL_GOVERNOR_EVERY: Duration = Duration::from_secs(1);

/// Admission's settings (`--memory-capacity-mb`, `--memory-reserve-mb`,
/// `--sandbox-memory-mb`, `--admission-wait-s`, `--warm-pool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionSettings {
    /// What sandboxes and the warm pool may commit in all: the instance's
    /// memory minus the server's reserve.
    pub capacity_bytes: u64,
    /// What each sandbox commits: its memory limit.
    pub sandbox_bytes: u64,
    /// How long an admission waits for evicted sandboxes to leave.
    pub wait: Duration,
    /// The warm pool's configured size: the most it grows back to.
    pub warm_pool: usize,
}

/// The sandboxes held here, as admission needs them.
#[async_trait]
pub trait Residents: Send + Sync + fmt::Debug {
    /// Every sandbox this instance holds.
    fn held(&self) -> Vec<SandboxId>;
    /// The held sandboxes as eviction sees them.
    fn candidates(&self) -> Vec<Candidate>;
    /// Asks `sandbox` to checkpoint and leave (an intent; it leaves later).
    async fn evict(&self, sandbox: &SandboxId) -> Result<(), String>;
}

/// The warm pool, as admission sizes it (the server plugs the gVisor
/// runtime's in).
pub trait WarmPoolControl: Send + Sync + fmt::Debug {
    fn stats(&self) -> WarmPoolStats;
    fn resize(&self, size: usize);
}

/// A refusal: one more sandbox does not fit and no room could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this instance is at capacity: {committed_mib} MiB of its {capacity_mib} MiB of sandbox memory \
     are committed and a sandbox needs {sandbox_mib} MiB; {why}. Try again later or on another \
     instance"
)]
pub struct AtCapacity {
    pub capacity_mib: u64,
    pub committed_mib: u64,
    pub sandbox_mib: u64,
    pub why: &'static str,
}

/// Why no room was made.
const NOTHING_IDLE: &str = "no idle sandbox with checkpoints is held here to make room (the others are attached or running)";
const NOT_IN_TIME: &str = "the idle sandboxes asked to make room did not leave in time";

/// What the ledger says now (`/readyz`, `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headroom {
    pub capacity_bytes: u64,
    pub committed_bytes: u64,
    pub free_bytes: u64,
    pub sandbox_bytes: u64,
    /// Sandboxes committed (held, starting, one-shot).
    pub sandboxes: usize,
    pub warm_pool_bytes: u64,
    /// Sandboxes asked to leave to make room, not gone yet.
    pub evicting: usize,
    /// Admissions refused and sandboxes evicted, since start.
    pub refusals: u64,
    pub evictions: u64,
}

/// One instance's admission.
#[derive(Debug)]
pub struct Admission {
    ledger: Ledger,
    wait: Duration,
    warm_pool: usize,
    residents: Arc<dyn Residents>,
    pool: Option<Arc<dyn WarmPoolControl>>,
    state: Mutex<State>,
    refusals: AtomicU64,
    evictions: AtomicU64,
    /// What one warm sandbox used when last measured (sizes an empty pool).
    warm_measured: AtomicU64,
    /// The instance's clock (an admission's wait runs on it).
    clock: Arc<dyn Clock>,
}

#[derive(Debug, Default)]
struct State {
    /// Admitted sandboxes not (yet) counted by a hold, with how many claims.
    claims: HashMap<SandboxId, usize>,
    /// Asked to leave for an admission and still held.
    evicting: HashSet<SandboxId>,
}

/// One admitted sandbox's claim on the ledger, released when dropped (once
/// the sandbox runs and its hold counts it, or when it failed to start or,
/// for a one-shot sandbox, was destroyed).
#[derive(Debug)]
pub struct Claim {
    admission: Weak<Admission>,
    sandbox: SandboxId,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(admission) = self.admission.upgrade() {
            let mut state = admission.state();
            if let Some(count) = state.claims.get_mut(&self.sandbox) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    state.claims.remove(&self.sandbox);
                }
            }
        }
    }
}

/// One pass of an admission.
enum Step {
    Admitted(Claim),
    Evict(Vec<SandboxId>),
    Wait,
    Refused(AtCapacity),
}

impl Admission {
    pub fn new(
        settings: AdmissionSettings,
        residents: Arc<dyn Residents>,
        pool: Option<Arc<dyn WarmPoolControl>>,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        Arc::new(Self {
            ledger: Ledger {
                capacity: settings.capacity_bytes,
                sandbox: settings.sandbox_bytes,
            },
            wait: settings.wait,
            warm_pool: settings.warm_pool,
            residents,
            pool,
            state: Mutex::default(),
            refusals: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            warm_measured: AtomicU64::new(0),
            clock,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits `sandbox` (about to start here), making room if it must:
    /// the warm pool first, then idle sandboxes; refuses when no room can
    /// be made within the configured wait.
    pub async fn admit(self: &Arc<Self>, sandbox: &SandboxId) -> Result<Claim, AtCapacity> {
        let started = self.clock.instant();
        let deadline = started + self.wait;
        let mut tried = HashSet::new();
        loop {
            match self.step(sandbox, &tried) {
                Step::Admitted(claim) => return Ok(claim),
                // Sandboxes may be leaving on their own (a kill, an idle
                // timeout, a handoff): look again for a moment first.
                Step::Refused(_)
                    if self.clock.instant().saturating_duration_since(started)
                        < LEAVING_GRACE.min(self.wait) => {}
                Step::Refused(refusal) => {
                    self.refusals.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%sandbox, %refusal, "admission refused");
                    return Err(refusal);
                }
                Step::Evict(victims) => {
                    for victim in victims {
                        tried.insert(victim.clone());
                        self.evict(&victim, sandbox).await;
                    }
                }
                Step::Wait => {}
            }
            if self.clock.instant() >= deadline {
                let refusal = self.refusal(NOT_IN_TIME);
                self.refusals.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%sandbox, %refusal, "admission refused");
                return Err(refusal);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// One look at the ledger: admit, pick sandboxes to evict, wait or refuse.
    fn step(self: &Arc<Self>, sandbox: &SandboxId, tried: &HashSet<SandboxId>) -> Step {
        let mut state = self.state();
        let (usage, held) = self.usage(&mut state);
        let candidates: Vec<Candidate> = self
            .residents
            .candidates()
            .into_iter()
            .filter(|c| {
                held.contains(&c.id)
                    && !state.evicting.contains(&c.id)
                    && !state.claims.contains_key(&c.id)
                    && !tried.contains(&c.id)
            })
            .collect();
        let evictable = candidates.iter().filter(|c| c.evictable()).count();
        match self.ledger.plan(&usage, evictable) {
            Plan::Admit { pool_keep } => {
                if let (Some(keep), Some(pool)) = (pool_keep, &self.pool) {
                    tracing::info!(%sandbox, keep, "memory pressure: shrinking the warm pool");
                    pool.resize(keep);
                }
                *state.claims.entry(sandbox.clone()).or_insert(0) += 1;
                Step::Admitted(Claim {
                    admission: Arc::downgrade(self),
                    sandbox: sandbox.clone(),
                })
            }
            Plan::Evict { count, empty_pool } => {
                self.empty_pool(empty_pool);
                let victims = ledger::least_recently_used(&candidates, count);
                state.evicting.extend(victims.iter().cloned());
                Step::Evict(victims)
            }
            Plan::Wait { empty_pool } => {
                self.empty_pool(empty_pool);
                Step::Wait
            }
            Plan::Refuse => {
                // Nothing could be freed: the pool keeps its sandboxes.
                let why = if evictable == 0 {
                    NOTHING_IDLE
                } else {
                    "the idle sandboxes held here would not free enough"
                };
                Step::Refused(self.refusal_from(&usage, why))
            }
        }
    }

    fn empty_pool(&self, empty: bool) {
        if let (true, Some(pool)) = (empty, &self.pool) {
            tracing::info!("memory pressure: emptying the warm pool");
            pool.resize(0);
        }
    }

    /// Writes the eviction intent; a failure lets the next pass pick another.
    async fn evict(&self, victim: &SandboxId, for_sandbox: &SandboxId) {
        tracing::info!(sandbox = %victim, for_sandbox = %for_sandbox, "memory pressure: evicting the least recently used idle sandbox");
        match self.residents.evict(victim).await {
            Ok(()) => {
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => {
                tracing::warn!(sandbox = %victim, %err, "cannot evict a sandbox to make room");
                self.state().evicting.remove(victim);
            }
        }
    }

    /// The ledger now; forgets evictions that completed.
    fn usage(&self, state: &mut State) -> (Usage, HashSet<SandboxId>) {
        let held: HashSet<SandboxId> = self.residents.held().into_iter().collect();
        state.evicting.retain(|id| held.contains(id));
        let sandboxes = held
            .len()
            .saturating_add(state.claims.keys().filter(|id| !held.contains(*id)).count());
        let pool = self.pool.as_ref().map_or_else(PoolUsage::default, |pool| {
            let stats = pool.stats();
            if stats.ready > 0 && stats.memory_bytes > 0 {
                self.warm_measured
                    .store(stats.memory_bytes / stats.ready as u64, Ordering::Relaxed);
            }
            PoolUsage {
                ready: stats.ready,
                bytes: stats.memory_bytes,
                measured_each: self.warm_measured.load(Ordering::Relaxed),
                booting: stats.target.saturating_sub(stats.ready),
            }
        });
        let usage = Usage {
            sandboxes,
            pool,
            evicting: state.evicting.len(),
        };
        (usage, held)
    }

    fn refusal(&self, why: &'static str) -> AtCapacity {
        let (usage, _) = self.usage(&mut self.state());
        self.refusal_from(&usage, why)
    }

    fn refusal_from(&self, usage: &Usage, why: &'static str) -> AtCapacity {
        AtCapacity {
            capacity_mib: self.ledger.capacity >> 20,
            committed_mib: self.ledger.committed(usage) >> 20,
            sandbox_mib: self.ledger.sandbox >> 20,
            why,
        }
    }

    /// Capacity, commitments and what is left.
    pub fn headroom(&self) -> Headroom {
        let (usage, _) = self.usage(&mut self.state());
        let committed = self.ledger.committed(&usage);
        Headroom {
            capacity_bytes: self.ledger.capacity,
            committed_bytes: committed,
            free_bytes: self.ledger.capacity.saturating_sub(committed),
            sandbox_bytes: self.ledger.sandbox,
            sandboxes: usage.sandboxes,
            warm_pool_bytes: usage.pool.committed(),
            evicting: usage.evicting,
            refusals: self.refusals.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    /// Fits the warm pool to the room sandboxes leave (at most its
    /// configured size; none while sandboxes are being evicted).
    pub fn fit_warm_pool(&self) {
        let Some(pool) = &self.pool else { return };
        let mut state = self.state();
        let (usage, _) = self.usage(&mut state);
        let room = if usage.evicting > 0 {
            0
        } else {
            self.ledger.pool_room(usage.sandboxes, &usage.pool)
        };
        let target = room.min(self.warm_pool);
        if pool.stats().target != target {
            tracing::debug!(target, "fitting the warm pool to the free memory");
            pool.resize(target);
        }
    }

    /// Fits the warm pool every second while the admission lives.
    pub fn spawn_pool_governor(self: &Arc<Self>) {
        if self.pool.is_none() {
            return;
        }
        let admission = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(POOL_GOVERNOR_EVERY).await;
                let Some(admission) = admission.upgrade() else {
                    return;
                };
                admission.fit_warm_pool();
            }
        });
    }
}

#[cfg(test)]
mod tests;
