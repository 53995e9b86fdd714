//! The OCI bundle (`config.json`) every sandbox runs from.
//!
//! Checkpoint and restore hosts must agree on the mounts, the root's read-only
//! flag and the files open at checkpoint time, so the bundle is a pure function
//! of the configuration: same configuration, same bundle, on every host. The
//! init process is the agent (the `sandbox_agent` package, passed inline with
//! `python3 -c`, see `agent_program`, so no file has to exist in the sandbox
//! for it). The root filesystem is the
//! sandbox's image (`catalog`), never the host's `/`: it is given per sandbox,
//! and a restore uses the digest its checkpoint recorded.

use std::path::Path;

use serde_json::json;

/// Uid and gid user code runs as: non-root, so RLIMIT_NPROC applies to it.
pub const SANDBOX_UID: u32 = 1000;
/// Home and default working directory of user code.
pub const SANDBOX_HOME: &str = "/home/sandbox";
/// The directory a synced workspace lives in (created, owned by the user, in
/// every sandbox).
pub const WORKSPACE_DIR: &str = "/workspace";

pub use crate::runtime::agent::program::agent_program;

/// What varies between deployments.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleSpec {
    /// The Python interpreter inside the rootfs (runs the agent and user code).
    pub python: String,
    pub memory_limit_bytes: Option<u64>,
    /// CPU limit in cores (1.5 = one and a half).
    pub cpu_limit: Option<f64>,
    /// RLIMIT_NPROC for user code.
    pub max_processes: u64,
    /// Size of the `/tmp` tmpfs in MiB.
    pub tmp_size_mb: u64,
    /// The disk budget in MiB of the home and `/workspace` together (half
    /// each, see [`user_writable_mounts`]).
    pub disk_size_mb: u64,
    /// CPU features sandboxes see, pinned with the OCI annotation
    /// `dev.gvisor.internal.cpufeatures` (runsc versions that support it), so
    /// checkpoints restore on any host with at least these. `None`: the host's.
    pub cpu_features: Option<Vec<String>>,
}

/// What an `egress` sandbox's bundle adds: the network namespace runsc joins
/// and the `resolv.conf` mounted over the rootfs's.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleNetwork {
    pub netns: std::path::PathBuf,
    pub resolv_conf: std::path::PathBuf,
}

/// What the sandbox's memory limit keeps from each process for gVisor's own
/// use (the sentry's), at least: a process may map the limit less this.
pub const SENTRY_HEADROOM_MIN_BYTES: u64 = 32 << 20;

/// RLIMIT_AS of every process in a sandbox whose memory limit is
/// `memory_limit_bytes`: the limit less an eighth (at least
/// [`SENTRY_HEADROOM_MIN_BYTES`]). gVisor has no OOM killer of its own: a
/// sandbox whose processes use more than its cgroup allows is killed whole
/// by the host (runsc reports the cgroup limit as the guest's total
/// memory). With the address space of each process below the limit, one
/// process that allocates too much gets `ENOMEM` (Python's `MemoryError`)
/// and the sandbox lives on. `None` when the limit leaves no room.
pub fn address_space_limit(memory_limit_bytes: u64) -> Option<u64> {
    let headroom = (memory_limit_bytes / 8).max(SENTRY_HEADROOM_MIN_BYTES);
    memory_limit_bytes
        .checked_sub(headroom)
        .filter(|limit| *limit >= SENTRY_HEADROOM_MIN_BYTES)
}

/// Scratch size of `/var/tmp` in MiB.
pub const VAR_TMP_SIZE_MB: u64 = 64;

/// The places of an image user code may write besides `/tmp`, each a sized
/// tmpfs: `(path, owner uid and gid, mode, size in MiB)`. runsc's root
/// overlay (`--overlay2=root:memory`) has no size of its own, so a write
/// there only ended when the host's memory cgroup killed the whole sandbox;
/// a sized tmpfs answers `ENOSPC` instead. Every tmpfs lives in sandbox
/// memory and this runsc cannot share one size between mount points, so the
/// disk budget `disk_mb` is split: half each for the home and `/workspace`;
/// `/var/tmp` and `/run/lock` (world-writable in Debian images) get small
/// fixed sizes. The images' home is what `useradd --create-home` made of
/// `/etc/skel`, which the agent copies into the empty tmpfs at boot
/// (`config.seed_home`).
pub fn user_writable_mounts(disk_mb: u64) -> [(&'static str, u32, &'static str, u64); 4] {
    let half = workspace_size_mb(disk_mb);
    [
        (SANDBOX_HOME, SANDBOX_UID, "0755", half),
        (WORKSPACE_DIR, SANDBOX_UID, "0755", half),
        ("/var/tmp", 0, "1777", VAR_TMP_SIZE_MB),
        ("/run/lock", 0, "1777", 1),
    ]
}

