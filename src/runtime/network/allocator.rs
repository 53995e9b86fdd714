//! Sandbox addresses: one /30 per sandbox out of a configured range (host side
//! `.1`, sandbox `.2`), handed out without collisions across tasks, runtime
//! instances and server processes on one host.
//!
//! A slot is taken by creating its lease file with `O_EXCL` in a directory
//! shared by every server on the host; the kernel makes that atomic, so no
//! lock is needed. The file names its owner (pid, the process's start time, a
//! random instance id and the runtime's state directory), which is how startup
//! recognises slots a crashed server left behind: owner dead, or an earlier
//! instance in the state directory the starting runtime now uses. Slots are searched from a cursor that moves on
//! after each allocation, so a freed address is not reused at once (stale
//! conntrack entries of its last user fade first).

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::policy::Ipv4Cidr;

/// Addresses per sandbox: network, host side, sandbox, broadcast.
const SLOT_SIZE: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum AllocatorError {
    #[error("the sandbox address range {0} is too small: it needs at least a /30")]
    RangeTooSmall(Ipv4Cidr),
    #[error("no free sandbox address in {range} ({slots} sandboxes hold all of them)")]
    Exhausted { range: Ipv4Cidr, slots: u32 },
    #[error("address lease directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One sandbox's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    pub index: u32,
    /// The host's end of the veth pair (the sandbox's gateway).
    pub host: Ipv4Addr,
    /// The sandbox's address.
    pub sandbox: Ipv4Addr,
}

/// Prefix length of each slot's subnet.
pub const SLOT_PREFIX: u8 = 30;

/// Who holds a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseOwner {
    pub pid: u32,
    /// Start time of the process (clock ticks since boot): tells a live owner
    /// from a later process that reused its pid.
    pub start_time: u64,
    /// Random per runtime instance: tells instances in one process apart.
    pub instance: u64,
    /// The state directory of the owning runtime.
    pub runtime: String,
}

impl LeaseOwner {
    /// This process, for the runtime whose state directory is `runtime`.
    pub fn current(runtime: &Path) -> Self {
        let pid = std::process::id();
        Self {
            pid,
            start_time: process_start_time(pid).unwrap_or(0),
            instance: uuid::Uuid::new_v4().as_u64_pair().0,
            runtime: runtime.to_string_lossy().into_owned(),
        }
    }

    fn to_line(&self) -> String {
        format!(
            "{} {} {} {}\n",
            self.pid, self.start_time, self.instance, self.runtime
        )
    }

    fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim_end_matches('\n').splitn(4, ' ');
        Some(Self {
            pid: parts.next()?.parse().ok()?,
            start_time: parts.next()?.parse().ok()?,
            instance: parts.next()?.parse().ok()?,
            runtime: parts.next()?.to_owned(),
        })
    }

    /// True while the owning process still runs.
    pub fn is_alive(&self) -> bool {
        process_start_time(self.pid).is_some_and(|started| started == self.start_time)
    }
}

/// Field 22 of `/proc/<pid>/stat`.
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// The address range and its lease directory.
#[derive(Debug)]
pub struct AddressPool {
    range: Ipv4Cidr,
    slots: u32,
    leases: PathBuf,
    owner: LeaseOwner,
    cursor: AtomicU32,
}

impl AddressPool {
    pub fn open(
        range: Ipv4Cidr,
        leases: PathBuf,
        owner: LeaseOwner,
    ) -> Result<Self, AllocatorError> {
        if range.prefix() > SLOT_PREFIX {
            return Err(AllocatorError::RangeTooSmall(range));
        }
        let slots = u32::try_from(range.size() / u64::from(SLOT_SIZE)).unwrap_or(u32::MAX);
        std::fs::create_dir_all(&leases).map_err(|source| AllocatorError::Io {
            path: leases.clone(),
            source,
        })?;
        // Processes start at different places, so they rarely race for a file.
        let start = (std::process::id().wrapping_mul(2_654_435_761)) % slots;
        Ok(Self {
            range,
            slots,
            leases,
            owner,
            cursor: AtomicU32::new(start),
        })
    }

    pub fn range(&self) -> Ipv4Cidr {
        self.range
    }

    pub fn owner(&self) -> &LeaseOwner {
        &self.owner
    }

    /// The addresses of slot `index` (whether or not it is leased).
    pub fn slot(&self, index: u32) -> Option<Slot> {
        (index < self.slots).then(|| {
            let base = u32::from(self.range.network()) + index * SLOT_SIZE;
            Slot {
                index,
                host: Ipv4Addr::from(base + 1),
                sandbox: Ipv4Addr::from(base + 2),
            }
        })
    }

    fn lease_path(&self, index: u32) -> PathBuf {
        self.leases.join(index.to_string())
    }

    /// Leases a free slot.
    pub fn allocate(&self) -> Result<Slot, AllocatorError> {
        let io = |source| AllocatorError::Io {
            path: self.leases.clone(),
            source,
        };
        for _ in 0..self.slots {
            let index = self.cursor.fetch_add(1, Ordering::Relaxed) % self.slots;
            let created = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(self.lease_path(index));
            match created {
                Ok(mut file) => {
                    file.write_all(self.owner.to_line().as_bytes())
                        .map_err(io)?;
                    if let Some(slot) = self.slot(index) {
                        return Ok(slot);
                    }
                }
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(err) => return Err(io(err)),
            }
        }
        Err(AllocatorError::Exhausted {
            range: self.range,
            slots: self.slots,
        })
    }

