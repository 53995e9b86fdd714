//! `sandboxd serve` as a real process, for the end-to-end tests: the
//! `testkit` fixture (shared with the benchmarks) with the test binary's
//! `sandboxd`, debug logs, the shared emulator, and the tests' WebSocket
//! client. Each server has its own runsc root (one "host"), and several may
//! share a bucket on the emulator.

use std::ops::{Deref, DerefMut};
use std::path::Path;

/// A running server process; killed (SIGKILL) when dropped.
pub struct ServerProcess(testkit::ServerProcess);

impl Deref for ServerProcess {
    type Target = testkit::ServerProcess;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for ServerProcess {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

pub fn free_port() -> u16 {
    testkit::free_port().expect("a free port")
}

/// How to start one server.
pub struct Launch(testkit::Launch);

impl Deref for Launch {
    type Target = testkit::Launch;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Launch {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Launch {
    /// A server named `name` with its state under `dir/<name>`.
    pub fn new(name: &str, dir: &Path) -> Self {
        Self(
            testkit::Launch::new(env!("CARGO_BIN_EXE_sandboxd"), name, dir)
                .log_level("info,sandboxd=debug,controllers=debug"),
        )
    }

    /// Shares `bucket` on the test emulator for every artifact.
    pub fn on_bucket(self, bucket: &str) -> Self {
        self.on_emulator(&super::emulator().endpoint(), bucket)
    }

    /// Shares `bucket` on the emulator at `endpoint` for every artifact.
    pub fn on_emulator(self, endpoint: &str, bucket: &str) -> Self {
        Self(self.0.on_emulator(endpoint, bucket))
    }

    /// Short leases and intervals, so crash takeover takes seconds.
    pub fn fast_leases(self) -> Self {
        Self(self.0.fast_leases())
    }

    pub fn with_args(self, args: &[&str]) -> Self {
        Self(self.0.with_args(args))
    }

    /// A server the test will freeze (`testkit::Launch::frozen_by_tests`).
    pub fn frozen_by_tests(self) -> Self {
        Self(self.0.frozen_by_tests())
    }

    pub async fn start(self) -> ServerProcess {
        self.try_start().await.unwrap_or_else(|err| panic!("{err}"))
    }

    /// Starts the server and waits until it is ready (30 s at most); the
    /// error says why not, with the end of its log.
    pub async fn try_start(self) -> Result<ServerProcess, String> {
        self.0
            .start()
            .await
            .map(ServerProcess)
            .map_err(|err| err.to_string())
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

    /// Sends `signal` (`-TERM`, `-KILL`) and, for TERM, waits for a clean exit.
    pub fn signal(&mut self, signal: &str) {
        self.0.signal(signal).unwrap_or_else(|err| panic!("{err}"));
    }
}
