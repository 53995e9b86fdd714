//! Nothing one tenant does takes the instance from the others: each test
//! plays a hostile client against a real server (the `sandboxd` binary or
//! one built by the composition root) on real runsc, with real WebSocket
//! and HTTP clients, and measures what the others are left with.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::ws::Ws;

/// The resident memory of process `pid` in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("VmRSS");
    kib / 1024
}

/// `sandboxd serve` as a process on a local store, with `args`.
async fn server_process(
    dir: &std::path::Path,
    name: &str,
    args: &[&str],
) -> testkit::ServerProcess {
    testkit::Launch::new(env!("CARGO_BIN_EXE_sandboxd"), name, dir)
        .on_local_store()
        .with_args(args)
        .start()
        .await
        .unwrap_or_else(|err| panic!("{err}"))
}

async fn create(addr: &str) -> (Ws, String, String) {
    let mut ws = Ws::connect(&format!("ws://{addr}/create")).await;
    ws.send(json!({})).await;
    let (mut id, mut token) = (String::new(), String::new());
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

/// Row 1: a client that stops reading and asks for 400 reads of 4 MiB
/// (about 5.6 MB of base64 each) holds at most its reply budget of the
/// server's memory, is closed with 1008 once it read nothing for the stall
/// timeout, and the memory is back after the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_replies_hold_a_bounded_budget_and_a_stalled_reader_is_closed() {
    const STALL_S: u64 = 6;
    let dir = tempfile::tempdir().unwrap();
    let budget = std::env::var("TENANT_TEST_REPLY_BUDGET").unwrap_or_else(|_| "16777216".into());
    let server = server_process(
        dir.path(),
        "replies",
        &[
            "--ws-stall-timeout-s",
            &STALL_S.to_string(),
            "--ws-reply-budget-bytes",
            &budget,
        ],
    )
    .await;
    let pid = server.child.id();
    let (mut ws, _, _) = create(&server.addr).await;
    let frames = ws
        .exec(
            "bash",
            "head -c 4194304 /dev/urandom > /home/sandbox/big && echo made",
        )
        .await;
    assert!(frames.iter().any(|f| f == "stdout:made\n"), "{frames:?}");
    let before = rss_mib(pid);

    for n in 0..400 {
        ws.send(json!({"action": "fs_read", "request_id": format!("r{n}"),
                       "path": "/home/sandbox/big", "length": 4_194_304}))
            .await;
    }
    // The client reads nothing for a while; the server's memory meanwhile.
    let sent = Instant::now();
    let mut peak = before;
    while sent.elapsed() < Duration::from_secs(STALL_S + 2) {
        peak = peak.max(rss_mib(pid));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Reading again: what was written before the stall, then the close.
    let mut replies = 0;
    let close = loop {
        match ws.next_raw().await {
            Some(tokio_tungstenite::tungstenite::Message::Text(_)) => replies += 1,
            Some(tokio_tungstenite::tungstenite::Message::Close(frame)) => {
                break frame.map(|f| (u16::from(f.code), f.reason.as_str().to_owned()));
            }
            Some(_) => {}
            None => break None,
        }
    };
    drop(ws);
    let mut after = rss_mib(pid);
    let closed = Instant::now();
    while after > before + 64 && closed.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = rss_mib(pid);
    }
    eprintln!(
        "server RSS: {before} MiB before, {peak} MiB peak while 400 reads of 4 MiB waited, \
         {after} MiB after the close; {replies} replies delivered; close {close:?}"
    );
    assert!(replies < 400, "all {replies} replies were delivered");
    assert!(
        peak < before + 100 && peak < 300,
        "the server grew from {before} MiB to {peak} MiB"
    );
    assert!(
        after < before + 64,
        "the server kept {after} MiB (from {before} MiB)"
    );
    let (code, reason) = close.expect("a close frame");
    assert_eq!(code, 1008, "{reason}");
    assert!(reason.contains("read nothing"), "{reason}");
}

/// A server without a runtime (it answers health checks and handshakes),
/// with `adjust` applied to its parts; its address.
async fn plain_server(adjust: impl FnOnce(&mut sandboxd::server::Parts)) -> String {
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(controllers::testing::MemoryStore::new());
    let server = support::server_counted("plain", store, None, std::sync::Arc::default(), adjust);
    support::serve(server).await
}

