//! What the warm pool reads and writes in a container's cgroups: its CPU
//! weight (lowered while it boots and waits in the pool, so a refill yields
//! the CPU to sandboxes users are running) and its memory use (what the pool
//! costs the instance).
//!
//! runsc (without `cgroupsPath` in the spec) puts a container in a cgroup
//! named after its id at the root of each hierarchy (see `cpu_quota`): on
//! cgroup v1 `cpu/<id>/cpu.shares` (default 1024) and
//! `memory/<id>/memory.usage_in_bytes`; on v2 `<id>/cpu.weight` (default 100)
//! and `<id>/memory.current`. Where none is found or writable the pool works
//! the same, at normal priority (logged at debug level).
//!
//! The lowered weight is an eighth of the default, not the least there is:
//! a running sandbox on the same core gets eight ninths of it, and a boot
//! still finishes on a loaded host (at 2 shares, against a few `nice 10`
//! processes of the host, weight 110 each, a boot took over a minute).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often a boot's watcher looks for the new container's cgroup.
const WATCH_EVERY: Duration = Duration::from_millis(2);
/// A container that has no cgroup by then will not get one from this boot.
const WATCH_AT_MOST: Duration = Duration::from_secs(60);

/// A warm sandbox's CPU weight: an eighth of the default (v1 1024, v2 100).
const LOWERED_SHARES: &str = "128";
const LOWERED_WEIGHT: &str = "12";

/// A container's CPU weight, lowered; [`LoweredWeight::restore`] puts it back.
#[derive(Debug)]
pub struct LoweredWeight {
    file: PathBuf,
    previous: String,
}

impl LoweredWeight {
    /// Puts the weight back as it was (the sandbox now belongs to a user and
    /// competes like any other).
    pub fn restore(self) {
        if let Err(err) = std::fs::write(&self.file, &self.previous) {
            tracing::warn!(file = %self.file.display(), %err, "could not put a warm sandbox's CPU weight back");
        }
    }
}

/// Lowers the CPU weight of container `container_id` to an eighth;
/// `None` when its cgroup is not (yet) there or cannot be written.
pub fn lower_weight(cgroup_root: &Path, container_id: &str) -> Option<LoweredWeight> {
    let candidates = [
        (
            cgroup_root
                .join("cpu")
                .join(container_id)
                .join("cpu.shares"),
            LOWERED_SHARES,
        ),
        (
            cgroup_root
                .join("cpu,cpuacct")
                .join(container_id)
                .join("cpu.shares"),
            LOWERED_SHARES,
        ),
        (
            cgroup_root.join(container_id).join("cpu.weight"),
            LOWERED_WEIGHT,
        ),
    ];
    // A weight that is not a number is not one to put back later: the file
    // is being made (read between its creation and its first write), so the
    // watch looks again.
    let (file, previous, least) = candidates.into_iter().find_map(|(file, least)| {
        let previous = std::fs::read_to_string(&file).ok()?.trim().to_owned();
        previous.parse::<u64>().ok()?;
        Some((file, previous, least))
    })?;
    match std::fs::write(&file, least) {
        Ok(()) => Some(LoweredWeight { file, previous }),
        Err(err) => {
            tracing::debug!(file = %file.display(), %err, "cannot lower a warm sandbox's CPU weight");
            None
        }
    }
}

/// The memory container `container_id` uses now (bytes), if its cgroup says.
pub fn memory_bytes(cgroup_root: &Path, container_id: &str) -> Option<u64> {
    [
        cgroup_root
            .join("memory")
            .join(container_id)
            .join("memory.usage_in_bytes"),
        cgroup_root.join(container_id).join("memory.current"),
    ]
    .iter()
    .find_map(|file| std::fs::read_to_string(file).ok()?.trim().parse().ok())
}

/// How many processes the host's memory cgroup of container `container_id`
/// has OOM-killed (`oom_kill` of v1's `memory.oom_control`, v2's
/// `memory.events`), if its cgroup says. gVisor runs every process of a
/// sandbox inside its sentry, so any such kill ended the whole sandbox.
pub fn oom_kills(cgroup_root: &Path, container_id: &str) -> Option<u64> {
    [
        cgroup_root
            .join("memory")
            .join(container_id)
            .join("memory.oom_control"),
        cgroup_root.join(container_id).join("memory.events"),
    ]
    .iter()
    .find_map(|file| {
        std::fs::read_to_string(file)
            .ok()?
            .lines()
            .find_map(|line| line.strip_prefix("oom_kill "))?
            .trim()
            .parse()
            .ok()
    })
}

