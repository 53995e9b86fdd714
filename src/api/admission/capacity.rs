//! How much memory this instance has: the memory limit of the server's own
//! cgroup (and of every cgroup above it), else the machine's `MemTotal`.
//!
//! On Cloud Run the container's memory setting is what an instance gets
//! before it is killed, and it shows as the cgroup's limit (cgroup v2
//! `memory.max`, v1 `memory.limit_in_bytes`) or, in the second generation's
//! micro-VM, as `MemTotal`. The smaller of all found is the capacity. The
//! paths are parameters so tests read a directory of their own.

use std::path::{Path, PathBuf};

/// A v1 "no limit" is a huge number (`9223372036854771712`), v2's `max`.
const UNLIMITED_FROM: u64 = 1 << 62;

/// The instance's memory and where it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected {
    pub bytes: u64,
    pub source: String,
}

/// The instance's memory as `/proc` and `/sys/fs/cgroup` say; `None` when
/// neither says anything.
pub fn detect() -> Option<Detected> {
    detect_in(Path::new("/proc"), Path::new("/sys/fs/cgroup"))
}

/// [`detect`] with `/proc` at `proc_root` and the cgroup mounts at `cgroup_root`.
pub fn detect_in(proc_root: &Path, cgroup_root: &Path) -> Option<Detected> {
    let cgroups = std::fs::read_to_string(proc_root.join("self/cgroup")).unwrap_or_default();
    let limited = cgroup_limit_files(&cgroups, cgroup_root)
        .into_iter()
        .filter_map(|file| Some((read_limit(&file)?, file)))
        .min_by_key(|(bytes, _)| *bytes)
        .map(|(bytes, file)| Detected {
            bytes,
            source: file.display().to_string(),
        });
    let total = mem_total(proc_root).map(|bytes| Detected {
        bytes,
        source: proc_root.join("meminfo").display().to_string(),
    });
    match (limited, total) {
        (Some(limited), Some(total)) if total.bytes < limited.bytes => Some(total),
        (Some(limited), _) => Some(limited),
        (None, total) => total,
    }
}

/// Every memory limit file of the server's cgroups and their ancestors.
fn cgroup_limit_files(cgroups: &str, cgroup_root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (base, file) = if controllers.is_empty() {
            (cgroup_root.to_path_buf(), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (cgroup_root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut dir = Some(Path::new(path.trim_start_matches('/')));
        while let Some(relative) = dir {
            files.push(base.join(relative).join(file));
            dir = relative.parent();
        }
    }
    files
}

/// A limit file's value; `None` for no limit or no file.
fn read_limit(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let bytes: u64 = text.trim().parse().ok()?;
    (bytes > 0 && bytes < UNLIMITED_FROM).then_some(bytes)
}

/// `MemTotal` from `meminfo`, in bytes.
fn mem_total(proc_root: &Path) -> Option<u64> {
    let meminfo = std::fs::read_to_string(proc_root.join("meminfo")).ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, relative: &str, content: &str) {
        let file = root.join(relative);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(file, content).expect("write");
    }

    fn machine(meminfo_kib: u64) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("temp dir");
        write(
            root.path(),
            "proc/meminfo",
            &format!("MemTotal:       {meminfo_kib} kB\nMemFree: 1 kB\n"),
        );
        root
    }

    #[test]
    fn a_v2_limit_of_the_cgroup_or_an_ancestor_wins_over_mem_total() {
        let root = machine(24 << 20);
        write(root.path(), "proc/self/cgroup", "0::/service/server\n");
        write(root.path(), "cg/service/server/memory.max", "max\n");
        write(root.path(), "cg/service/memory.max", "4294967296\n");
        let found = detect_in(&root.path().join("proc"), &root.path().join("cg")).expect("found");
        assert_eq!(found.bytes, 4 << 30);
        assert!(found.source.ends_with("service/memory.max"), "{found:?}");
    }

    #[test]
    fn a_v1_memory_limit_is_read_and_unlimited_means_mem_total() {
        let root = machine(16 << 20);
        write(
            root.path(),
            "proc/self/cgroup",
            "4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
        );
        write(
            root.path(),
            "cg/memory/process_api/abc/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        let found = detect_in(&root.path().join("proc"), &root.path().join("cg")).expect("found");
        assert_eq!(found.bytes, 16 << 30);
        assert!(found.source.ends_with("meminfo"), "{found:?}");
        write(
            root.path(),
            "cg/memory/process_api/abc/memory.limit_in_bytes",
            "2147483648\n",
        );
        let found = detect_in(&root.path().join("proc"), &root.path().join("cg")).expect("found");
        assert_eq!(found.bytes, 2 << 30);
    }

    #[test]
    fn a_limit_above_the_machine_is_the_machine() {
        let root = machine(1 << 20);
        write(root.path(), "proc/self/cgroup", "0::/\n");
        write(root.path(), "cg/memory.max", "8589934592\n");
        let found = detect_in(&root.path().join("proc"), &root.path().join("cg")).expect("found");
        assert_eq!(found.bytes, 1 << 30);
    }

    #[test]
    fn nothing_readable_is_none() {
        let root = tempfile::tempdir().expect("temp dir");
        assert_eq!(detect_in(root.path(), root.path()), None);
    }
}