/// Reads `stream` until it ends (EOF or reset); how long that took.
async fn until_closed(mut stream: tokio::net::TcpStream, within: Duration) -> Option<Duration> {
    use tokio::io::AsyncReadExt as _;
    let started = Instant::now();
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout_at(
            tokio::time::Instant::from_std(started + within),
            stream.read(&mut buf),
        )
        .await
        {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Row 3: 4,100 connections that send nothing (more than the server's
/// 4,096 connection permits) leave `/status` answering before any of them
/// reached its idle deadline (the connection idle the longest makes room;
/// without that, the request would wait for that deadline), and all of them are closed
/// after the idle timeout; a client that dribbles its headers is closed at
/// the header-read timeout; a WebSocket client that answers no ping is
/// closed at the ping timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_never_keep_a_request_out_and_are_closed_at_their_deadlines() {
    const IDLE: Duration = Duration::from_secs(8);
    const HEADERS: Duration = Duration::from_secs(2);
    const IDLE_SOCKETS: usize = 4_100;
    let (soft, _) = rlimit_nofile();
    assert!(
        soft >= 2 * IDLE_SOCKETS as u64 + 200,
        "this test needs {} file descriptors (client and server ends); RLIMIT_NOFILE is {soft}",
        2 * IDLE_SOCKETS + 200
    );
    let addr = plain_server(|parts| {
        parts.connection_deadlines = sandboxd::server::ConnectionDeadlines {
            header_read: HEADERS,
            idle: IDLE,
        };
        parts.socket.ping_interval = Duration::from_millis(500);
        parts.socket.ping_timeout = Duration::from_secs(2);
    })
    .await;
    let opened = Instant::now();
    let mut idle = Vec::with_capacity(IDLE_SOCKETS);
    for _ in 0..IDLE_SOCKETS {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let opening = opened.elapsed();

    let client = testkit::http_client();
    let asked = Instant::now();
    let status = tokio::time::timeout(
        Duration::from_secs(5),
        client.get(format!("http://{addr}/status")).send(),
    )
    .await;
    let (answered, since_first) = (asked.elapsed(), opened.elapsed());
    eprintln!(
        "{IDLE_SOCKETS} idle connections opened in {opening:?}; /status answered in {answered:?}"
    );
    let status = status.expect("/status answered within 5 s").unwrap();
    assert!(status.status().is_success());
    // Measured against the deadline it would otherwise have waited for,
    // not a fixed second: a loaded machine may be slow to open the sockets.
    assert!(
        since_first < IDLE - Duration::from_secs(1),
        "/status took {answered:?} with {IDLE_SOCKETS} idle connections open, \
         {since_first:?} after the first opened: it waited for an idle deadline ({IDLE:?})"
    );

    // A client that dribbles a request's headers, one byte at a time.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let dribble = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt as _;
        let started = Instant::now();
        for byte in b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: "
            .iter()
            .cycle()
        {
            if slow.write_all(&[*byte]).await.is_err() {
                return Some(started.elapsed());
            }
            if started.elapsed() > Duration::from_secs(30) {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    });
    // A WebSocket client that upgrades and then never answers a ping (its
    // bytes are read raw below, so nothing answers them).
    let mut deaf = tokio::net::TcpStream::connect(&addr).await.unwrap();
    {
        use tokio::io::AsyncWriteExt as _;
        deaf.write_all(
            b"GET /create HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        .await
        .unwrap();
    }
    let deaf_since = Instant::now();

    let waits: Vec<_> = idle
        .into_iter()
        .map(|stream| tokio::spawn(until_closed(stream, IDLE * 4)))
        .collect();
    let mut latest = Duration::ZERO;
    let mut open = 0;
    for wait in waits {
        match wait.await.unwrap() {
            Some(after) => latest = latest.max(after),
            None => open += 1,
        }
    }
    let closed_after = opened.elapsed();
    eprintln!("the idle connections were closed by {closed_after:?} after the first opened");
    assert_eq!(
        open,
        0,
        "{open} idle connections still open after {:?}",
        IDLE * 4
    );
    let slow_closed = dribble.await.unwrap();
    eprintln!("the dribbling client was cut off after {slow_closed:?}");
    let slow_closed = slow_closed.expect("the dribbling client was never cut off");
    assert!(
        slow_closed >= HEADERS && slow_closed < HEADERS + IDLE,
        "cut off after {slow_closed:?}"
    );
    let deaf_closed = until_closed(deaf, Duration::from_secs(20)).await;
    eprintln!(
        "the WebSocket client that answers no ping was closed {:?} after it connected",
        deaf_closed.map(|_| deaf_since.elapsed())
    );
    assert!(
        deaf_closed.is_some(),
        "a deaf WebSocket client stayed connected"
    );
}

/// This process's RLIMIT_NOFILE (soft, hard), from /proc.
fn rlimit_nofile() -> (u64, u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<u64> = line
        .split_whitespace()
        .filter_map(|word| word.parse().ok())
        .collect();
    (numbers[0], numbers[1])
}

/// A JSON-RPC client of `sandboxctl mcp` over its stdio (one message a line).
struct McpClient {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    next_id: u64,
}

impl McpClient {
    async fn start(url: &str) -> Self {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandboxctl"))
            .args(["mcp", "--url", url])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("sandboxctl mcp starts");
        let stdin = child.stdin.take().unwrap();
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut client = Self {
            child,
            stdin,
            lines,
            next_id: 1,
        };
        client
            .request(
                "initialize",
                json!({"protocolVersion": "2025-03-26", "capabilities": {},
                       "clientInfo": {"name": "tenant-limits", "version": "1"}}),
            )
            .await;
        client
            .send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        client
    }

    async fn send(&mut self, message: serde_json::Value) {
        use tokio::io::AsyncWriteExt as _;
        let mut line = message.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
    }

    /// Sends a request and returns its response's `result`.
    async fn request(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        let id = self.next_id;
        self.next_id += 1;
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        loop {
            let line = tokio::time::timeout(Duration::from_secs(120), self.lines.next_line())
                .await
                .expect("an MCP answer within 120 s")
                .unwrap()
                .expect("sandboxctl mcp ended");
            let message: serde_json::Value = serde_json::from_str(&line).unwrap();
            if message["id"] == json!(id) {
                assert!(message.get("error").is_none(), "{message}");
                return message["result"].clone();
            }
        }
    }

    async fn tool(&mut self, name: &str, arguments: serde_json::Value) -> serde_json::Value {
        self.request("tools/call", json!({"name": name, "arguments": arguments}))
            .await
    }

    /// Ends the process; its stderr.
    async fn stop(mut self) -> String {
        use tokio::io::AsyncReadExt as _;
        drop(self.stdin);
        let mut stderr = String::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            let _ = tokio::time::timeout(Duration::from_secs(20), pipe.read_to_string(&mut stderr))
                .await;
        }
        let _ = self.child.kill().await;
        stderr
    }
}

/// Every `key=value` of a query string in `text` whose value is not the
/// redaction marker.
fn unredacted_query_values(text: &str) -> Vec<String> {
    text.split(['?', '&'])
        .skip(1)
        .filter_map(|part| part.split_once('='))
        .map(|(_, value)| value.split([' ', ':', '"', ')', '\n']).next().unwrap_or(""))
        .filter(|value| !value.is_empty() && *value != "REDACTED")
        .map(str::to_owned)
        .collect()
}

/// Row 4: a sandbox created and checkpointed through `sandboxctl mcp`,
/// then its server gone: `run_code` fails with a result that names the
/// server but holds no token (nor does anything the MCP server logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_error_with_the_server_down_holds_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = server_process(dir.path(), "mcp-down", &[]).await;
    let url = format!("ws://{}", server.addr);
    let mut mcp = McpClient::start(&url).await;
    let created = mcp.tool("create_sandbox", json!({})).await;
    let id = created["structuredContent"]["sandbox_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{created}"))
        .to_owned();
    let checkpointed = mcp
        .tool("checkpoint_sandbox", json!({"sandbox_id": id}))
        .await;
    assert_ne!(checkpointed["isError"], json!(true), "{checkpointed}");
    server.signal("-KILL").unwrap();

    let result = mcp
        .tool(
            "run_code",
            json!({"sandbox_id": id, "language": "bash", "code": "echo hi"}),
        )
        .await;
    let text = result.to_string();
    eprintln!("run_code with the server down: {text}");
    assert_eq!(result["isError"], json!(true), "{text}");
    assert!(text.contains("cannot connect to"), "{text}");
    assert!(text.contains(&format!("/attach/{id}")), "{text}");
    let leaked = unredacted_query_values(&text);
    assert!(
        leaked.is_empty(),
        "query values in the tool result: {leaked:?}: {text}"
    );
    let stderr = mcp.stop().await;
    let leaked = unredacted_query_values(&stderr);
    assert!(
        leaked.is_empty(),
        "query values on stderr: {leaked:?}: {stderr}"
    );
}

/// Row 6: 40 creates naming a snapshot or an image that does not exist are
/// refused naming what is missing, and leave no record in the bucket; a
/// good create after them still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_that_fail_validation_leave_no_record() {
    let server = support::ws::Server::start().await;
    let records = || async {
        server
            .store
            .list_all(controllers::layout::SANDBOXES_PREFIX)
            .await
            .unwrap()
            .len()
    };
    assert_eq!(records().await, 0);
    for n in 0..40 {
        let init = if n % 2 == 0 {
            json!({"filesystem_snapshot_name": format!("never-taken-{n}")})
        } else {
            json!({"image": format!("no-such-image-{n}")})
        };
        let mut ws = server.connect("/create").await;
        ws.send(init).await;
        let frames = ws.until_close().await;
        assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
        let expected = if n % 2 == 0 {
            "no filesystem snapshot named"
        } else {
            "no sandbox image"
        };
        assert!(frames[2].contains(expected), "{frames:?}");
    }
    let left = records().await;
    eprintln!("40 failed creates left {left} objects under sandboxes/");
    assert_eq!(left, 0, "failed creates left records");
    let (mut ws, _, _) = server.create(json!({})).await;
    let frames = ws.exec("bash", "echo alive").await;
    assert!(frames.contains(&"stdout:alive\n".to_owned()), "{frames:?}");
}

