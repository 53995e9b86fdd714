//! `sandboxd serve` as a real process, for the end-to-end tests: each one has
//! its own runsc root (one "host"), and several may share a bucket on the
//! emulator.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server process; killed (SIGKILL) when dropped.
pub struct ServerProcess {
    pub child: Child,
    pub addr: String,
    pub name: String,
    _cleanup: super::RunscCleanup,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// How to start one server.
pub struct Launch {
    pub name: String,
    pub cwd: PathBuf,
    pub runtime_dir: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub port: Option<u16>,
}

impl Launch {
    /// A server named `name` with its state under `dir/<name>`.
    pub fn new(name: &str, dir: &Path) -> Self {
        let home = dir.join(name);
        std::fs::create_dir_all(&home).expect("server dir");
        Self {
            name: name.to_owned(),
            runtime_dir: home.join("run"),
            cwd: home,
            args: Vec::new(),
            env: Vec::new(),
            port: None,
        }
    }

    /// Shares `bucket` on the test emulator for every artifact.
    pub fn on_bucket(self, bucket: &str) -> Self {
        self.on_emulator(&super::emulator().endpoint(), bucket)
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

    /// Short leases and intervals, so crash takeover takes seconds.
    pub fn fast_leases(mut self) -> Self {
        for (flag, value) in [
            ("--lease-duration-s", "6"),
            ("--clock-skew-s", "1"),
            ("--renew-interval-s", "2"),
            ("--resync-interval-s", "2"),
        ] {
            self.args.push(flag.to_owned());
            self.args.push(value.to_owned());
        }
        self
    }

    pub fn with_args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    pub async fn start(self) -> ServerProcess {
        self.try_start().await.unwrap_or_else(|err| panic!("{err}"))
    }

    /// Starts the server and waits until it is ready (30 s at most); the
    /// error says why not, with the end of its log.
    pub async fn try_start(self) -> Result<ServerProcess, String> {
        let port = self.port.unwrap_or_else(free_port);
        let addr = format!("127.0.0.1:{port}");
        let log_path = self.cwd.join("sandboxd.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_sandboxd"))
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
            .env("LOG_LEVEL", "info,sandboxd=debug,controllers=debug")
            .current_dir(&self.cwd)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn sandboxd");
        let server = ServerProcess {
            child,
            addr,
            name: self.name,
            _cleanup: super::RunscCleanup(self.runtime_dir.join("runsc")),
        };
        let started = Instant::now();
        loop {
            if let Ok(response) = reqwest::get(format!("http://{}/readyz", server.addr)).await
                && response.status().is_success()
            {
                return Ok(server);
            }
            if started.elapsed() > Duration::from_secs(30) {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                return Err(format!(
                    "{} did not become ready within 30 s; its log ends:\n{tail}",
                    server.name
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl ServerProcess {
    pub fn url(&self, path: &str) -> String {
        format!("ws://{}{path}", self.addr)
    }

    pub async fn connect(&self, path: &str) -> super::ws::Ws {
        super::ws::Ws::connect(&self.url(path)).await
    }

    pub async fn attach(&self, id: &str, token: &str) -> super::ws::Ws {
        self.connect(&format!("/attach/{id}?sandbox_token={token}"))
            .await
    }

    /// `/create` with `init`: the client, id and token after RUNNING.
    pub async fn create(&self, init: serde_json::Value) -> (super::ws::Ws, String, String) {
        let mut ws = self.connect("/create").await;
        ws.send(init).await;
        let mut id = String::new();
        let mut token = String::new();
        loop {
            let frame = ws.next_value().await;
            if frame["event"] == "sandbox_id" {
                id = frame["sandbox_id"].as_str().unwrap_or_default().to_owned();
                token = frame["sandbox_token"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
            }
            assert_ne!(frame["status"], "SANDBOX_CREATION_ERROR", "{frame}");
            if frame["status"] == "SANDBOX_RUNNING" {
                return (ws, id, token);
            }
        }
    }

    /// Sends `signal` (`-TERM`, `-KILL`) and, for TERM, waits for the exit.
    pub fn signal(&mut self, signal: &str) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
        let status = self.child.wait().expect("wait");
        if signal == "-TERM" {
            assert!(status.success(), "{} exited with {status}", self.name);
        }
    }
}
