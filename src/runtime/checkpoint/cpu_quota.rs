//! Lifting a sandbox's CPU quota, and giving its memory limit headroom,
//! while runsc checkpoints or restores it.
//!
//! A sandbox's CPU limit (`--sandbox-cpus`, one core by default) is a cgroup
//! quota on the whole gVisor sandbox, the sentry included. `runsc
//! checkpoint` pauses every task of the sandbox and then compresses its
//! memory in the sentry on as many threads as it has cores, so under the
//! quota a 200 MB image takes 0.95 s here and without it 0.6 s. The work is
//! the platform's, not the user's: no user code runs while the kernel is
//! paused, and a checkpointed container exits. So the quota is lifted for the
//! checkpoint and put back only if the container survives a failed one.
//!
//! `runsc restore` decompresses the image the same way, in the cgroup it
//! has just made for the new container: the quota is lifted as soon as runsc
//! has written it (a watcher polls for it) and put back once the restore
//! returns, a few milliseconds after the restored sandbox resumes. 200 MB:
//! 0.43 s under the quota, 0.36 s without.
//!
//! runsc (without `cgroupsPath` in the spec) puts a container in a cgroup
//! named after its id at the root of each hierarchy: cgroup v1's `cpu`
//! controller (`cpu.cfs_quota_us`, `-1` for none) or the v2 unified tree
//! (`cpu.max`, `max <period>` for none). Where neither is found or writable
//! (a platform that does not let the server write cgroups) the checkpoint
//! runs under the quota, as before; that is logged, not an error.
//!
//! The memory limit gets headroom the same way. A checkpoint writes, and a
//! restore loads, the sandbox's memory while the sentry works in the same
//! cgroup: a sandbox using 62–72 % of a 256 MiB limit could not be restored
//! (its memcg OOM-killed the sentry: shmem 169 MB for its memory plus 85 MB
//! of the sentry's own), and once its checkpoint failed the same way
//! (`tests/it/gvisor/admission.rs`). So for the checkpoint or restore the limit
//! (cgroup v1 `memory.limit_in_bytes`, v2 `memory.max`) is raised by a
//! quarter, at least 128 MiB, and put back afterwards; the instance's
//! `--memory-reserve-mb` covers that moment. If putting it back fails (the
//! restored sandbox still uses more), the sandbox keeps the headroom and
//! that is logged.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Where cgroup hierarchies are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A lifted limit (the CPU quota, or the memory limit raised), to put back
/// if the container goes on running.
#[derive(Debug)]
pub struct LiftedLimit {
    file: PathBuf,
    previous: String,
}

impl LiftedLimit {
    /// Puts the limit back as it was.
    fn put_back(self) {
        if let Err(err) = std::fs::write(&self.file, &self.previous) {
            tracing::warn!(file = %self.file.display(), %err, "could not put a sandbox's limit back; it keeps the headroom");
        }
    }
}

/// What [`lift`] lifted, to put back together.
#[derive(Debug, Default)]
pub struct LiftedQuota {
    cpu: Option<LiftedLimit>,
    memory: Option<LiftedLimit>,
}

impl LiftedQuota {
    /// Puts the limits back as they were.
    pub fn restore(self) {
        if let Some(cpu) = self.cpu {
            cpu.put_back();
        }
        if let Some(memory) = self.memory {
            memory.put_back();
        }
    }
}

/// Lifts the CPU quota of container `container_id` under `cgroup_root` and
/// gives its memory limit headroom; `None` when it has neither, or they
/// cannot be found or written.
pub fn lift(cgroup_root: &Path, container_id: &str) -> Option<LiftedQuota> {
    let lifted = LiftedQuota {
        cpu: lift_cpu(cgroup_root, container_id),
        memory: raise_memory(cgroup_root, container_id),
    };
    (lifted.cpu.is_some() || lifted.memory.is_some()).then_some(lifted)
}

/// The least headroom a checkpoint or restore gets above the memory limit.
const MIN_MEMORY_HEADROOM: u64 = 128 << 20;

/// A memory limit at or above this is none (cgroup v1 writes "unlimited"
/// as 9223372036854771712).
const UNLIMITED_MEMORY: u64 = 1 << 62;

