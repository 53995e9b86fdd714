//! A private fake-gcs-server that keeps its objects on disk, so a test can
//! take storage down and bring it back with its data (the storage outage of
//! the fault tests and the chaos run). The shared in-memory emulator of
//! `super::emulator` is never restarted.
//!
//! Clients reach it through a proxy of its own, because killing the emulator
//! while it writes loses the object: its filesystem backend renames the new
//! bytes into place and only then sets the object's attributes, so a process
//! killed between the two leaves a file it answers 404 for (measured: about
//! one kill in eight under a steady stream of writes). A GCS write is atomic
//! (an object is its old version or its new one, never gone), and a test
//! that met the loss would blame the server for the emulator. An outage
//! here therefore cuts every connection at the proxy first, gives the
//! requests the emulator already holds time to finish, and only then kills
//! the process: the server sees connections refused, as in a real outage,
//! and what was written stays written.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use testkit::storage::{InstanceProxy, Partition, Profile, StorageModel};

/// How long requests already inside the emulator get to finish once the
/// proxy is cut (each takes milliseconds; this is margin for a loaded CI).
const SETTLE: Duration = Duration::from_millis(500);

/// A fake-gcs-server behind its own proxy on port 80 of a spare loopback
/// address, its objects under `root`; killed when dropped.
pub struct DiskEmulator {
    /// The proxy's address: what clients use.
    pub host: Ipv4Addr,
    emulator: testkit::Emulator,
    front: InstanceProxy,
}

impl DiskEmulator {
    pub async fn start(root: &std::path::Path) -> Self {
        let emulator = testkit::Emulator::start(
            121..=200,
            testkit::Backend::Filesystem(root.to_owned()),
            None,
        )
        .unwrap_or_else(|err| panic!("{err}"));
        // The proxy keeps the model's shared state alive itself.
        let front = StorageModel::new(emulator.socket_addr(), Profile::loopback())
            .proxy("disk-emulator")
            .await
            .unwrap_or_else(|err| panic!("{err}"));
        let IpAddr::V4(host) = front.addr.ip() else {
            panic!(
                "the proxy bound {}, not an IPv4 loopback address",
                front.addr
            );
        };
        Self {
            host,
            emulator,
            front,
        }
    }

    /// Creates bucket `name` (kept on disk across restarts).
    pub async fn create_bucket(&self, name: &str) {
        self.emulator
            .create_bucket(name)
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    }

    /// Takes storage down: connections are refused from now on, and the
    /// emulator is killed once what it holds is written.
    pub async fn kill(&mut self) {
        self.front.set_partition(Partition::Refuse);
        tokio::time::sleep(SETTLE).await;
        self.emulator.kill();
    }

    /// Starts the emulator again on the same data and lets clients back in.
    pub fn restart(&mut self) {
        self.emulator
            .restart()
            .unwrap_or_else(|err| panic!("{err}"));
        self.front.set_partition(Partition::Connected);
    }
}
