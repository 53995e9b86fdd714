//! The capacity ledger's arithmetic, with no state and no I/O: what the
//! sandboxes and the warm pool commit of an instance's memory, what one more
//! sandbox needs, and the order in which room is made for it (the warm pool
//! first, then idle sandboxes, least recently used first).
//!
//! A sandbox commits its memory limit (what runsc lets it reach), not what
//! it uses now: a sandbox that idles at 30 MB may fill its limit with the
//! next cell, and an instance that admitted on use would be OOM-killed then,
//! with every sandbox on it losing what it did since its last checkpoint.
//! A warm sandbox commits what it uses (it never runs user code, so it never
//! grows); a create that takes one commits a full sandbox like any other.

use controllers::api::SandboxId;
use tokio::time::Instant;

/// What a warm sandbox is assumed to use when the pool cannot say (no
/// readable memory cgroup, or an empty pool): 22 MB measured here, rounded up.
pub const WARM_SANDBOX_ESTIMATE: u64 = 64 << 20;

/// An instance's memory as admission sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ledger {
    /// What sandboxes and the warm pool may commit in all: the instance's
    /// memory minus the server's own reserve.
    pub capacity: u64,
    /// What one sandbox commits: its memory limit.
    pub sandbox: u64,
}

/// The warm pool now: how many wait, what they use, and how many its
/// refill is still to boot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolUsage {
    pub ready: usize,
    /// Their memory (0: unknown).
    pub bytes: u64,
    /// What one used when last measured (0: never), for an empty pool.
    pub measured_each: u64,
    /// Below its target: sandboxes the refill boots (one may be booting
    /// now) unless the target is lowered. They are committed already: a
    /// create admitted beside the ready ones alone would be overtaken by
    /// the next boot, and the instance would hold more than its capacity.
    pub booting: usize,
}

impl PoolUsage {
    /// What one warm sandbox uses, measured or estimated; an average is
    /// rounded up, so that many of them never add up to more than counted.
    pub fn per_sandbox(&self) -> u64 {
        match (self.ready, self.bytes, self.measured_each) {
            (0, _, 0) | (_, 0, 0) => WARM_SANDBOX_ESTIMATE,
            (0, _, measured) | (_, 0, measured) => measured,
            (ready, bytes, _) => bytes.div_ceil(ready as u64).max(1),
        }
    }

    /// What the pool commits: the ready ones (estimated where they cannot
    /// be read) and those still to boot.
    pub fn committed(&self) -> u64 {
        let ready = if self.bytes > 0 {
            self.bytes
        } else {
            (self.ready as u64).saturating_mul(WARM_SANDBOX_ESTIMATE)
        };
        ready.saturating_add((self.booting as u64).saturating_mul(self.per_sandbox()))
    }
}

/// What an admission finds on the instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Sandboxes committed: held here, starting here (admitted, not running
    /// yet) and `POST /execute`'s one-shot ones.
    pub sandboxes: usize,
    pub pool: PoolUsage,
    /// Sandboxes asked to checkpoint and leave for an admission, still here.
    pub evicting: usize,
}

/// What to do about one more sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// It fits: admit it (after shrinking the pool to `pool_keep`, if set).
    Admit { pool_keep: Option<usize> },
    /// It does not fit even with no pool: empty the pool (if it holds any)
    /// and ask `count` more idle sandboxes to checkpoint and leave.
    Evict { count: usize, empty_pool: bool },
    /// Enough sandboxes are leaving already: wait for them.
    Wait { empty_pool: bool },
    /// Even every idle sandbox leaving would not make room.
    Refuse,
}

impl Ledger {
    /// Sandbox bytes `sandboxes` commit.
    pub fn sandboxes(&self, sandboxes: usize) -> u64 {
        (sandboxes as u64).saturating_mul(self.sandbox)
    }

    /// What `usage` commits in all.
    pub fn committed(&self, usage: &Usage) -> u64 {
        self.sandboxes(usage.sandboxes)
            .saturating_add(usage.pool.committed())
    }

    /// Room for one more sandbox, given `usage` and `evictable` idle
    /// sandboxes that could be asked to leave.
    pub fn plan(&self, usage: &Usage, evictable: usize) -> Plan {
        let needed = self.sandboxes(usage.sandboxes.saturating_add(1));
        if needed.saturating_add(usage.pool.committed()) <= self.capacity {
            return Plan::Admit { pool_keep: None };
        }
        if needed <= self.capacity {
            // The pool gives way first: keep what still fits beside it.
            let room = self.capacity.saturating_sub(needed);
            let keep = usize::try_from(room / usage.pool.per_sandbox())
                .unwrap_or(usize::MAX)
                .min(usage.pool.ready.saturating_sub(1));
            return Plan::Admit {
                pool_keep: Some(keep),
            };
        }
        if self.sandbox > self.capacity {
            // Bigger than the instance: nothing evicted would ever make room.
            return Plan::Refuse;
        }
        let empty_pool = usage.pool.ready > 0;
        let over = needed.saturating_sub(self.capacity);
        let short = usize::try_from(over.div_ceil(self.sandbox.max(1))).unwrap_or(usize::MAX);
        if usage.evicting >= short {
            return Plan::Wait { empty_pool };
        }
        let more = short.saturating_sub(usage.evicting);
        if evictable < more {
            return Plan::Refuse;
        }
        Plan::Evict {
            count: more,
            empty_pool,
        }
    }