/// Raises the memory limit of container `container_id` by a quarter (at
/// least [`MIN_MEMORY_HEADROOM`]); `None` when it has none, or it cannot be
/// found or written.
fn raise_memory(cgroup_root: &Path, container_id: &str) -> Option<LiftedLimit> {
    let candidates = [
        cgroup_root
            .join("memory")
            .join(container_id)
            .join("memory.limit_in_bytes"),
        cgroup_root.join(container_id).join("memory.max"),
    ];
    let (file, previous) = candidates.into_iter().find_map(|file| {
        let previous = std::fs::read_to_string(&file).ok()?;
        Some((file, previous.trim().to_owned()))
    })?;
    let limit: u64 = previous.parse().ok()?;
    if limit >= UNLIMITED_MEMORY {
        return None;
    }
    let raised = limit.saturating_add((limit / 4).max(MIN_MEMORY_HEADROOM));
    match std::fs::write(&file, raised.to_string()) {
        Ok(()) => Some(LiftedLimit { file, previous }),
        Err(err) => {
            tracing::debug!(file = %file.display(), %err, "cannot give the sandbox's memory headroom for its checkpoint or restore");
            None
        }
    }
}

/// Lifts the CPU quota; `None` when there is none, or it cannot be found or
/// written.
fn lift_cpu(cgroup_root: &Path, container_id: &str) -> Option<LiftedLimit> {
    let candidates = [
        (
            cgroup_root
                .join("cpu")
                .join(container_id)
                .join("cpu.cfs_quota_us"),
            Version::V1,
        ),
        (
            cgroup_root
                .join("cpu,cpuacct")
                .join(container_id)
                .join("cpu.cfs_quota_us"),
            Version::V1,
        ),
        (cgroup_root.join(container_id).join("cpu.max"), Version::V2),
    ];
    let (file, previous, version) = candidates.into_iter().find_map(|(file, version)| {
        let previous = std::fs::read_to_string(&file).ok()?;
        Some((file, previous.trim().to_owned(), version))
    })?;
    // A value that is not a quota (a file being written, read empty) is not
    // one yet: lifting it would later "put back" nothing.
    let unlimited = match version {
        Version::V1 => match previous.parse::<i64>().ok()? {
            -1 => return None,
            _ => "-1".to_owned(),
        },
        Version::V2 => {
            let mut fields = previous.split_whitespace();
            let (quota, period) = (fields.next()?, fields.next().unwrap_or("100000"));
            if quota == "max" || quota.parse::<u64>().is_err() {
                return None;
            }
            format!("max {period}")
        }
    };
    match std::fs::write(&file, &unlimited) {
        Ok(()) => Some(LiftedLimit { file, previous }),
        Err(err) => {
            tracing::debug!(file = %file.display(), %err, "cannot lift the sandbox's CPU quota for its checkpoint");
            None
        }
    }
}

/// Watches for the cgroup of a container runsc is creating, lifts its quota
/// once runsc has set one, and puts it back when told to stop (by
/// [`QuotaWatch::end`], or by being dropped when the restore's task is
/// cancelled: the thread never outlives its watch).
pub struct QuotaWatch {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// How often the watcher looks for the new container's quota.
const WATCH_EVERY: Duration = Duration::from_millis(2);
/// A restore that has not made its cgroup by then never will.
const WATCH_AT_MOST: Duration = Duration::from_secs(60);

impl QuotaWatch {
    /// Starts watching for container `container_id` under `cgroup_root`.
    pub fn start(cgroup_root: PathBuf, container_id: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::task::spawn_blocking(move || {
            #[allow(
                clippy::disallowed_methods,
                reason = "a blocking thread polls the host's cgroup for a bounded time; no simulation runs runsc"
            )]
            let started = Instant::now();
            // Each once runsc has set it (the cgroup first appears without).
            let mut lifted = LiftedQuota::default();
            while !stopped.load(Ordering::Acquire) && started.elapsed() < WATCH_AT_MOST {
                if lifted.cpu.is_none() {
                    lifted.cpu = lift_cpu(&cgroup_root, &container_id);
                }
                if lifted.memory.is_none() {
                    lifted.memory = raise_memory(&cgroup_root, &container_id);
                }
                std::thread::sleep(WATCH_EVERY);
            }
            lifted.restore();
        });
        Self { stop, task }
    }

    /// Stops watching and puts back the quota if it was lifted (the restore
    /// has returned, whether it worked or not).
    pub async fn end(mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = (&mut self.task).await;
    }
}

impl Drop for QuotaWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