/// Connects a WebSocket to `url` with `origin`; the handshake's HTTP status
/// when it was refused, `None` when it upgraded.
async fn ws_with_origin(url: &str, origin: Option<&str>) -> Option<u16> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let mut request = url.into_client_request().unwrap();
    if let Some(origin) = origin {
        request
            .headers_mut()
            .insert("origin", origin.parse().unwrap());
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok(_) => None,
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Some(response.status().as_u16())
        }
        Err(err) => panic!("{url}: {err}"),
    }
}

/// Row 8: a browser page on another origin can neither open a WebSocket nor
/// send an HTTP request; the server's own origin, an allowed one and
/// clients that send no `Origin` (the earlier clients) are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_from_a_foreign_browser_origin_are_refused() {
    let addr = plain_server(|parts| {
        parts.origins.allowed = vec!["https://app.example".to_owned()];
    })
    .await;
    let create = format!("ws://{addr}/create");
    assert_eq!(
        ws_with_origin(&create, Some("http://evil.example")).await,
        Some(403)
    );
    assert_eq!(ws_with_origin(&create, None).await, None);
    assert_eq!(
        ws_with_origin(&create, Some("https://app.example")).await,
        None
    );
    assert_eq!(
        ws_with_origin(&create, Some(&format!("http://{addr}"))).await,
        None
    );
    let client = testkit::http_client();
    let foreign = client
        .post(format!("http://{addr}/execute?language=bash"))
        .header("origin", "http://evil.example")
        .body("echo hi")
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status().as_u16(), 403);
    let body = foreign.text().await.unwrap();
    assert!(body.contains("--allowed-origins"), "{body}");
    let plain = client
        .get(format!("http://{addr}/status"))
        .send()
        .await
        .unwrap();
    assert!(plain.status().is_success());
}

