//! A private fake-gcs-server that keeps its objects on disk, so a test can
//! kill and restart it with its data (the storage outage of the fault tests
//! and the chaos run). The shared in-memory emulator of `super::emulator` is
//! never restarted.

/// A fake-gcs-server on port 80 of a spare loopback address, its objects
/// under `root`; killed when dropped.
pub struct DiskEmulator {
    pub host: std::net::Ipv4Addr,
    emulator: testkit::Emulator,
}

impl DiskEmulator {
    pub fn start(root: &std::path::Path) -> Self {
        let emulator = testkit::Emulator::start(
            121..=200,
            testkit::Backend::Filesystem(root.to_owned()),
            None,
        )
        .unwrap_or_else(|err| panic!("{err}"));
        Self {
            host: emulator.host,
            emulator,
        }
    }

    /// `http://127.0.0.N`, for `STORAGE_EMULATOR_HOST`.
    pub fn endpoint(&self) -> String {
        self.emulator.endpoint()
    }

    /// Creates bucket `name` (kept on disk across restarts).
    pub async fn create_bucket(&self, name: &str) {
        self.emulator
            .create_bucket(name)
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    }

    /// Starts the emulator (again) on the same address and data.
    pub fn restart(&mut self) {
        self.emulator
            .restart()
            .unwrap_or_else(|err| panic!("{err}"));
    }

    pub fn kill(&mut self) {
        self.emulator.kill();
    }
}
