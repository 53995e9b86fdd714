//! `egress` sandbox networking against real runsc, `ip` and `iptables` (CI
//! installs them; without them these tests fail, they never skip).
//!
//! There is no outside network here, so the tests build one: a network
//! namespace "world" behind a veth from the host, holding 198.51.100.2 (an
//! allowed destination), 203.0.113.2 (in a denied CIDR), 169.254.169.254 and
//! 169.254.170.2 (stand-in metadata servers), 10.99.7.2 and 100.100.7.2 (a
//! private network and a CGNAT one, closed by default) and fd42:99::2 (IPv6),
//! each serving TCP, plus a DNS responder. The host itself reaches all of them (checked, so a refusal
//! inside a sandbox is the firewall's doing), and a listener on the host
//! stands for the host's own services. The world has no route to the sandbox
//! range: a reply reaches a sandbox only if the host's NAT rewrote its
//! source. Tests share the host's tables and the world, so they run one at a
//! time: nextest's `network` test group across processes, [`NETWORK`] within
//! one (`cargo test`).

use crate::support;

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command as HostCommand, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::{NetworkMode, SandboxId};
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecEvent, ExecRequest, Execution, SandboxRuntime,
};
use controllers::store::Store;
use sandboxd::runtime::network::Ipv4Cidr;
use sandboxd::runtime::{GvisorRuntime, NetnsWorkaround, NetworkConfig};
use sandboxd::store::LocalStore;

/// One test at a time: they share iptables, the world and the lease directory.
static NETWORK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const WORLD_NETNS: &str = "sbxtest-world";
const WORLD_VETH: &str = "sbxtw0";
const ALLOWED: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const DENIED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// Another cloud's metadata endpoint (ECS): link-local, so denied too.
const TASK_METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 170, 2);
/// A private (RFC 1918) address: closed unless the allow list opens it.
const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 99, 7, 2);
/// A carrier-grade NAT (RFC 6598) address: closed by default too.
const CGNAT: Ipv4Addr = Ipv4Addr::new(100, 100, 7, 2);
/// An IPv6 address of the world (sandboxes have no IPv6 at all).
const WORLD_IPV6: &str = "fd42:99::2";
/// The host's address towards the world: what the world must see with NAT.
const HOST_WORLD_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// Answers "hello from the world" and closes (the peer closes first).
const HELLO_PORT: u16 = 8001;
/// Reads until the client closes (the sandbox closes first).
const HOLD_PORT: u16 = 8002;
/// Answers "peer <the client's address as the world sees it>" and closes.
const PEER_PORT: u16 = 8003;
/// Every runtime of this test binary leases addresses here.
const LEASE_DIR: &str = "/run/sandboxd-network-tests";

const WORLD_SERVER: &str = r#"
import socket, threading
def listen(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    return s
def hello(s):
    while True:
        c, _ = s.accept(); c.sendall(b"hello from the world\n"); c.close()
def hold(s):
    def serve(c):
        c.sendall(b"holding\n")
        try:
            while c.recv(4096): pass
        finally: c.close()
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
def peer(s):
    while True:
        c, a = s.accept(); c.sendall(("peer " + a[0] + "\n").encode()); c.close()
def dns(s):
    while True:
        q, peer = s.recvfrom(512)
        end = q.index(b"\0", 12) + 5
        answer = b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04" + socket.inet_aton("198.51.100.2")
        a = q[end - 4:end - 2] == b"\x00\x01"
        s.sendto(q[:2] + b"\x81\x80" + q[4:6] + (b"\x00\x01" if a else b"\x00\x00") + b"\x00\x00\x00\x00" + q[12:end] + (answer if a else b""), peer)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("198.51.100.2", 53))