/// Row 5: code that allocates 700 MB in a sandbox of 512 MiB gets a
/// `MemoryError` inside the guest (its address space is capped below the
/// sandbox's memory limit) instead of the host killing the whole sandbox:
/// the sandbox keeps running and the next execution works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_past_the_memory_limit_fails_in_the_guest_and_the_sandbox_lives() {
    support::SANDBOX_MEMORY_BYTES.with(|bytes| bytes.set(512 << 20));
    let server = support::ws::Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    let frames = ws
        .exec(
            "python",
            "import os\nb = bytearray(700 * 1024 * 1024)\nprint(len(b))",
        )
        .await;
    eprintln!("700 MB in a 512 MiB sandbox: {frames:?}");
    let text = frames.join("\n");
    assert!(text.contains("MemoryError"), "{frames:?}");
    assert!(frames.iter().any(|f| f == "exit_code:1"), "{frames:?}");
    let frames = ws.exec("bash", "echo still-here").await;
    assert!(
        frames.iter().any(|f| f == "stdout:still-here\n"),
        "the sandbox did not survive: {frames:?}"
    );
}

/// Row 4: a 700 MB upload through the HTTP file API into a sandbox of
/// 512 MiB (its disk budget: half of that) ends at the budget with `507`,
/// `ENOSPC` and "disk full" (before, the root overlay held it in memory,
/// the host's memory cgroup killed the whole sandbox and the upload got
/// `503 … attach again`); user code writing past it in its home and in
/// `/var/tmp` gets `ENOSPC` too, and the sandbox runs on with its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_past_the_disk_budget_get_disk_full_and_the_sandbox_lives() {
    support::SANDBOX_MEMORY_BYTES.with(|bytes| bytes.set(512 << 20));
    let server = support::ws::Server::start().await;
    let (mut ws, id, token) = server.create(json!({})).await;
    let frames = ws.exec("bash", "echo state before > /tmp/kept").await;
    assert!(frames.iter().any(|f| f == "exit_code:0"), "{frames:?}");
    drop(ws);

    let started = Instant::now();
    let put = testkit::http_client()
        .put(format!(
            "http://{}/sandboxes/{id}/files/content",
            server.addr
        ))
        .query(&[("path", "big.bin")])
        .header("X-Sandbox-Token", &token)
        .body(vec![b'A'; 700 << 20])
        .send()
        .await
        .expect("an answer to the upload");
    let status = put.status();
    let body: serde_json::Value = put.json().await.expect("a JSON answer");
    eprintln!(
        "700 MB upload into a 512 MiB sandbox: {status} {body} after {:?}",
        started.elapsed()
    );
    assert_eq!(status, 507, "{body}");
    assert_eq!(body["code"], "ENOSPC", "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains("disk full"), "{body}");
    assert!(!message.contains("attach again"), "{body}");

    let mut ws = server.attach(&id, &token).await;
    let frames = ws
        .exec(
            "bash",
            "ls -a ~ | grep -c sandboxd-upload; head -c 700M /dev/zero > ~/f; \
             head -c 700M /dev/zero > /var/tmp/f; rm -f ~/f /var/tmp/f; echo still-here",
        )
        .await;
    eprintln!("700 MB written by user code: {frames:?}");
    let text = frames.join("\n");
    assert!(
        text.contains("stdout:0\n"),
        "the upload left its temporary: {frames:?}"
    );
    assert_eq!(
        text.matches("No space left on device").count(),
        2,
        "{frames:?}"
    );
    assert!(text.contains("stdout:still-here"), "{frames:?}");
    let frames = ws.exec("bash", "cat /tmp/kept").await;
    assert!(
        frames.iter().any(|f| f == "stdout:state before\n"),
        "the sandbox did not survive: {frames:?}"
    );
}