/// Watches for the cgroup of a container runsc is starting and lowers its
/// CPU weight as soon as it exists, so the boot itself (the sentry and the
/// agent starting up) already runs at the lowest weight.
pub struct WeightWatch {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Option<LoweredWeight>>,
}

impl WeightWatch {
    pub fn start(cgroup_root: PathBuf, container_id: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::task::spawn_blocking(move || {
            #[allow(
                clippy::disallowed_methods,
                reason = "a blocking thread polls the host's cgroup for a bounded time; no simulation runs runsc"
            )]
            let started = Instant::now();
            loop {
                if let Some(lowered) = lower_weight(&cgroup_root, &container_id) {
                    return Some(lowered);
                }
                if stopped.load(Ordering::Acquire) || started.elapsed() > WATCH_AT_MOST {
                    return None;
                }
                std::thread::sleep(WATCH_EVERY);
            }
        });
        Self { stop, task }
    }

    /// Stops watching (the boot has returned); the weight it lowered, if any.
    pub async fn end(mut self) -> Option<LoweredWeight> {
        self.stop.store(true, Ordering::Release);
        (&mut self.task).await.ok().flatten()
    }
}

impl Drop for WeightWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
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

    #[test]
    fn a_v1_weight_is_lowered_and_put_back() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "cpu/sbx1/cpu.shares", "1024\n");
        let lowered = lower_weight(root.path(), "sbx1").expect("lowered");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "128");
        lowered.restore();
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "1024");
    }

    #[test]
    fn a_v2_weight_is_lowered_and_put_back() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "sbx2/cpu.weight", "100\n");
        let lowered = lower_weight(root.path(), "sbx2").expect("lowered");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "12");
        lowered.restore();
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "100");
        assert!(lower_weight(root.path(), "absent").is_none());
    }

    #[test]
    fn memory_is_read_from_either_version() {
        let root = tempfile::tempdir().expect("temp dir");
        cgroup(root.path(), "memory/sbx1/memory.usage_in_bytes", "4096\n");
        cgroup(root.path(), "sbx2/memory.current", "8192\n");
        assert_eq!(memory_bytes(root.path(), "sbx1"), Some(4096));
        assert_eq!(memory_bytes(root.path(), "sbx2"), Some(8192));
        assert_eq!(memory_bytes(root.path(), "sbx3"), None);
    }

    #[test]
    fn oom_kills_are_read_from_either_version() {
        let root = tempfile::tempdir().expect("temp dir");
        cgroup(
            root.path(),
            "memory/sbx1/memory.oom_control",
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        );
        cgroup(
            root.path(),
            "sbx2/memory.events",
            "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n",
        );
        assert_eq!(oom_kills(root.path(), "sbx1"), Some(1));
        assert_eq!(oom_kills(root.path(), "sbx2"), Some(2));
        assert_eq!(oom_kills(root.path(), "sbx3"), None);
    }

    /// A weight file read before its first write (empty) is not lowered:
    /// putting back "" would leave the container without a weight.
    #[test]
    fn a_weight_file_not_yet_written_is_not_lowered() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "cpu/sbx5/cpu.shares", "");
        assert!(lower_weight(root.path(), "sbx5").is_none());
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "");
    }

    /// The cgroup appears while the boot runs: lowered at once. The file is
    /// created empty and written after, as a plain write does, so the watch
    /// may read it between the two (CI once saw it do so).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_lowers_the_weight_of_a_cgroup_made_while_it_runs() {
        let root = tempfile::tempdir().expect("temp dir");
        let watch = WeightWatch::start(root.path().to_owned(), "sbx4".to_owned());
        tokio::time::sleep(Duration::from_millis(20)).await;
        let file = cgroup(root.path(), "cpu/sbx4/cpu.shares", "");
        tokio::time::sleep(Duration::from_millis(10)).await;
        std::fs::write(&file, "1024\n").expect("write");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(&file).expect("read") != "128" {
            assert!(Instant::now() < deadline, "the watch lowers the weight");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let lowered = watch.end().await.expect("lowered");
        lowered.restore();
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "1024");
    }
}