/// The size of `/workspace` (and of the home) under the disk budget
/// `disk_mb`: half of it each. The workspace sync's total is held to it, so
/// that a synced workspace never restores into a mount too small for it.
pub fn workspace_size_mb(disk_mb: u64) -> u64 {
    (disk_mb / 2).max(1)
}

/// Whether the image at `rootfs` holds nothing at `path` that a tmpfs
/// mounted over it would hide: the directory is absent or empty, or holds
/// only files named as in the image's `/etc/skel` (what `useradd
/// --create-home` put in the home; the agent copies them in again). A
/// template image (made from a filesystem snapshot) holds its files there
/// and keeps the root overlay at that path: the disk budget does not cover
/// it (docs/security.md).
pub fn holds_nothing_of_its_own(rootfs: &Path, path: &str) -> bool {
    let inside = |path: &str| rootfs.join(path.trim_start_matches('/'));
    let Ok(entries) = std::fs::read_dir(inside(path)) else {
        return true;
    };
    entries.flatten().all(|entry| {
        entry.file_type().is_ok_and(|kind| kind.is_file())
            && inside("/etc/skel").join(entry.file_name()).is_file()
    })
}

/// The disk budget in MiB when none is configured: half the memory limit
/// (files live in sandbox memory, so a budget near the limit would end in the
/// host's OOM kill instead of `ENOSPC`), 1 GiB without a limit.
pub fn default_disk_size_mb(memory_limit_bytes: Option<u64>) -> u64 {
    memory_limit_bytes.map_or(1024, |bytes| (bytes >> 21).max(1))
}

/// The OCI annotation that pins the CPU features of a sandbox.
pub const CPU_FEATURES_ANNOTATION: &str = "dev.gvisor.internal.cpufeatures";

impl BundleSpec {
    /// The `config.json` document of a `none` sandbox on the image at `rootfs`.
    pub fn config(&self, rootfs: &Path) -> serde_json::Value {
        self.config_with(rootfs, None)
    }