/// Row 4: a terminal that writes as fast as it can (64 KiB lines in a loop
/// for 20 s) while the client reads: the server's memory stays bounded, the
/// sandbox (512 MiB) is not killed (the agent holds the terminal's session
/// while it cannot keep up, `sandbox_agent/flow.py`), the writer ends on its
/// own and the sandbox keeps its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_flood_keeps_the_server_bounded_and_the_sandbox_alive() {
    const FLOOD_S: u64 = 20;
    let dir = tempfile::tempdir().unwrap();
    let server = server_process(dir.path(), "flood", &["--sandbox-memory-mb", "512"]).await;
    let pid = server.child.id();
    let (mut ws, _, _) = create(&server.addr).await;
    let frames = ws.exec("bash", "echo state before > /tmp/kept").await;
    assert!(frames.iter().any(|f| f == "exit_code:0"), "{frames:?}");
    let before = rss_mib(pid);
    let code = format!(
        "python3 -c \"import os, time\nend = time.time() + {FLOOD_S}\nwhile time.time() < end: \
         os.write(1, b'A' * 65535 + b'\\n')\"; echo flood-over"
    );
    ws.send(json!({"language": "bash", "code": code, "pty": {"cols": 80, "rows": 24}}))
        .await;
    let started = Instant::now();
    let (mut peak, mut bytes, mut frames) = (before, 0usize, Vec::new());
    let mut sampled = Instant::now();
    loop {
        let frame = ws.next_value().await;
        if frame["event"] == "stdout" {
            bytes += frame["data"].as_str().map_or(0, str::len);
        } else if frame["event"] != "stderr" {
            // Output a client that falls behind loses comes as stderr notices.
            frames.push(frame.to_string());
        }
        if sampled.elapsed() > Duration::from_millis(100) {
            peak = peak.max(rss_mib(pid));
            sampled = Instant::now();
        }
        if frame["status"] == "SANDBOX_EXECUTION_DONE"
            || frame["status"]
                .as_str()
                .is_some_and(|s| s.ends_with("_ERROR"))
            || started.elapsed() > Duration::from_secs(FLOOD_S * 6)
        {
            break;
        }
    }
    let took = started.elapsed();
    peak = peak.max(rss_mib(pid));
    eprintln!(
        "terminal flood: {} MB read in {took:?}; server RSS {before} MiB before, {peak} MiB peak; \
         frames other than output: {frames:?}",
        bytes / 1_000_000
    );
    // Exit code 0: the writer ended on its own and `echo` ran after it (its
    // line itself may be among output dropped for a reader that fell behind).
    assert!(
        frames.iter().any(|f| f.contains("\"exit_code\":0")),
        "{frames:?}"
    );
    assert!(
        frames.iter().any(|f| f.contains("SANDBOX_EXECUTION_DONE")),
        "{frames:?}"
    );
    assert!(
        peak < before + 100,
        "the server grew from {before} MiB to {peak} MiB"
    );
    let frames = ws.exec("bash", "cat /tmp/kept").await;
    assert!(
        frames.iter().any(|f| f == "stdout:state before\n"),
        "the sandbox did not survive: {frames:?}"
    );
}

/// Row 4: processes that together take more than a 512 MiB sandbox's
/// memory (two of 300 MB, each under its own address-space cap) still get
/// the whole sandbox killed by the host's memory cgroup (gVisor has no OOM
/// killer of its own); the client is told so in words: "out of memory",
/// never "attach again" (before, only `exit_code` 137).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_the_host_kills_for_memory_is_reported_out_of_memory() {
    support::SANDBOX_MEMORY_BYTES.with(|bytes| bytes.set(512 << 20));
    let server = support::ws::Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    let code = "import subprocess, sys\n\
        hog = 'import time\\nb = bytearray(300 << 20)\\nb[::4096] = bytes([1]) * len(b[::4096])\\ntime.sleep(60)'\n\
        procs = [subprocess.Popen([sys.executable, '-c', hog]) for _ in range(2)]\n\
        [p.wait() for p in procs]";
    let frames = ws.exec("python", code).await;
    eprintln!("600 MB in two processes of a 512 MiB sandbox: {frames:?}");
    let text = frames.join("\n");
    assert!(text.contains("out of memory"), "{frames:?}");
    assert!(!text.contains("attach again"), "{frames:?}");
    assert!(frames.iter().any(|f| f == "exit_code:137"), "{frames:?}");
}