#[derive(Clone, Copy)]
enum Version {
    V1,
    V2,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cgroup(root: &Path, relative: &str, content: &str) -> PathBuf {
        let file = root.join(relative);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(&file, content).expect("write");
        file
    }

    /// Waits (at most 5 s) until `file` reads `expected`.
    async fn reads_within(file: &Path, expected: &str, what: &str) {
        let read = async {
            while std::fs::read_to_string(file).expect("read") != expected {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .unwrap_or_else(|_| panic!("{what}"));
    }

    #[test]
    fn a_v1_quota_is_lifted_and_put_back() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "cpu/sbx1/cpu.cfs_quota_us", "100000\n");
        let lifted = lift(root.path(), "sbx1").expect("lifted");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "-1");
        lifted.restore();
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "100000");
    }

    #[test]
    fn a_memory_limit_gets_headroom_and_is_put_back() {
        let root = tempfile::tempdir().expect("temp dir");
        let v1 = cgroup(
            root.path(),
            "memory/sbx3/memory.limit_in_bytes",
            "268435456\n",
        );
        let lifted = lift(root.path(), "sbx3").expect("lifted");
        // A quarter of 256 MiB is under the floor: 128 MiB more.
        assert_eq!(std::fs::read_to_string(&v1).expect("read"), "402653184");
        lifted.restore();
        assert_eq!(std::fs::read_to_string(&v1).expect("read"), "268435456");
        let v2 = cgroup(root.path(), "sbx4/memory.max", "2147483648\n");
        let lifted = lift(root.path(), "sbx4").expect("lifted");
        assert_eq!(std::fs::read_to_string(&v2).expect("read"), "2684354560");
        lifted.restore();
        assert_eq!(std::fs::read_to_string(&v2).expect("read"), "2147483648");
        // No limit: nothing to raise (and no quota either).
        cgroup(
            root.path(),
            "memory/sbx5/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        cgroup(root.path(), "sbx6/memory.max", "max\n");
        assert!(lift(root.path(), "sbx5").is_none());
        assert!(lift(root.path(), "sbx6").is_none());
    }

    #[test]
    fn a_v2_quota_is_lifted_keeping_its_period_and_put_back() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "sbx2/cpu.max", "150000 100000\n");
        let lifted = lift(root.path(), "sbx2").expect("lifted");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "max 100000");
        lifted.restore();
        assert_eq!(
            std::fs::read_to_string(&file).expect("read"),
            "150000 100000"
        );
    }

    /// The cgroup appears while the watch runs, first without a quota (as
    /// when the directory is made), then with one: lifted, and put back at
    /// the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_lifts_the_quota_runsc_sets_and_puts_it_back_at_the_end() {
        let root = tempfile::tempdir().expect("temp dir");
        let watch = QuotaWatch::start(root.path().to_owned(), "sbx4".to_owned());
        tokio::time::sleep(Duration::from_millis(20)).await;
        let file = cgroup(root.path(), "cpu/sbx4/cpu.cfs_quota_us", "-1\n");
        tokio::time::sleep(Duration::from_millis(20)).await;
        std::fs::write(&file, "100000\n").expect("runsc sets the quota");
        reads_within(&file, "-1", "the watch lifts the quota").await;
        watch.end().await;
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "100000");
    }

    /// A watch dropped with its restore's cancelled task puts the quota back
    /// and its thread ends (a blocking task left running would keep the
    /// runtime, and the process, from exiting).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_watch_puts_the_quota_back() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "cpu/sbx6/cpu.cfs_quota_us", "100000\n");
        let watch = QuotaWatch::start(root.path().to_owned(), "sbx6".to_owned());
        reads_within(&file, "-1", "the watch lifts the quota").await;
        drop(watch);
        reads_within(&file, "100000", "a dropped watch puts the quota back").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_that_finds_nothing_ends_without_writing() {
        let root = tempfile::tempdir().expect("temp dir");
        let watch = QuotaWatch::start(root.path().to_owned(), "sbx5".to_owned());
        tokio::time::sleep(Duration::from_millis(10)).await;
        watch.end().await;
        assert!(!root.path().join("cpu").exists());
    }

    #[test]
    fn no_quota_or_no_cgroup_is_left_alone() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "cpu/sbx3/cpu.cfs_quota_us", "-1\n");
        assert!(lift(root.path(), "sbx3").is_none());
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "-1\n");
        assert!(lift(root.path(), "absent").is_none());
    }
}
