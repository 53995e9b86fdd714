//! Lifting a sandbox's CPU quota while runsc checkpoints or restores it.
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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Where cgroup hierarchies are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A lifted quota, to put back if the container goes on running.
#[derive(Debug)]
pub struct LiftedQuota {
    file: PathBuf,
    previous: String,
}

impl LiftedQuota {
    /// Puts the quota back as it was.
    pub fn restore(self) {
        if let Err(err) = std::fs::write(&self.file, &self.previous) {
            tracing::warn!(file = %self.file.display(), %err, "could not put a sandbox's CPU quota back");
        }
    }
}

/// Lifts the CPU quota of container `container_id` under `cgroup_root`;
/// `None` when it has none, or it cannot be found or written.
pub fn lift(cgroup_root: &Path, container_id: &str) -> Option<LiftedQuota> {
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
    let unlimited = match version {
        Version::V1 if previous == "-1" => return None,
        Version::V1 => "-1".to_owned(),
        Version::V2 => {
            let mut fields = previous.split_whitespace();
            let (quota, period) = (fields.next()?, fields.next().unwrap_or("100000"));
            if quota == "max" {
                return None;
            }
            format!("max {period}")
        }
    };
    match std::fs::write(&file, &unlimited) {
        Ok(()) => Some(LiftedQuota { file, previous }),
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
            let started = Instant::now();
            let mut lifted = None;
            while !stopped.load(Ordering::Acquire) && started.elapsed() < WATCH_AT_MOST {
                if lifted.is_none() {
                    lifted = lift(&cgroup_root, &container_id);
                }
                std::thread::sleep(WATCH_EVERY);
            }
            if let Some(lifted) = lifted {
                lifted.restore();
            }
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