    /// The `config.json` document; `rootfs` is the image's root filesystem
    /// (shared and never written: runsc's `--overlay2=root:memory` keeps the
    /// sandbox's writes in its memory), `network` for an `egress` sandbox (a
    /// checkpoint restores only into a bundle of the same kind).
    pub fn config_with(&self, rootfs: &Path, network: Option<&BundleNetwork>) -> serde_json::Value {
        let path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
        let agent_config = json!({
            "python": self.python,
            "uid": SANDBOX_UID,
            "gid": SANDBOX_UID,
            "home": SANDBOX_HOME,
            "workspace": WORKSPACE_DIR,
            "env": {
                "PATH": path,
                "HOME": SANDBOX_HOME,
                "USER": "sandbox",
                "LANG": "C.UTF-8",
                "PYTHONUNBUFFERED": "1",
            },
        });
        let mut resources = serde_json::Map::new();
        if let Some(bytes) = self.memory_limit_bytes {
            resources.insert("memory".into(), json!({ "limit": bytes }));
        }
        if let Some(cores) = self.cpu_limit {
            let period: u64 = 100_000;
            let quota = (cores * period as f64).round() as i64;
            resources.insert("cpu".into(), json!({ "quota": quota, "period": period }));
        }
        let annotations = match &self.cpu_features {
            Some(features) => json!({ CPU_FEATURES_ANNOTATION: features.join(",") }),
            None => json!({}),
        };
        let mut mounts = json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", format!("size={}m", self.tmp_size_mb)]},
        ]);
        if let Some(list) = mounts.as_array_mut() {
            for (path, owner, mode, size_mb) in user_writable_mounts(self.disk_size_mb)
                .into_iter()
                .filter(|(path, ..)| holds_nothing_of_its_own(rootfs, path))
            {
                list.push(
                    json!({"destination": path, "type": "tmpfs", "source": "tmpfs",
                    "options": ["nosuid", "nodev", format!("mode={mode}"), format!("uid={owner}"),
                        format!("gid={owner}"), format!("size={size_mb}m")]}),
                );
            }
        }
        let mut rlimits = vec![
            json!({"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}),
            json!({"type": "RLIMIT_NPROC", "hard": self.max_processes, "soft": self.max_processes}),
        ];
        if let Some(limit) = self.memory_limit_bytes.and_then(address_space_limit) {
            rlimits.push(json!({"type": "RLIMIT_AS", "hard": limit, "soft": limit}));
        }
        let mut network_namespace = json!({"type": "network"});
        if let Some(network) = network {
            if let Some(list) = mounts.as_array_mut() {
                list.push(json!({"destination": "/etc/resolv.conf", "type": "bind",
                    "source": network.resolv_conf, "options": ["rbind", "ro"]}));
            }
            network_namespace = json!({"type": "network", "path": network.netns});
        }
        json!({
            "ociVersion": "1.0.0",
            "annotations": annotations,
            "process": {
                "terminal": false,
                "user": {"uid": 0, "gid": 0},
                // -S: the agent needs no site-packages; skipping them saves boot time.
                "args": [self.python, "-S", "-c", agent_program(), agent_config.to_string()],
                // glibc keeps the agent's large buffers (a file chunk's line,
                // its JSON and its bytes) in the heap instead of mapping and
                // unmapping them each time: under ptrace every fresh page is a
                // fault the sentry serves, and a 1 MiB chunk parsed 12 ms
                // instead of 1.3 ms. Not user code's environment (see
                // `agent_config`'s `env`).
                "env": [
                    format!("PATH={path}"), "LANG=C.UTF-8", "PYTHONUNBUFFERED=1",
                    "MALLOC_MMAP_THRESHOLD_=33554432", "MALLOC_TRIM_THRESHOLD_=268435456",
                    "MALLOC_TOP_PAD_=67108864",
                ],
                "cwd": "/",
                "capabilities": {
                    "bounding": ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"],
                    "effective": ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"],
                    "permitted": ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"],
                    "inheritable": [],
                },
                "rlimits": rlimits,
            },
            "root": {"path": rootfs, "readonly": false},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, network_namespace],
                "resources": resources,
            },
        })
    }

    /// Writes `config.json` (see [`Self::config_with`]) into `dir`.
    pub fn write_with(
        &self,
        dir: &Path,
        rootfs: &Path,
        network: Option<&BundleNetwork>,
    ) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let text = serde_json::to_vec_pretty(&self.config_with(rootfs, network))
            .map_err(std::io::Error::other)?;
        std::fs::write(dir.join("config.json"), text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BundleSpec {
        BundleSpec {
            python: "/usr/bin/python3".into(),
            memory_limit_bytes: None,
            cpu_limit: None,
            max_processes: 64,
            tmp_size_mb: 64,
            disk_size_mb: 128,
            cpu_features: None,
        }
    }

    #[test]
    fn every_process_maps_less_than_the_sandbox_memory_limit() {
        assert_eq!(address_space_limit(512 << 20), Some(448 << 20));
        assert_eq!(address_space_limit(2 << 30), Some((2 << 30) - (256 << 20)));
        assert_eq!(address_space_limit(50 << 20), None);
        assert_eq!(address_space_limit(256 << 20), Some(224 << 20));
        let mut limited = spec();
        limited.memory_limit_bytes = Some(1 << 30);
        let config = limited.config(Path::new("/rootfs"));
        let rlimits = config["process"]["rlimits"].as_array().unwrap();
        assert!(
            rlimits
                .iter()
                .any(|r| r["type"] == "RLIMIT_AS" && r["hard"] == (896u64 << 20))
        );
        let config = spec().config(Path::new("/rootfs"));
        let rlimits = config["process"]["rlimits"].as_array().unwrap();
        assert!(rlimits.iter().all(|r| r["type"] != "RLIMIT_AS"));
    }

    #[test]
    fn the_users_writable_places_are_sized_by_the_disk_budget() {
        let config = spec().config(Path::new("/rootfs"));
        let mounts = config["mounts"].as_array().expect("mounts");
        for (dir, size) in [
            ("/home/sandbox", "size=64m"),
            ("/workspace", "size=64m"),
            ("/var/tmp", "size=64m"),
            ("/run/lock", "size=1m"),
        ] {
            let mount = mounts
                .iter()
                .find(|m| m["destination"] == dir)
                .expect("a mount");
            assert_eq!(mount["type"], "tmpfs");
            assert!(
                mount["options"]
                    .as_array()
                    .expect("options")
                    .contains(&json!(size)),
                "{mount}"
            );
        }
        assert_eq!(default_disk_size_mb(Some(512 << 20)), 256);
        assert_eq!(default_disk_size_mb(Some(2 << 30)), 1024);
        assert_eq!(default_disk_size_mb(None), 1024);
    }

    #[test]
    fn a_template_keeps_what_its_image_holds_unhidden() {
        let rootfs = tempfile::tempdir().expect("temp dir");
        let at = |path: &str| rootfs.path().join(path);
        for dir in ["etc/skel", "home/sandbox", "workspace/data"] {
            std::fs::create_dir_all(at(dir)).expect("dir");
        }
        for file in [
            "etc/skel/.bashrc",
            "home/sandbox/.bashrc",
            "workspace/data/n",
        ] {
            std::fs::write(at(file), "x").expect("file");
        }
        assert!(holds_nothing_of_its_own(rootfs.path(), "/home/sandbox"));
        assert!(!holds_nothing_of_its_own(rootfs.path(), "/workspace"));
        assert!(holds_nothing_of_its_own(rootfs.path(), "/var/tmp"));
        std::fs::write(at("home/sandbox/notes.txt"), "mine").expect("file");
        assert!(!holds_nothing_of_its_own(rootfs.path(), "/home/sandbox"));
        let config = spec().config(rootfs.path());
        let mounted: Vec<&str> = config["mounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .filter_map(|m| m["destination"].as_str())
            .collect();
        assert!(mounted.contains(&"/var/tmp"), "{mounted:?}");
        assert!(!mounted.contains(&"/home/sandbox"), "{mounted:?}");
        assert!(!mounted.contains(&"/workspace"), "{mounted:?}");
    }

    #[test]
    fn a_none_bundle_has_a_fresh_network_namespace_and_no_extra_mount() {
        let config = spec().config(Path::new("/images/x/rootfs"));
        let namespaces = config["linux"]["namespaces"]
            .as_array()
            .expect("namespaces");
        assert!(namespaces.contains(&json!({"type": "network"})));
        let mounts = config["mounts"].as_array().expect("mounts");
        assert_eq!(mounts.len(), 4 + user_writable_mounts(0).len());
        assert!(
            mounts
                .iter()
                .all(|m| m["destination"] != "/etc/resolv.conf")
        );
    }

    #[test]
    fn an_egress_bundle_joins_its_namespace_and_mounts_its_resolv_conf() {
        let network = BundleNetwork {
            netns: "/var/run/netns/sandboxd-7".into(),
            resolv_conf: "/run/x/resolv.conf".into(),
        };
        let config = spec().config_with(Path::new("/images/x/rootfs"), Some(&network));
        let namespaces = config["linux"]["namespaces"]
            .as_array()
            .expect("namespaces");
        assert!(
            namespaces.contains(&json!({"type": "network", "path": "/var/run/netns/sandboxd-7"}))
        );
        let mounts = config["mounts"].as_array().expect("mounts");
        assert!(
            mounts.contains(&json!({"destination": "/etc/resolv.conf", "type": "bind",
            "source": "/run/x/resolv.conf", "options": ["rbind", "ro"]}))
        );
        // Everything else is the same as a none sandbox's.
        let mut plain = spec().config(Path::new("/images/x/rootfs"));
        plain["linux"]["namespaces"] = config["linux"]["namespaces"].clone();
        plain["mounts"] = config["mounts"].clone();
        assert_eq!(plain, config);
    }
}
