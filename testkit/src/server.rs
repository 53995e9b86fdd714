//! `sandboxd serve` as a real process: each one has its own home directory
//! and runsc root (one "host"); several may share a bucket on an emulator.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::FixtureError;

/// How long a server gets to report ready.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> Result<u16, FixtureError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// How to start one server.
#[derive(Debug, Clone)]
pub struct Launch {
    pub binary: PathBuf,
    pub name: String,
    /// Its home: the working directory, `sandboxd.log`, the runtime dir.
    pub cwd: PathBuf,
    pub runtime_dir: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// The port to listen on (a free one without).
    pub port: Option<u16>,
    pub log_level: String,
    /// Runs in a process group of its own ([`Launch::frozen_by_tests`]).
    pub own_process_group: bool,
}

impl Launch {
    /// The server `binary` named `name`, its home `dir/<name>`.
    pub fn new(binary: impl Into<PathBuf>, name: &str, dir: &Path) -> Self {
        let home = dir.join(name);
        Self {
            binary: binary.into(),
            name: name.to_owned(),
            runtime_dir: home.join("run"),
            // No warm pool unless a test asks for one: its boots would
            // compete with the test's own sandboxes for the CPU.
            env: vec![("SANDBOXD_WARM_POOL".to_owned(), "0".to_owned())],
            cwd: home,
            args: Vec::new(),
            port: None,
            log_level: "info".to_owned(),
            own_process_group: false,
        }
    }

    /// For a server a test freezes (SIGSTOP): it runs in a process group of
    /// its own, whose parent, the test, lives in another group. In the
    /// test's group, it would be resumed by the kernel whenever that group
    /// becomes orphaned while it is stopped (SIGHUP, then SIGCONT to every
    /// member), which happens to a test run in the background of a shell
    /// that then exits: the freeze the test relies on ends early. Not the
    /// default: a server in a group of its own does not get the interrupt
    /// a terminal or a test runner sends to the test's group.
    pub fn frozen_by_tests(mut self) -> Self {
        self.own_process_group = true;
        self
    }

    /// Shares `bucket` on the emulator at `endpoint` for every artifact.
    pub fn on_emulator(mut self, endpoint: &str, bucket: &str) -> Self {
        for variable in [
            "SANDBOX_METADATA_BUCKET",
            "SANDBOX_CHECKPOINT_BUCKET",
            "FILESYSTEM_SNAPSHOT_BUCKET",
        ] {
            self.env.push((variable.to_owned(), bucket.to_owned()));
        }
        self.env
            .push(("STORAGE_EMULATOR_HOST".to_owned(), endpoint.to_owned()));
        self
    }

    /// Keeps everything in the local directory store `data` under its home.
    pub fn on_local_store(mut self) -> Self {
        let data = self.cwd.join("data").display().to_string();
        self.env.push(("SANDBOXD_DATA_DIR".to_owned(), data));
        self
    }

    /// Short leases and intervals, so crash takeover takes seconds.
    pub fn fast_leases(self) -> Self {
        self.with_args(&[
            "--lease-duration-s",
            "6",
            "--clock-skew-s",
            "1",
            "--renew-interval-s",
            "2",
            "--resync-interval-s",
            "2",
        ])
    }

    pub fn with_args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// Keeps `size` warm sandboxes (`--warm-pool`; none by default here).
    pub fn warm_pool(self, size: usize) -> Self {
        let size = size.to_string();
        self.with_args(&["--warm-pool", &size])
    }

    /// `LOG_LEVEL` of the server (`info` by default).
    pub fn log_level(mut self, level: &str) -> Self {
        level.clone_into(&mut self.log_level);
        self
    }

    /// Starts the server and waits until `/readyz` answers (30 s at most);
    /// the error says why not, with the end of its log.
    pub async fn start(self) -> Result<ServerProcess, FixtureError> {
        std::fs::create_dir_all(&self.cwd)?;
        let port = match self.port {
            Some(port) => port,
            None => free_port()?,
        };
        let addr = format!("127.0.0.1:{port}");
        let log_path = self.cwd.join("sandboxd.log");
        let mut command = Command::new(&self.binary);
        if self.own_process_group {
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
        }
        let child = command
            .args([
                "serve",
                "--listen",
                &addr,
                "--instance-id",
                &self.name,
                "--runtime-dir",
            ])
            .arg(&self.runtime_dir)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("LOG_LEVEL", &self.log_level)
            .current_dir(&self.cwd)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path)?)
            .spawn()
            .map_err(|source| FixtureError::Spawn {
                what: self.binary.display().to_string(),
                source,
            })?;
        let server = ServerProcess {
            child,
            addr,
            name: self.name,
            _cleanup: RunscCleanup(self.runtime_dir.join("runsc")),
        };
        let started = Instant::now();
        loop {
            if let Ok(response) = crate::http_client()
                .get(format!("http://{}/readyz", server.addr))
                .send()
                .await
                && response.status().is_success()
            {
                return Ok(server);
            }
            if started.elapsed() > READY_WITHIN {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                return Err(FixtureError::NotReady {
                    what: server.name.clone(),
                    seconds: READY_WITHIN.as_secs(),
                    tail: format!("; its log ends:\n{tail}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A running server process; killed (SIGKILL) when dropped, and whatever
/// runsc containers it left are deleted.
#[derive(Debug)]
pub struct ServerProcess {
    pub child: Child,
    pub addr: String,
    pub name: String,
    _cleanup: RunscCleanup,
}

impl ServerProcess {
    /// Sends `signal` (`-TERM`, `-KILL`) and waits for the exit; a TERM
    /// must end in a clean exit.
    pub fn signal(&mut self, signal: &str) -> Result<(), FixtureError> {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args([signal, &pid]).status()?;
        if !sent.success() {
            return Err(std::io::Error::other(format!("kill {signal} {pid}: {sent}")).into());
        }
        let status = self.child.wait()?;
        if signal == "-TERM" && !status.success() {
            return Err(
                std::io::Error::other(format!("{} exited with {status}", self.name)).into(),
            );
        }
        Ok(())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deletes every container under a runsc root when dropped, also when a test
/// panics: a server killed with SIGKILL leaves its sandboxes running, and a
/// test's runsc root (a temp dir) disappears with it. Declare it after the
/// temp dir it points into, so it drops first.
#[derive(Debug)]
pub struct RunscCleanup(pub PathBuf);

impl Drop for RunscCleanup {
    fn drop(&mut self) {
        let root = self.0.as_os_str();
        let Ok(output) = Command::new("runsc")
            .arg("--root")
            .arg(root)
            .args(["list", "--format", "json"])
            .output()
        else {
            return;
        };
        let containers: Vec<serde_json::Value> =
            serde_json::from_slice(&output.stdout).unwrap_or_default();
        for id in containers.iter().filter_map(|c| c["id"].as_str()) {
            let _ = Command::new("runsc")
                .arg("--root")
                .arg(root)
                .args(["delete", "--force", id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}