v6 = socket.socket(socket.AF_INET6); v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); v6.bind(("::", 8001)); v6.listen(64)
# Every socket is bound before "ready".
for f, s in ((hello, listen(8001)), (hello, v6), (hold, listen(8002)), (peer, listen(8003)), (dns, udp)):
    threading.Thread(target=f, args=(s,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

fn sh(command: &str) -> String {
    let output = HostCommand::new("sh")
        .args(["-c", command])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn must(command: &str) {
    let output = HostCommand::new("sh")
        .args(["-c", command])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "`{command}` failed: {} (needs root, iproute2 and iptables)",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The fake outside world; removed on drop.
struct World {
    server: Child,
}

impl World {
    fn start() -> Self {
        remove_world();
        must(&format!(
            "ip netns add {WORLD_NETNS} && \
             ip link add {WORLD_VETH} type veth peer name w0 netns {WORLD_NETNS} && \
             ip addr add 198.51.100.1/24 dev {WORLD_VETH} && ip addr add 203.0.113.1/24 dev {WORLD_VETH} && \
             ip link set {WORLD_VETH} up && \
             ip -n {WORLD_NETNS} addr add 198.51.100.2/24 dev w0 && ip -n {WORLD_NETNS} addr add 203.0.113.2/24 dev w0 && \
             ip -n {WORLD_NETNS} addr add 169.254.169.254/32 dev w0 && \
             ip -n {WORLD_NETNS} addr add 169.254.170.2/32 dev w0 && \
             ip addr add 10.99.7.1/24 dev {WORLD_VETH} && ip -n {WORLD_NETNS} addr add 10.99.7.2/24 dev w0 && \
             ip addr add 100.100.7.1/24 dev {WORLD_VETH} && ip -n {WORLD_NETNS} addr add 100.100.7.2/24 dev w0 && \
             sysctl -qw net.ipv6.conf.{WORLD_VETH}.disable_ipv6=0 && \
             ip addr add fd42:99::1/64 dev {WORLD_VETH} nodad && \
             ip netns exec {WORLD_NETNS} sysctl -qw net.ipv6.conf.w0.disable_ipv6=0 && \
             ip -n {WORLD_NETNS} addr add fd42:99::2/64 dev w0 nodad && \
             ip -n {WORLD_NETNS} link set w0 up && ip -n {WORLD_NETNS} link set lo up && \
             ip route add 169.254.169.254/32 via 198.51.100.2 dev {WORLD_VETH} && \
             ip route add 169.254.170.2/32 via 198.51.100.2 dev {WORLD_VETH}"
        ));
        let mut world = World {
            server: HostCommand::new("ip")
                .args(["netns", "exec", WORLD_NETNS, "python3", "-c", WORLD_SERVER])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        };
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(world.server.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "ready", "the world's servers did not start");
        // The host reaches every world address: a refusal in a sandbox is the firewall's.
        let ipv6: std::net::IpAddr = WORLD_IPV6.parse().unwrap();
        for address in [
            ALLOWED.into(),
            DENIED.into(),
            METADATA.into(),
            TASK_METADATA.into(),
            PRIVATE.into(),
            CGNAT.into(),
            ipv6,
        ] {
            let mut stream = TcpStream::connect_timeout(
                &SocketAddr::from((address, HELLO_PORT)),
                Duration::from_secs(2),
            )
            .unwrap_or_else(|err| panic!("the host cannot reach {address}: {err}"));
            let mut text = String::new();
            std::io::Read::read_to_string(&mut stream, &mut text).unwrap();
            assert_eq!(text, "hello from the world\n");
        }
        world
    }
}

fn remove_world() {
    let _ = sh(&format!(
        "ip netns pids {WORLD_NETNS} 2>/dev/null | xargs -r kill -9; ip netns delete {WORLD_NETNS} 2>/dev/null; ip link delete {WORLD_VETH} 2>/dev/null"
    ));
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        remove_world();
    }
}

fn network_config(checkpoint_wait: Duration) -> NetworkConfig {
    NetworkConfig {
        range: "10.231.0.0/16".parse().unwrap(),
        allow: vec![],
        deny: vec![Ipv4Cidr::new(Ipv4Addr::new(203, 0, 113, 0), 24).unwrap()],
        nameservers: vec![ALLOWED],
        lease_dir: LEASE_DIR.into(),
        netns_workaround: NetnsWorkaround::Auto,
        checkpoint_wait,
    }
}

/// One runtime "host" with networking: its own runsc root and state directory.
struct Host {
    runtime: GvisorRuntime,
    _cleanup: support::RunscCleanup,
    dir: tempfile::TempDir,
}

async fn host_in(dir: tempfile::TempDir, store: Arc<dyn Store>) -> Host {
    host_with(dir, store, network_config(Duration::from_secs(3))).await
}

async fn host_with(dir: tempfile::TempDir, store: Arc<dyn Store>, config: NetworkConfig) -> Host {
    let runtime = support::runtime_with_store(dir.path(), store)
        .await
        .with_network(config)
        .await
        .expect("sandbox networking must start (root, iproute2, iptables)");
    Host {
        runtime,
        _cleanup: support::RunscCleanup(dir.path().join("runsc")),
        dir,
    }
}

async fn host(store: Arc<dyn Store>) -> Host {
    host_in(tempfile::tempdir().unwrap(), store).await
}

fn store(dir: &Path) -> Arc<dyn Store> {
    Arc::new(LocalStore::open(dir).unwrap())
}

fn egress() -> CreateOptions {
    CreateOptions {
        network: NetworkMode::Egress,
        ..CreateOptions::default()
    }
}

/// Runs Python in the sandbox; stdout, with stderr on failure.
async fn python(runtime: &GvisorRuntime, sandbox: &SandboxId, code: &str) -> String {
    let execution = runtime
        .exec(sandbox, ExecRequest::new(Command::Python(code.to_owned())))
        .await
        .unwrap();
    finish(execution).await
}

/// Waits for an execution to exit 0; its stdout, with stderr on failure.
async fn finish(mut execution: Execution) -> String {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), execution.events.recv())
            .await
            .expect("execution timed out")
            .expect("event stream ended without Exited");
        match event {
            ExecEvent::Stdout(data) => stdout.extend_from_slice(&data),
            ExecEvent::Stderr(data) => stderr.extend_from_slice(&data),
            // The runtime alone runs no after-exec hooks.
            ExecEvent::AfterExecFailed(message) => panic!("after-exec hook failed: {message}"),
            ExecEvent::HoldLost => panic!("a runtime never sends HoldLost"),
            // A forced checkpoint killed it: its exit follows.
            ExecEvent::ForceKilled => {}
            ExecEvent::Result(_) => panic!("no rich results were asked for"),
            ExecEvent::Exited(code) => {
                assert_eq!(code, 0, "{}", String::from_utf8_lossy(&stderr));
                return String::from_utf8_lossy(&stdout).trim().to_owned();
            }
        }
    }
}