/// A raw WebSocket client with the request headers a test chooses.
type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect_with(url: &str, headers: &[(&str, String)]) -> Socket {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let mut request = url.into_client_request().unwrap();
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    tokio_tungstenite::connect_async(request).await.unwrap().0
}

/// The next text frame as JSON (60 s at most); `None` at the close.
async fn next_json(socket: &mut Socket) -> Option<serde_json::Value> {
    use futures::StreamExt as _;
    loop {
        let message = tokio::time::timeout(Duration::from_secs(60), socket.next())
            .await
            .expect("a frame within 60 s");
        match message {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Text(text))) => {
                return Some(serde_json::from_str(text.as_str()).unwrap());
            }
            Some(Ok(tokio_tungstenite::tungstenite::Message::Close(_)) | Err(_)) | None => {
                return None;
            }
            Some(Ok(_)) => {}
        }
    }
}

async fn send_json(socket: &mut Socket, value: serde_json::Value) {
    use futures::SinkExt as _;
    socket
        .send(tokio_tungstenite::tungstenite::Message::text(
            value.to_string(),
        ))
        .await
        .unwrap();
}

/// A Cloud Run ID token for `email` (the server decodes, never verifies).
fn id_token(email: &str) -> String {
    use base64::Engine as _;
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    format!(
        "Bearer {}.{}.c2lnbmF0dXJl",
        encode(br#"{"alg":"RS256","typ":"JWT"}"#),
        encode(
            json!({"email": email, "sub": format!("sub-{email}")})
                .to_string()
                .as_bytes()
        )
    )
}

/// `/create` as `caller`: `Ok((socket, id))` at SANDBOX_RUNNING, or the
/// refusal's message.
async fn create_as(addr: &str, caller: &str) -> Result<(Socket, String), String> {
    create_as_with(addr, caller, json!({}))
        .await
        .map(|(socket, id, _)| (socket, id))
}

/// [`create_as`] with the init message `init`; with the sandbox's token.
async fn create_as_with(
    addr: &str,
    caller: &str,
    init: serde_json::Value,
) -> Result<(Socket, String, String), String> {
    let socket = connect_with(
        &format!("ws://{addr}/create"),
        &[("authorization", id_token(caller))],
    )
    .await;
    let mut socket = socket;
    send_json(&mut socket, init).await;
    let (mut id, mut token) = (String::new(), String::new());
    loop {
        let Some(frame) = next_json(&mut socket).await else {
            return Err("closed".to_owned());
        };
        if frame["event"] == "sandbox_id" {
            id = frame["sandbox_id"].as_str().unwrap().to_owned();
            token = frame["sandbox_token"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
        }
        if frame["event"] == "error" {
            return Err(frame["message"].as_str().unwrap_or_default().to_owned());
        }
        if frame["status"] == "SANDBOX_RUNNING" {
            return Ok((socket, id, token));
        }
    }
}

/// The statuses and error messages of `socket` until it closes.
async fn until_close(socket: &mut Socket) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(frame) = next_json(socket).await {
        if let Some(status) = frame["status"].as_str() {
            seen.push(status.to_owned());
        }
        if let Some(message) = frame["message"].as_str() {
            seen.push(message.to_owned());
        }
    }
    seen
}

/// A `/create` socket that never sends its init message (its client
/// answering every ping) is told so and closed at the init timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_without_its_init_message_is_closed_at_the_init_timeout() {
    let addr = plain_server(|parts| {
        parts.socket.init_timeout = Duration::from_secs(1);
        parts.socket.ping_interval = Duration::from_millis(300);
    })
    .await;
    let started = Instant::now();
    let mut silent = connect_with(&format!("ws://{addr}/create"), &[]).await;
    let seen = tokio::time::timeout(Duration::from_secs(10), until_close(&mut silent))
        .await
        .expect("the silent socket was closed");
    eprintln!("closed after {:?}: {seen:?}", started.elapsed());
    assert!(
        seen.iter().any(|s| s.contains("--ws-init-timeout-s")),
        "{seen:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Row 2, restores: a caller at its quota cannot restore a sandbox it
/// checkpointed (it would hold two here), and can once it holds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_counts_against_its_callers_quota() {
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(controllers::testing::MemoryStore::new());
    let server = support::ws::Server::sharing("quota-restore", store, |parts| {
        parts.max_sandboxes_per_caller = Some(1);
        parts.caller_identity_verified = true;
    })
    .await;
    let addr = server.addr.clone();
    let checkpointable = json!({"enable_checkpoint": true});
    let (mut first, first_id, first_token) =
        create_as_with(&addr, "carol@example.com", checkpointable.clone())
            .await
            .expect("carol's first create");
    send_json(&mut first, json!({"action": "checkpoint"})).await;
    let seen = until_close(&mut first).await;
    assert!(seen.iter().any(|s| s == "SANDBOX_CHECKPOINTED"), "{seen:?}");
    let (second, _, _) = create_as_with(&addr, "carol@example.com", checkpointable)
        .await
        .expect("carol holds nothing here: her second create is served");

    // Restoring the first would make two.
    let attach = format!("ws://{addr}/attach/{first_id}?sandbox_token={first_token}");
    let mut restore =
        connect_with(&attach, &[("authorization", id_token("carol@example.com"))]).await;
    let seen = until_close(&mut restore).await;
    assert!(
        seen.iter()
            .any(|s| s.contains("--max-sandboxes-per-caller")),
        "a restore past the quota: {seen:?}"
    );
    assert!(!seen.iter().any(|s| s == "SANDBOX_RUNNING"), "{seen:?}");

    // Another caller's restore of it is its own.
    let mut other = connect_with(&attach, &[("authorization", id_token("dave@example.com"))]).await;
    loop {
        let frame = next_json(&mut other).await.expect("dave's restore runs");
        if frame["status"] == "SANDBOX_RUNNING" {
            break;
        }
    }
    drop(second);
}

/// Row 2: a caller at its quota (one sandbox here) is refused naming the
/// limit while another caller's create is served; an execution left
/// running by a client that walked away is killed at the detached limit,
/// and the sandbox lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_at_its_quota_leaves_room_for_others_and_detached_executions_end() {
    const DETACHED: Duration = Duration::from_secs(4);
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(controllers::testing::MemoryStore::new());
    let server = support::ws::Server::sharing("quota", store, |parts| {
        parts.max_sandboxes_per_caller = Some(1);
        parts.caller_identity_verified = true;
        parts.lifetimes.max_detached_execution = DETACHED;
    })
    .await;
    let addr = server.addr.clone();
    let (mut alice, alice_id) = create_as(&addr, "alice@example.com").await.unwrap();
    let refused = create_as(&addr, "alice@example.com")
        .await
        .expect_err("a second sandbox for alice");
    eprintln!("alice's second create: {refused}");
    assert!(
        refused.contains("--max-sandboxes-per-caller") && refused.contains("alice@example.com"),
        "{refused}"
    );
    let (_bob, _) = create_as(&addr, "bob@example.com")
        .await
        .expect("bob's create is served");

    // Alice starts a long execution and walks away.
    send_json(
        &mut alice,
        json!({"language": "bash", "code": "sleep 100000"}),
    )
    .await;
    loop {
        let frame = next_json(&mut alice).await.unwrap();
        if frame["status"] == "SANDBOX_EXECUTION_RUNNING" {
            break;
        }
    }
    drop(alice);
    let left = Instant::now();
    let id = controllers::api::SandboxId::parse(&alice_id).unwrap();
    let running = || {
        server
            .state
            .live
            .get(&id)
            .is_some_and(|live| live.execution_running())
    };
    while running() && left.elapsed() < DETACHED + Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ended_after = left.elapsed();
    eprintln!(
        "the detached execution ended {ended_after:?} after its client left (limit {DETACHED:?})"
    );
    assert!(
        !running(),
        "the detached execution still runs after {ended_after:?}"
    );
    assert!(
        ended_after >= DETACHED,
        "ended after {ended_after:?}, before the limit"
    );
    assert!(
        server.state.controller.as_ref().unwrap().is_held_here(&id),
        "the sandbox itself stays"
    );
}

