//! HAProxy with `deploy/local/haproxy.cfg.template` in front of server
//! processes: cookie affinity (`GAESA`) and one connection per instance, as
//! Cloud Run routes.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::process::{ServerProcess, free_port};

pub struct Proxy {
    child: Child,
    pub port: u16,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proxy {
    /// Starts HAProxy in front of `servers`, its config written under `dir`.
    pub async fn start(dir: &std::path::Path, servers: &[&ServerProcess]) -> Self {
        let named: Vec<(String, String)> = servers
            .iter()
            .map(|s| (s.name.clone(), s.addr.clone()))
            .collect();
        Self::start_named(dir, &named).await
    }

    /// Starts HAProxy in front of `(name, address)` pairs: the name is the
    /// affinity cookie's value, so a replacement process on the same address
    /// keeps its place.
    pub async fn start_named(dir: &std::path::Path, servers: &[(String, String)]) -> Self {
        let template = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("deploy/local/haproxy.cfg.template"),
        )
        .expect("the template");
        let port = free_port();
        let lines: String = servers
            .iter()
            .map(|(name, addr)| format!("    server {name} {addr} cookie {name} maxconn 1\n"))
            .collect();
        let config = template
            .replace("@PORT@", &port.to_string())
            .replace("@SERVERS@\n", &lines);
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, config).expect("write haproxy.cfg");
        let child = Command::new("haproxy")
            .arg("-f")
            .arg(&path)
            .arg("-db")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("haproxy is installed (apt-get install -y haproxy; .ci/run does it)");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "haproxy did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self { child, port }
    }

    pub fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.port)
    }
}
