//! A private fake-gcs-server that keeps its objects on disk, so a test can
//! kill and restart it with its data (the storage outage of the fault tests
//! and the chaos run). The shared in-memory emulator of `super::emulator` is
//! never restarted.

use std::time::Duration;

/// A fake-gcs-server on port 80 of a spare loopback address, its objects
/// under `root`; killed when dropped.
pub struct DiskEmulator {
    pub host: std::net::Ipv4Addr,
    root: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl DiskEmulator {
    pub fn start(root: &std::path::Path) -> Self {
        let mut emulator = Self {
            host: super::free_loopback(121..=200),
            root: root.to_owned(),
            child: None,
        };
        emulator.restart();
        emulator
    }

    /// `http://127.0.0.N`, for `STORAGE_EMULATOR_HOST`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.host)
    }

    /// Creates bucket `name` (kept on disk across restarts).
    pub async fn create_bucket(&self, name: &str) {
        let created = reqwest::Client::new()
            .post(format!("{}/storage/v1/b?project=test", self.endpoint()))
            .json(&serde_json::json!({ "name": name }))
            .send()
            .await
            .expect("bucket creation request");
        assert!(
            created.status().is_success(),
            "bucket creation: {}",
            created.status()
        );
    }

    /// Starts the emulator (again) on the same address and data.
    pub fn restart(&mut self) {
        let child = std::process::Command::new(super::emulator_binary())
            .args([
                "-scheme",
                "http",
                "-port",
                "80",
                "-backend",
                "filesystem",
                "-filesystem-root",
            ])
            .arg(&self.root)
            .arg("-host")
            .arg(self.host.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect((self.host, 80)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "emulator did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for DiskEmulator {
    fn drop(&mut self) {
        self.kill();
    }
}