/// This machine's first non-loopback IPv4 address (a UDP socket
/// "connected" outwards names it; nothing is sent).
fn outward_address() -> std::net::IpAddr {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    socket.connect("192.0.2.1:9").unwrap();
    let ip = socket.local_addr().unwrap().ip();
    assert!(
        !ip.is_loopback() && !ip.is_unspecified(),
        "this test needs a non-loopback address; found {ip}"
    );
    ip
}

/// Row 9: the operator surfaces (`/list`, `/metrics`, `/images`, the
/// detail of `/readyz`) are refused to a client that is not on the
/// server's machine and has no operator credential, and served with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_surfaces_need_the_operator_credential() {
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(controllers::testing::MemoryStore::new());
    let server = support::server_counted(
        "operators",
        store,
        None,
        std::sync::Arc::default(),
        |parts| {
            parts.operator_token = Some("op-secret-1".to_owned());
        },
    );
    let ip = outward_address();
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server.run(listener, std::future::pending()));
    let client = testkit::http_client();
    for path in ["/list", "/metrics", "/images"] {
        let refused = client
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status().as_u16(), 403, "{path}");
        let body = refused.text().await.unwrap();
        assert!(body.contains("X-Operator-Token"), "{path}: {body}");
        let wrong = client
            .get(format!("http://{addr}{path}"))
            .header("x-operator-token", "guess")
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status().as_u16(), 403, "{path}");
        let served = client
            .get(format!("http://{addr}{path}"))
            .header("x-operator-token", "op-secret-1")
            .send()
            .await
            .unwrap();
        // `/images` has no runtime here: 503, but past the credential.
        assert_ne!(served.status().as_u16(), 403, "{path}");
    }
    let ready: serde_json::Value = client
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(ready.get("instance").is_none(), "{ready}");
    assert!(ready.get("status").is_some(), "{ready}");
}