    /// Gives a slot back (after its network is torn down).
    pub fn release(&self, index: u32) {
        if let Err(err) = std::fs::remove_file(self.lease_path(index))
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(slot = index, %err, "could not remove an address lease");
        }
    }

    /// Every lease on this host, with its owner (`None`: unreadable, e.g.
    /// being written right now).
    pub fn leases(&self) -> Result<Vec<(u32, Option<LeaseOwner>)>, AllocatorError> {
        let entries = std::fs::read_dir(&self.leases).map_err(|source| AllocatorError::Io {
            path: self.leases.clone(),
            source,
        })?;
        let mut leases = Vec::new();
        for entry in entries.flatten() {
            let Some(index) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let owner = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|text| LeaseOwner::parse(&text));
            leases.push((index, owner));
        }
        leases.sort_by_key(|(index, _)| *index);
        Ok(leases)
    }

    /// Slots whose holder is gone: a dead process, or an earlier run of the
    /// runtime that owns this pool (its state directory is ours now).
    pub fn stale_leases(&self) -> Result<Vec<u32>, AllocatorError> {
        Ok(self
            .leases()?
            .into_iter()
            .filter_map(|(index, owner)| {
                let Some(owner) = owner else {
                    // Unreadable: being written now, or its writer died
                    // between creating and writing it.
                    return self.unreadable_for_long(index).then_some(index);
                };
                let ours_from_before = owner.runtime == self.owner.runtime && owner != self.owner;
                (ours_from_before || !owner.is_alive()).then_some(index)
            })
            .collect())
    }

    /// An unreadable lease older than a minute: no writer takes that long.
    fn unreadable_for_long(&self, index: u32) -> bool {
        std::fs::metadata(self.lease_path(index))
            .and_then(|meta| meta.modified())
            .ok()
            .and_then(|modified| modified.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60))
    }

    /// True if some live runtime holds `index`.
    pub fn is_leased(&self, index: u32) -> bool {
        self.lease_path(index).exists()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Arc;

    use super::*;

    fn pool(dir: &Path, range: &str, runtime: &str) -> AddressPool {
        AddressPool::open(
            range.parse().expect("range"),
            dir.join("leases"),
            LeaseOwner::current(Path::new(runtime)),
        )
        .expect("pool")
    }

    #[test]
    fn slots_are_thirty_twos_with_host_and_sandbox_addresses() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = pool(dir.path(), "10.231.0.0/16", "/a");
        let slot = p.slot(1).expect("slot 1");
        assert_eq!(slot.host, Ipv4Addr::new(10, 231, 0, 5));
        assert_eq!(slot.sandbox, Ipv4Addr::new(10, 231, 0, 6));
        assert!(p.slot(16_384).is_none());
        assert!(p.slot(16_383).is_some());
        assert!(
            AddressPool::open(
                "10.0.0.0/31".parse().expect("range"),
                dir.path().join("x"),
                LeaseOwner::current(Path::new("/a")),
            )
            .is_err()
        );
    }

    #[test]
    fn concurrent_allocations_never_collide_and_exhaustion_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Two pools on one directory: two runtimes (or processes) on one host.
        let a = Arc::new(pool(dir.path(), "10.231.0.0/24", "/a"));
        let b = Arc::new(pool(dir.path(), "10.231.0.0/24", "/b"));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let p = if i % 2 == 0 { a.clone() } else { b.clone() };
                std::thread::spawn(move || {
                    (0..8)
                        .map(|_| p.allocate().expect("a free slot").index)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for thread in threads {
            for index in thread.join().expect("thread") {
                assert!(seen.insert(index), "slot {index} handed out twice");
            }
        }
        assert_eq!(seen.len(), 64);
        let err = a.allocate().expect_err("a /24 has 64 slots");
        assert!(
            matches!(err, AllocatorError::Exhausted { slots: 64, .. }),
            "{err}"
        );
        // Freed slots come back.
        a.release(7);
        b.release(9);
        let mut again = [
            a.allocate().expect("freed").index,
            b.allocate().expect("freed").index,
        ];
        again.sort_unstable();
        assert_eq!(again, [7, 9]);
    }

    #[test]
    fn leases_of_dead_owners_and_of_an_earlier_run_are_stale() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = pool(dir.path(), "10.231.0.0/24", "/mine");
        let live = p.allocate().expect("slot").index;
        let leases = dir.path().join("leases");
        // Three slots other than the one just allocated (which is random).
        let [a, b, c] = if !(40..=42).contains(&live) {
            [40, 41, 42]
        } else {
            [50, 51, 52]
        };
        // A crashed earlier run of this runtime, a dead process, a live other runtime.
        let mut earlier = LeaseOwner::current(Path::new("/mine"));
        earlier.instance ^= 1;
        std::fs::write(leases.join(a.to_string()), earlier.to_line()).expect("write");
        std::fs::write(leases.join(b.to_string()), "4294967 5 9 /other\n").expect("write");
        let other = LeaseOwner::current(Path::new("/other"));
        std::fs::write(leases.join(c.to_string()), other.to_line()).expect("write");
        let stale = p.stale_leases().expect("leases");
        assert_eq!(stale, vec![a, b]);
        assert!(!stale.contains(&live));
        assert!(p.is_leased(c));
    }
}