const PROBE: &str = r#"
import socket, struct
def probe(host, port, timeout=3):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        data = s.recv(100).decode().strip()
        # The world's servers close after their line: wait for that close
        # before closing, so that the sandbox never closes first and keeps
        # no TIME_WAIT endpoint, which this runsc cannot checkpoint for
        # 60 s (a probe that closed first under load made a handoff expire).
        try:
            while s.recv(100):
                pass
        except OSError:
            pass
        s.close()
        return "ok " + data
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "error " + (e.strerror or str(e))
def gateway():
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
"#;

/// What connecting to `host:port` from the sandbox gives: `ok <first line>`,
/// `timeout` or `error <reason>`.
async fn probe(runtime: &GvisorRuntime, sandbox: &SandboxId, host: &str, port: u16) -> String {
    let target = if host == "gateway" {
        "gateway()".to_owned()
    } else {
        format!("{host:?}")
    };
    python(
        runtime,
        sandbox,
        &format!("{PROBE}\nprint(probe({target}, {port}))"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_reaches_the_outside_by_name_and_none_does_not() {
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    let dir = tempfile::tempdir().unwrap();
    let h = host(store(dir.path())).await;
    let (open, closed) = (support::new_id(), support::new_id());
    let started = Instant::now();
    h.runtime.create(&open, &egress()).await.unwrap();
    let egress_took = started.elapsed();
    let started = Instant::now();
    h.runtime
        .create(&closed, &CreateOptions::default())
        .await
        .unwrap();
    eprintln!(
        "create: egress {egress_took:?}, none {:?}",
        started.elapsed()
    );

    let reached = probe(&h.runtime, &open, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(reached, "ok hello from the world");
    // NAT: the world sees the host, not the sandbox's own address (and has no
    // route back to that one anyway).
    let seen_as = probe(&h.runtime, &open, "198.51.100.2", PEER_PORT).await;
    assert_eq!(seen_as, format!("ok peer {HOST_WORLD_ADDRESS}"));
    // DNS: the configured nameserver, through the sandbox's own resolv.conf.
    let resolv = python(&h.runtime, &open, "print(open('/etc/resolv.conf').read())").await;
    assert!(resolv.contains("nameserver 198.51.100.2"), "{resolv}");
    let by_name = probe(&h.runtime, &open, "world.test", HELLO_PORT).await;
    assert_eq!(by_name, "ok hello from the world");

    let isolated = probe(&h.runtime, &closed, "198.51.100.2", HELLO_PORT).await;
    assert!(
        isolated.starts_with("error"),
        "a none sandbox got: {isolated}"
    );

    h.runtime.settle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_denied_cidrs_and_the_host_itself_are_unreachable() {
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    // A service on the host, reachable from the host itself.
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let host_port = listener.local_addr().unwrap().port();
    TcpStream::connect(("127.0.0.1", host_port)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let h = host(store(dir.path())).await;
    let id = support::new_id();
    h.runtime.create(&id, &egress()).await.unwrap();

    let control = probe(&h.runtime, &id, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(control, "ok hello from the world");
    let metadata = probe(&h.runtime, &id, "169.254.169.254", HELLO_PORT).await;
    assert_eq!(
        metadata, "timeout",
        "the metadata server answered a sandbox"
    );
    let task_metadata = probe(&h.runtime, &id, "169.254.170.2", HELLO_PORT).await;
    assert_eq!(
        task_metadata, "timeout",
        "a link-local metadata endpoint answered a sandbox"
    );
    let denied = probe(&h.runtime, &id, "203.0.113.2", HELLO_PORT).await;
    assert_eq!(denied, "timeout", "a denied CIDR answered a sandbox");
    let own_host = probe(&h.runtime, &id, "gateway", host_port).await;
    assert_eq!(
        own_host, "timeout",
        "the host's own service answered a sandbox"
    );

    h.runtime.settle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_networks_are_closed_by_default_and_the_allow_list_opens_them() {
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    let dir = tempfile::tempdir().unwrap();
    // The default policy: no allow list (the internet is open).
    let closed = host(store(dir.path())).await;
    let id = support::new_id();
    closed.runtime.create(&id, &egress()).await.unwrap();
    let control = probe(&closed.runtime, &id, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(control, "ok hello from the world");
    for (address, what) in [(PRIVATE, "a private"), (CGNAT, "a CGNAT")] {
        let reached = probe(&closed.runtime, &id, &address.to_string(), HELLO_PORT).await;
        assert_eq!(
            reached, "timeout",
            "{what} address answered a sandbox by default"
        );
    }
    let ipv6 = probe(&closed.runtime, &id, WORLD_IPV6, HELLO_PORT).await;
    assert!(ipv6.starts_with("error"), "IPv6 reached the world: {ipv6}");

    // The internet plus that one private network.
    let mut config = network_config(Duration::from_secs(3));
    config.allow = vec![
        "0.0.0.0/0".parse().unwrap(),
        "10.99.7.0/24".parse().unwrap(),
    ];
    let opened = host_with(tempfile::tempdir().unwrap(), store(dir.path()), config).await;
    let other = support::new_id();
    opened.runtime.create(&other, &egress()).await.unwrap();
    let private = probe(&opened.runtime, &other, &PRIVATE.to_string(), HELLO_PORT).await;
    assert_eq!(
        private, "ok hello from the world",
        "the allow list did not open 10.99.7.0/24"
    );
    let control = probe(&opened.runtime, &other, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(control, "ok hello from the world");
    let cgnat = probe(&opened.runtime, &other, &CGNAT.to_string(), HELLO_PORT).await;
    assert_eq!(
        cgnat, "timeout",
        "opening one private network opened another"
    );

    closed.runtime.settle().await;
    opened.runtime.settle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_sandbox_moves_to_another_runtime_with_connections_open_and_works_there() {
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    let dir = tempfile::tempdir().unwrap();
    let shared = store(dir.path());
    let a = host(shared.clone()).await;
    let b = host(shared.clone()).await;
    let id = support::new_id();
    a.runtime.create(&id, &egress()).await.unwrap();
    let address_before = python(&a.runtime, &id, &format!("{PROBE}\nprint(gateway())")).await;
    // State to carry over, and a background process with an open connection.
    python(
        &a.runtime,
        &id,
        &format!(
            "open('/tmp/marker', 'w').write('carried')\n\
             import subprocess\n\
             subprocess.Popen(['python3', '-c', 'import socket, time\\ns = socket.create_connection((\"198.51.100.2\", {HOLD_PORT}))\\ns.recv(10)\\ntime.sleep(600)'], start_new_session=True)\n\
             import time\n\
             time.sleep(1)"
        ),
    )
    .await;
    let connections = python(
        &a.runtime,
        &id,
        "print(sum(1 for l in open('/proc/net/tcp').read().splitlines()[1:] if l.split()[3] == '01'))",
    )
    .await;
    assert_eq!(connections, "1", "the background connection is not open");

    let started = Instant::now();
    let manifest = a
        .runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 1,
                name: None,
                force: false,
                keep_executions: false,
            },
        )
        .await
        .expect("an egress sandbox with an open connection checkpoints");
    let checkpoint_took = started.elapsed();
    assert_eq!(manifest.network, NetworkMode::Egress);
    assert!(!a.runtime.is_running(&id));

    b.runtime.restore(&id, &manifest).await.unwrap();
    let marker = python(&b.runtime, &id, "print(open('/tmp/marker').read())").await;
    assert_eq!(marker, "carried");
    let reached = probe(&b.runtime, &id, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(
        reached, "ok hello from the world",
        "no network after restore"
    );
    let denied = probe(&b.runtime, &id, "203.0.113.2", HELLO_PORT).await;
    assert_eq!(denied, "timeout", "the restored sandbox escaped the policy");
    let address_after = python(&b.runtime, &id, &format!("{PROBE}\nprint(gateway())")).await;
    eprintln!(
        "checkpoint with an open connection took {checkpoint_took:?}; gateway {address_before} -> {address_after}"
    );
    a.runtime.settle().await;
    b.runtime.settle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_this_runsc_would_fail_is_refused_and_the_sandbox_keeps_running() {
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    let dir = tempfile::tempdir().unwrap();
    let h = host(store(dir.path())).await;
    let id = support::new_id();
    h.runtime.create(&id, &egress()).await.unwrap();
    // The sandbox closes first: its netstack keeps a TIME_WAIT endpoint for
    // 60 s, which this runsc cannot save and which no reset removes.
    let local = python(
        &h.runtime,
        &id,
        &format!(
            "import socket\ns = socket.create_connection(('198.51.100.2', {HOLD_PORT}))\ns.recv(10)\nprint('%s %d' % s.getsockname())\ns.close()\nimport time\ntime.sleep(0.5)"
        ),
    )
    .await;
    // The forced checkpoint below must find the close: wait until the
    // host's connection table shows it, where the checkpoint's guard looks
    // for it.
    let (ip, port) = local.split_once(' ').expect("the connection's address");
    let entry = format!("src={ip} dst=198.51.100.2 sport={port} dport={HOLD_PORT}");
    let asked = Instant::now();
    while !std::fs::read_to_string("/proc/net/nf_conntrack")
        .unwrap_or_default()
        .lines()
        .any(|line| line.contains(&entry) && !line.contains("ESTABLISHED"))
    {
        assert!(
            asked.elapsed() < Duration::from_secs(20),
            "the host never saw the sandbox close {entry}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Even a forced checkpoint, which kills a running execution, is refused
    // before it kills anything.
    let running = h
        .runtime
        .exec(
            &id,
            ExecRequest::new(Command::Python(
                "import time\ntime.sleep(3)\nprint('survived')".to_owned(),
            )),
        )
        .await
        .unwrap();
    let err = h
        .runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 1,
                name: None,
                force: true,
                keep_executions: false,
            },
        )
        .await
        .expect_err("a checkpoint now would stop the sandbox");
    let message = err.to_string();
    // What the guard saw, should the execution not survive.
    let table: Vec<String> = std::fs::read_to_string("/proc/net/nf_conntrack")
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains(&format!("src={ip} ")))
        .map(str::to_owned)
        .collect();
    assert_eq!(
        finish(running).await,
        "survived",
        "the refused checkpoint killed the execution; refused with {message:?}; the sandbox's \
         connections now: {table:#?}"
    );
    // TIME_WAIT once the close is over; FIN_WAIT while the world's FIN is
    // still on its way (a slow machine). Both are refused the same way.
    assert!(
        (message.contains("TIME_WAIT to") || message.contains("FIN_WAIT to"))
            && message.contains("retry in"),
        "{message}"
    );
    assert!(
        h.runtime.is_running(&id),
        "the refused checkpoint lost the sandbox"
    );
    let reached = probe(&h.runtime, &id, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(
        reached, "ok hello from the world",
        "the network stayed quiesced"
    );

    // Once gVisor's 60 s are over, the same sandbox checkpoints (and restores):
    // the guard's estimate is long enough, or this runsc would have failed
    // the checkpoint and the sandbox would be reported lost here. A FIN_WAIT
    // seen first may turn into a TIME_WAIT with a later deadline: a second
    // refusal is allowed, never a loss.
    let mut message = message;
    let mut attempts = 0;
    let manifest = loop {
        let retry_in: u64 = message
            .split("retry in ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|seconds| seconds.parse().ok())
            .expect("the refusal says when to retry");
        assert!(retry_in <= 62, "{message}");
        tokio::time::sleep(Duration::from_secs(retry_in + 1)).await;
        attempts += 1;
        match h
            .runtime
            .checkpoint(
                &id,
                CheckpointRequest {
                    checkpoint_id: support::new_id(),
                    epoch: 1,
                    name: None,
                    force: false,
                    keep_executions: false,
                },
            )
            .await
        {
            Ok(manifest) => break manifest,
            Err(err) => {
                message = err.to_string();
                assert!(
                    attempts < 2 && message.contains("retry in") && h.runtime.is_running(&id),
                    "the checkpoint did not succeed once the closes were over: {message}"
                );
            }
        }
    };
    h.runtime.restore(&id, &manifest).await.unwrap();
    let reached = probe(&h.runtime, &id, "198.51.100.2", HELLO_PORT).await;
    assert_eq!(reached, "ok hello from the world");
    h.runtime.settle().await;
}

/// A nat `PREROUTING` rule for sandbox interfaces, removed on drop: the
/// host's own DNAT, as Docker's published ports or Kubernetes services add.
struct HostDnat {
    rule: String,
    comment: String,
}

impl HostDnat {
    /// `matches` then `-j DNAT --to-destination to`.
    fn add(name: &str, matches: &str, to: &str) -> Self {
        let comment = format!("sbxtest-dnat-{name}");
        let rule = format!(
            "PREROUTING -i sbxd+ {matches} -m comment --comment {comment} -j DNAT --to-destination {to}"
        );
        must(&format!("iptables -w -t nat -I {rule}"));
        Self { rule, comment }
    }

    /// Packets the rule rewrote so far (`-S -v` ends a rule's match with
    /// `-c <packets> <bytes>`).
    fn packets(&self) -> u64 {
        sh("iptables -w -t nat -S PREROUTING -v")
            .lines()
            .find(|line| line.contains(&format!("--comment {} ", self.comment)))
            .and_then(|line| line.split(" -c ").nth(1))
            .and_then(|counters| counters.split_whitespace().next())
            .and_then(|packets| packets.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for HostDnat {
    fn drop(&mut self) {
        let _ = sh(&format!("iptables -w -t nat -D {}", self.rule));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_hosts_nat_redirects_is_refused_but_dns_through_it_works() {
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    // A "published port" on the host's own address, forwarded to an allowed
    // destination: without the DNAT rule in the sandbox's chain the policy
    // would judge 198.51.100.2 and let it through to the host's service.
    let published = HostDnat::add(
        "published",
        "-d 198.51.100.1/32 -p tcp --dport 8101",
        "198.51.100.2:8001",
    );
    // A nameserver reached through the host's NAT (a Kubernetes DNS service).
    let _dns = HostDnat::add(
        "dns",
        "-d 192.0.2.53/32 -p udp --dport 53",
        "198.51.100.2:53",
    );
    let dir = tempfile::tempdir().unwrap();
    let mut config = network_config(Duration::from_secs(3));
    config.nameservers = vec![Ipv4Addr::new(192, 0, 2, 53)];
    let h = host_with(tempfile::tempdir().unwrap(), store(dir.path()), config).await;
    let id = support::new_id();
    h.runtime.create(&id, &egress()).await.unwrap();

    let by_name = probe(&h.runtime, &id, "world.test", HELLO_PORT).await;
    assert_eq!(
        by_name, "ok hello from the world",
        "DNS through the host's NAT"
    );
    let before = published.packets();
    let redirected = probe(&h.runtime, &id, "198.51.100.1", 8101).await;
    assert_eq!(
        redirected, "timeout",
        "a sandbox reached a service through the host's DNAT"
    );
    assert!(
        published.packets() > before,
        "the host's DNAT rule never saw the sandbox's connection"
    );
    h.runtime.settle().await;
}

/// Our namespaces, veths and iptables lines (rules and chains) on this host.
fn host_resources() -> (usize, usize, usize) {
    let netns = sh("ip netns list")
        .lines()
        .filter(|l| l.starts_with("sandboxd-"))
        .count();
    let veths = sh("ip -o link show")
        .lines()
        .filter(|l| {
            l.split(':')
                .nth(1)
                .is_some_and(|n| n.trim().starts_with("sbxd"))
        })
        .count();
    let rules = sh("iptables-save")
        .lines()
        .filter(|l| {
            l.contains("sandboxd:")
                || l.strip_prefix(":SANDBOXD-")
                    .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    (netns, veths, rules)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_creates_and_destroys_leave_nothing_behind() {
    let _serial = NETWORK.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let h = host(store(dir.path())).await;
    let before = host_resources();
    let leases_before = std::fs::read_dir(LEASE_DIR).unwrap().count();
    for _round in 0..5 {
        let ids: Vec<SandboxId> = (0..4).map(|_| support::new_id()).collect();
        let options = egress();
        let creates = ids.iter().map(|id| h.runtime.create(id, &options));
        for created in futures::future::join_all(creates).await {
            created.unwrap();
        }
        // (Earlier rounds may still be tearing down in the background.)
        let during = host_resources();
        assert!(during.0 >= before.0 + 4, "one namespace per sandbox");
        assert!(during.1 >= before.1 + 4, "one veth per sandbox");
        for id in &ids {
            h.runtime.destroy(id).await.unwrap();
        }
    }
    h.runtime.settle().await;
    assert_eq!(
        host_resources(),
        before,
        "(namespaces, veths, iptables lines)"
    );
    assert_eq!(std::fs::read_dir(LEASE_DIR).unwrap().count(), leases_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_removes_what_a_crashed_server_left() {
    let _serial = NETWORK.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let shared = store(dir.path());
    let before = host_resources();
    // A server that dies with an egress sandbox running: nothing cleaned up.
    let crashed = host(shared.clone()).await;
    let id = support::new_id();
    crashed.runtime.create(&id, &egress()).await.unwrap();
    let Host {
        runtime,
        dir: state,
        _cleanup: cleanup,
    } = crashed;
    std::mem::forget(runtime);
    // runsc containers of the crashed run go when this test ends, whatever happens.
    let _cleanup = cleanup;
    // And resources nobody leases, as a crash between steps could leave.
    must(
        "ip netns add sandboxd-16001 && ip link add sbxd16002 type veth peer name sbxtp16002 && \
         iptables -w -N SANDBOXD-16003-EGRESS && \
         iptables -w -A SANDBOXD-FORWARD -i sbxd16003 -m comment --comment sandboxd:16003 -j SANDBOXD-16003-EGRESS && \
         iptables -w -t nat -A SANDBOXD-POSTROUTING -s 10.231.250.14/32 -m comment --comment sandboxd:16003 -j MASQUERADE",
    );
    let leftover = host_resources();
    assert_eq!(leftover.0, before.0 + 2);
    assert_eq!(leftover.1, before.1 + 2);
    assert!(leftover.2 > before.2 + 5);

    // The next server in the same state directory.
    let restarted = host_in(state, shared).await;
    assert_eq!(
        host_resources(),
        before,
        "(namespaces, veths, iptables lines)"
    );
    restarted.runtime.settle().await;
}

/// The stdout of one execution over a WebSocket.
async fn ws_stdout(ws: &mut support::ws::Ws, code: &str) -> String {
    let frames = support::ws::merge_chunks(ws.exec("python", code).await);
    frames
        .iter()
        .find_map(|f| f.strip_prefix("stdout:"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_between_server_processes_brings_the_network_back() {
    use support::process::Launch;
    let _serial = NETWORK.lock().await;
    let _world = World::start();
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let network = [
        "--network-modes",
        "none,egress",
        "--network-deny",
        "203.0.113.0/24",
        "--network-nameservers",
        "198.51.100.2",
        "--network-lease-dir",
        LEASE_DIR,
    ];
    // A handoff does not wait for the lease (the holder releases it), so a
    // longer one costs nothing here and keeps a slow checkpoint on a loaded
    // machine from looking like a dead holder.
    let leases = [
        "--lease-duration-s",
        "20",
        "--clock-skew-s",
        "1",
        "--renew-interval-s",
        "2",
        "--resync-interval-s",
        "2",
    ];
    let mut a = Launch::new("net-a", dir.path())
        .on_bucket(&bucket)
        .with_args(&leases)
        .with_args(&network)
        .start()
        .await;
    let mut b = Launch::new("net-b", dir.path())
        .on_bucket(&bucket)
        .with_args(&leases)
        .with_args(&network)
        .start()
        .await;
    // (Starting removed whatever earlier, killed runs left.)
    let before = host_resources();
    let init = serde_json::json!({
        "idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true,
        "network": "egress",
    });
    let (mut ws, id, token) = a.create(init).await;
    let probe_world = format!("{PROBE}\nprint(probe('world.test', {HELLO_PORT}))");
    assert_eq!(
        ws_stdout(&mut ws, &probe_world).await,
        "ok hello from the world"
    );
    // A connection held open by a background process when the handoff comes.
    let hold = format!(
        "import subprocess\nsubprocess.Popen(['python3', '-c', 'import socket, time\\ns = socket.create_connection((\"198.51.100.2\", {HOLD_PORT}))\\ns.recv(10)\\ntime.sleep(600)'], start_new_session=True)\nimport time\ntime.sleep(1)\nprint('holding')"
    );
    assert_eq!(ws_stdout(&mut ws, &hold).await, "holding");
    drop(ws);

    let mut ws = b.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    // A miss here has come only on a loaded CI machine: say what A did.
    assert_eq!(
        frames.last().map(String::as_str),
        Some("SANDBOX_RUNNING"),
        "{frames:?}\nnet-a's log ends:\n{}",
        log_tail(&dir.path().join("net-a/sandboxd.log"), 40)
    );
    assert_eq!(
        ws_stdout(&mut ws, &probe_world).await,
        "ok hello from the world",
        "no network after the handoff"
    );
    let denied = format!("{PROBE}\nprint(probe('203.0.113.2', {HELLO_PORT}))");
    assert_eq!(ws_stdout(&mut ws, &denied).await, "timeout");

    // Shutdown drains (checkpoints) the sandbox: both servers leave the host clean.
    b.signal("-TERM");
    a.signal("-TERM");
    assert_eq!(
        host_resources(),
        before,
        "(namespaces, veths, iptables lines)"
    );
}

/// The last `lines` lines of a server's log, without colours.
fn log_tail(path: &Path, lines: usize) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_else(|err| format!("(unreadable: {err})"));
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|line| {
            let mut plain = String::with_capacity(line.len());
            let mut chars = line.chars();
            while let Some(c) = chars.next() {
                if c == '\u{1b}' {
                    chars.by_ref().find(|c| *c == 'm');
                } else {
                    plain.push(c);
                }
            }
            plain
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn a_server_asked_for_egress_it_cannot_provide_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .args(["serve", "--listen", "127.0.0.1:0", "--runtime-dir"])
        .arg(dir.path().join("run"))
        .args([
            "--network-modes",
            "none,egress",
            "--network-range",
            "10.231.0.0/31",
        ])
        .current_dir(dir.path())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success(), "the server started anyway");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("10.231.0.0/31"), "{stderr}");
    let bad_mode = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--network-modes",
            "bridge",
        ])
        .current_dir(dir.path())
        .output()
        .await
        .unwrap();
    assert!(!bad_mode.status.success());
    assert!(
        String::from_utf8_lossy(&bad_mode.stderr).contains("bridge"),
        "{}",
        String::from_utf8_lossy(&bad_mode.stderr)
    );
}
