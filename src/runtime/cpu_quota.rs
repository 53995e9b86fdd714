//! Lifting a sandbox's CPU quota while runsc checkpoints it.
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
//! runsc (without `cgroupsPath` in the spec) puts a container in a cgroup
//! named after its id at the root of each hierarchy: cgroup v1's `cpu`
//! controller (`cpu.cfs_quota_us`, `-1` for none) or the v2 unified tree
//! (`cpu.max`, `max <period>` for none). Where neither is found or writable
//! (a platform that does not let the server write cgroups) the checkpoint
//! runs under the quota, as before; that is logged, not an error.

use std::path::{Path, PathBuf};

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

    #[test]
    fn no_quota_or_no_cgroup_is_left_alone() {
        let root = tempfile::tempdir().expect("temp dir");
        let file = cgroup(root.path(), "cpu/sbx3/cpu.cfs_quota_us", "-1\n");
        assert!(lift(root.path(), "sbx3").is_none());
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "-1\n");
        assert!(lift(root.path(), "absent").is_none());
    }
}