    /// How many warm sandboxes fit beside `sandboxes` committed ones.
    pub fn pool_room(&self, sandboxes: usize, pool: &PoolUsage) -> usize {
        let room = self.capacity.saturating_sub(self.sandboxes(sandboxes));
        usize::try_from(room / pool.per_sandbox()).unwrap_or(usize::MAX)
    }
}

/// A sandbox held here, as eviction sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: SandboxId,
    /// A client socket is attached.
    pub attached: bool,
    /// An execution runs (also one kept across a move).
    pub executing: bool,
    /// Created with `enable_checkpoint`: it can leave and come back.
    pub checkpointable: bool,
    /// Its last client activity or execution end.
    pub last_activity: Instant,
}

impl Candidate {
    /// Idle and able to come back: no client, no execution, checkpointable.
    pub fn evictable(&self) -> bool {
        !self.attached && !self.executing && self.checkpointable
    }
}

/// The `count` evictable sandboxes used least recently, oldest first.
/// Never one with a client attached, an execution running, or no
/// checkpoints (it could not come back).
pub fn least_recently_used(candidates: &[Candidate], count: usize) -> Vec<SandboxId> {
    let mut idle: Vec<&Candidate> = candidates.iter().filter(|c| c.evictable()).collect();
    idle.sort_by_key(|c| c.last_activity);
    idle.into_iter().take(count).map(|c| c.id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const MIB: u64 = 1 << 20;

    fn ledger() -> Ledger {
        Ledger {
            capacity: 2048 * MIB,
            sandbox: 1024 * MIB,
        }
    }

    fn usage(sandboxes: usize, ready: usize, evicting: usize) -> Usage {
        Usage {
            sandboxes,
            pool: PoolUsage {
                ready,
                bytes: ready as u64 * 22 * MIB,
                measured_each: 0,
                booting: 0,
            },
            evicting,
        }
    }

    #[test]
    fn sandboxes_commit_their_limit_and_the_pool_what_it_uses() {
        let ledger = ledger();
        assert_eq!(ledger.committed(&usage(1, 2, 0)), 1024 * MIB + 44 * MIB);
        // A pool that cannot read its cgroups is counted at the estimate.
        let unknown = Usage {
            sandboxes: 0,
            pool: PoolUsage {
                ready: 2,
                bytes: 0,
                measured_each: 0,
                booting: 0,
            },
            evicting: 0,
        };
        assert_eq!(ledger.committed(&unknown), 2 * WARM_SANDBOX_ESTIMATE);
    }

    #[test]
    fn a_sandbox_that_fits_is_admitted_as_is() {
        assert_eq!(
            ledger().plan(&usage(0, 0, 0), 0),
            Plan::Admit { pool_keep: None }
        );
        // Exactly full counts as fitting.
        let exact = Ledger {
            capacity: 2048 * MIB + 44 * MIB,
            ..ledger()
        };
        assert_eq!(
            exact.plan(&usage(1, 2, 0), 0),
            Plan::Admit { pool_keep: None }
        );
    }

    #[test]
    fn the_pool_shrinks_first_and_only_as_much_as_needed() {
        // 1 GiB + 1 GiB needed leaves 20 MiB: no warm sandbox fits beside.
        let tight = Ledger {
            capacity: 2048 * MIB + 20 * MIB,
            ..ledger()
        };
        assert_eq!(
            tight.plan(&usage(1, 3, 0), 5),
            Plan::Admit { pool_keep: Some(0) }
        );
        // 50 MiB left: two of 22 MiB still fit.
        let roomier = Ledger {
            capacity: 2048 * MIB + 50 * MIB,
            ..ledger()
        };
        assert_eq!(
            roomier.plan(&usage(1, 3, 0), 5),
            Plan::Admit { pool_keep: Some(2) }
        );
    }

    #[test]
    fn when_the_pool_is_not_enough_idle_sandboxes_are_evicted() {
        assert_eq!(
            ledger().plan(&usage(2, 1, 0), 1),
            Plan::Evict {
                count: 1,
                empty_pool: true
            }
        );
        // One is leaving already: wait for it rather than evict another.
        assert_eq!(
            ledger().plan(&usage(2, 0, 1), 1),
            Plan::Wait { empty_pool: false }
        );
        // Over by two (capacity lowered under running sandboxes).
        assert_eq!(
            ledger().plan(&usage(3, 0, 0), 5),
            Plan::Evict {
                count: 2,
                empty_pool: false
            }
        );
    }

    #[test]
    fn nothing_evictable_is_a_refusal_and_no_eviction_is_made_in_vain() {
        assert_eq!(ledger().plan(&usage(2, 0, 0), 0), Plan::Refuse);
        // Two short and only one idle sandbox: evicting it would not help.
        assert_eq!(ledger().plan(&usage(3, 0, 0), 1), Plan::Refuse);
        // A sandbox bigger than the instance never fits.
        let small = Ledger {
            capacity: 512 * MIB,
            ..ledger()
        };
        assert_eq!(small.plan(&usage(0, 0, 0), 3), Plan::Refuse);
    }

    #[test]
    fn the_pool_regrows_only_into_free_room() {
        let pool = PoolUsage {
            ready: 1,
            bytes: 22 * MIB,
            measured_each: 0,
            booting: 0,
        };
        assert_eq!(ledger().pool_room(2, &pool), 0);
        assert_eq!(ledger().pool_room(1, &pool), 46);
        // An empty pool is sized by what a warm sandbox used when measured.
        let emptied = PoolUsage {
            ready: 0,
            bytes: 0,
            measured_each: 22 * MIB,
            booting: 0,
        };
        assert_eq!(ledger().pool_room(1, &emptied), 46);
        assert_eq!(
            ledger().pool_room(0, &PoolUsage::default()),
            (2048 / 64) as usize
        );
    }

    /// What the instance commits once a plan is carried out: the pool holds
    /// what it keeps (or grows to its target), and the create one sandbox
    /// (booted cold: the worst case, taking no warm one).
    fn committed_after(ledger: &Ledger, usage: &Usage, per_warm: u64) -> u64 {
        let pool = match ledger.plan(usage, 0) {
            Plan::Admit {
                pool_keep: Some(keep),
            } => keep,
            Plan::Admit { pool_keep: None } => usage.pool.ready + usage.pool.booting,
            other => panic!("expected an admission, got {other:?}"),
        };
        ledger.sandboxes(usage.sandboxes + 1) + pool as u64 * per_warm
    }

    #[test]
    fn the_pool_never_commits_past_capacity_with_a_boot_in_flight() {
        // Room for one sandbox and 50 MiB: two warm sandboxes of 22 MiB are
        // ready and the refill boots a third (the pool's target is 3).
        let ledger = Ledger {
            capacity: 1024 * MIB + 50 * MIB,
            sandbox: 1024 * MIB,
        };
        let usage = Usage {
            sandboxes: 0,
            pool: PoolUsage {
                ready: 2,
                bytes: 44 * MIB,
                measured_each: 22 * MIB,
                booting: 1,
            },
            evicting: 0,
        };
        assert_eq!(ledger.committed(&usage), 66 * MIB);
        let after = committed_after(&ledger, &usage, 22 * MIB);
        assert!(
            after <= ledger.capacity,
            "committed {after} > capacity {}",
            ledger.capacity
        );
        // The governor's target never adds up past the room either.
        let target = ledger.pool_room(1, &usage.pool);
        assert!(ledger.sandboxes(1) + target as u64 * 22 * MIB <= ledger.capacity);
    }

    #[test]
    fn an_uneven_pool_is_sized_by_its_average_rounded_up() {
        // Three warm sandboxes of 33 MiB and 2 bytes in all; 99 MiB and a
        // byte of room: three would not fit, two do.
        let pool = PoolUsage {
            ready: 3,
            bytes: 99 * MIB + 2,
            measured_each: 0,
            booting: 0,
        };
        let ledger = Ledger {
            capacity: 99 * MIB + 1,
            sandbox: 1024 * MIB,
        };
        assert_eq!(ledger.pool_room(0, &pool), 2);
    }

    fn candidate(n: u128, age_s: u64) -> Candidate {
        Candidate {
            id: SandboxId::from_u128(n),
            attached: false,
            executing: false,
            checkpointable: true,
            last_activity: Instant::now() - Duration::from_secs(age_s),
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_used_idle_sandboxes() {
        let candidates = vec![candidate(1, 10), candidate(2, 300), candidate(3, 60)];
        assert_eq!(
            least_recently_used(&candidates, 2),
            vec![SandboxId::from_u128(2), SandboxId::from_u128(3)]
        );
        assert_eq!(least_recently_used(&candidates, 9).len(), 3);
    }

    #[test]
    fn eviction_never_takes_an_attached_executing_or_uncheckpointable_sandbox() {
        let mut attached = candidate(1, 900);
        attached.attached = true;
        let mut executing = candidate(2, 800);
        executing.executing = true;
        let mut plain = candidate(3, 700);
        plain.checkpointable = false;
        let idle = candidate(4, 5);
        let candidates = vec![attached, executing, plain, idle];
        assert_eq!(
            least_recently_used(&candidates, 3),
            vec![SandboxId::from_u128(4)]
        );
        assert!(least_recently_used(&candidates[..3], 1).is_empty());
    }
}