/// Row 10: a burst of 20,001 `resize` frames ending with 123×45 leaves the
/// terminal at 123×45 (the frames that act at once are handled in order on
/// one task, resizes coalesced), and the server still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_resizes_ends_at_the_last_size() {
    let server = support::ws::Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(json!({"language": "bash",
                   "code": "while read line; do stty size; done",
                   "pty": {"cols": 80, "rows": 24}}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    let sent = Instant::now();
    for n in 0..20_000u32 {
        ws.send(json!({"action": "resize", "cols": 10 + n % 900, "rows": 3 + n % 90}))
            .await;
    }
    ws.send(json!({"action": "resize", "cols": 123, "rows": 45}))
        .await;
    eprintln!("20,001 resizes sent in {:?}", sent.elapsed());
    // Ask for the size until it is the last one (the stdin queue and the
    // resizes are separate tasks); 60 s at most. No resize is refused.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = String::new();
    let mut others = Vec::new();
    while Instant::now() < deadline {
        ws.send(json!({"event": "stdin", "data": "\n"})).await;
        let frame = ws.next().await;
        if let Some(out) = frame.strip_prefix("stdout:") {
            seen.push_str(out);
            if seen.contains("45 123\r\n") {
                break;
            }
        } else {
            others.push(frame);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last = seen
        .lines()
        .rfind(|line| !line.trim().is_empty())
        .map(str::to_owned);
    eprintln!("the terminal's size after the burst: {last:?}");
    assert!(
        others.is_empty(),
        "frames other than output after the burst ({}), first {:?}",
        others.len(),
        others.first()
    );
    assert!(
        seen.contains("45 123\r\n"),
        "the terminal never reached 45 123: {seen:?}"
    );
    ws.send(json!({"action": "kill_process"})).await;
    ws.until_status("SANDBOX_EXECUTION_DONE").await;
}

/// A sandbox runs here at most `--max-sandbox-lifetime-s` in one go (6 s in
/// the test, also with `idle_timeout: 0`): a checkpointable one is then
/// checkpointed and restores with its state at its next attach, any other is
/// deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_leaves_at_its_maximum_lifetime() {
    const LIFETIME: Duration = Duration::from_secs(6);
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(controllers::testing::MemoryStore::new());
    let server = support::ws::Server::sharing("lifetime", store, |parts| {
        parts.lifetimes.max_lifetime = LIFETIME;
    })
    .await;
    let (mut kept, kept_id, kept_token) = server
        .create(json!({"idle_timeout": 0, "enable_checkpoint": true}))
        .await;
    kept.exec("bash", "echo state > /tmp/state").await;
    let (plain, plain_id, plain_token) = server.create(json!({"idle_timeout": 0})).await;
    let started = Instant::now();
    drop((kept, plain));
    let controller = server.state.controller.clone().unwrap();
    let held = |id: &str| controller.is_held_here(&controllers::api::SandboxId::parse(id).unwrap());
    while (held(&kept_id) || held(&plain_id))
        && started.elapsed() < LIFETIME + Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left_after = started.elapsed();
    eprintln!("both sandboxes left {left_after:?} after their start (lifetime {LIFETIME:?})");
    assert!(
        !held(&kept_id) && !held(&plain_id),
        "still held after {left_after:?}"
    );
    assert!(
        left_after >= LIFETIME,
        "left after {left_after:?}, before the lifetime"
    );
    assert_eq!(
        support::ws::metadata(&server, &kept_id).await.status.phase,
        controllers::api::Phase::Checkpointed
    );

    let mut back = server.attach(&kept_id, &kept_token).await;
    let frames = back.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    assert_eq!(back.stdout_of("bash", "cat /tmp/state").await, "state\n");
    let mut gone = server.attach(&plain_id, &plain_token).await;
    assert_eq!(
        gone.until_close().await,
        ["SANDBOX_NOT_FOUND", "close:1011"]
    );
}
