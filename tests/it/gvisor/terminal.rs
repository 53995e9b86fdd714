//! Terminals end to end on runsc: `python3 -i` on a pseudo-terminal through
//! a real WebSocket client, resized, reading `stty size`; and `sandboxctl
//! shell` driven under a pseudo-terminal by Python's `pty` module, as a
//! person at a terminal would use it (raw mode, a window resized).

use crate::support;

use serde_json::json;
use support::ws::{Server, Ws};

/// Reads frames until the terminal's output so far contains `needle`;
/// returns that output.
async fn output_until(ws: &mut Ws, needle: &str) -> String {
    let mut seen = String::new();
    while !seen.contains(needle) {
        let frame = ws.next_value().await;
        assert_ne!(
            frame["status"], "SANDBOX_EXECUTION_DONE",
            "ended early: {seen:?}"
        );
        if frame["event"] == "stdout" {
            seen.push_str(frame["data"].as_str().unwrap());
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_on_a_terminal_is_interactive_and_follows_a_resize() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(json!({"language": "bash", "code": "python3 -i", "pty": {"cols": 80, "rows": 24}}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    output_until(&mut ws, ">>> ").await;
    ws.send(json!({"event": "stdin", "data": "import subprocess, sys\n"}))
        .await;
    output_until(&mut ws, ">>> ").await;
    ws.send(json!({"event": "stdin", "data": "sys.stdin.isatty(), subprocess.run(['stty', 'size']).returncode\n"}))
        .await;
    let seen = output_until(&mut ws, "(True, 0)").await;
    assert!(seen.contains("24 80\r\n"), "{seen:?}");

    ws.send(json!({"action": "resize", "cols": 132, "rows": 43}))
        .await;
    ws.send(json!({"event": "stdin", "data": "subprocess.run(['stty', 'size']).returncode\n"}))
        .await;
    // Up to the next prompt: a Ctrl-D typed before the REPL reads again
    // meets the line discipline in canonical mode, not readline, and is
    // lost when readline switches the terminal to raw (as on a real
    // terminal: a person types it at the prompt).
    let seen = output_until(&mut ws, "\r\n0\r\n>>> ").await;
    assert!(seen.contains("43 132\r\n"), "{seen:?}");
    // The terminal's line discipline: Ctrl-D at the prompt ends the REPL.
    ws.send(json!({"event": "stdin", "data": "\u{4}"})).await;
    let rest = ws.until_status("SANDBOX_EXECUTION_DONE").await;
    assert!(rest.contains(&"exit_code:0".to_owned()), "{rest:?}");
}

const DRIVER: &str = r#"
import fcntl, os, pty, struct, sys, termios, time
argv = sys.argv[1:]
pid, master = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    os.execv(argv[0], argv)
seen = b""
def until(needle, timeout=60):
    global seen
    deadline = time.time() + timeout
    while needle not in seen:
        if time.time() > deadline:
            sys.exit("timed out waiting for %r; got %r" % (needle, seen))
        try:
            data = os.read(master, 4096)
        except OSError:
            sys.exit("the terminal closed; got %r" % seen)
        seen += data
time.sleep(0.5)
os.write(master, b"stty size; echo MARK$((1+1))\n")
until(b"MARK2")
assert b"30 100" in seen, seen
fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
time.sleep(1.0)
os.write(master, b"stty size; echo MARK$((2+2))\n")
until(b"MARK4")
assert b"40 120" in seen.split(b"MARK2")[-1], seen
os.write(master, b"exit 7\n")
try:
    while True:
        data = os.read(master, 4096)
        if not data:
            break
        seen += data
except OSError:
    pass
_, status = os.waitpid(pid, 0)
print("exit", os.waitstatus_to_exitcode(status))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxctl_shell_under_a_terminal_is_raw_and_follows_the_window() {
    let server = Server::start().await;
    let (ws, id, token) = server.create(json!({"idle_timeout": 300})).await;
    ws.close().await;
    let url = server.url("");
    let output = tokio::process::Command::new("python3")
        .args(["-c", DRIVER, env!("CARGO_BIN_EXE_sandboxctl")])
        .args(["shell", &id, "--token", &token, "--url", &url])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.trim(), "exit 7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_keep_executions_a_terminal_survives_a_handoff() {
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let a = Server::sharing("instance-a", std::sync::Arc::clone(&store), |_| {}).await;
    let b = Server::sharing("instance-b", store, |_| {}).await;
    let (mut on_a, id, token) = a
        .create(json!({"idle_timeout": 300, "enable_checkpoint": true,
                       "enable_sandbox_handoff": true, "keep_executions": true}))
        .await;
    on_a.send(json!({"language": "bash", "code": "python3 -i", "pty": {"cols": 80, "rows": 24}}))
        .await;
    assert_eq!(on_a.next().await, "SANDBOX_EXECUTION_RUNNING");
    output_until(&mut on_a, ">>> ").await;
    on_a.send(json!({"event": "stdin", "data": "x = 6 * 7\n"}))
        .await;
    output_until(&mut on_a, ">>> ").await;

    // Another instance takes the sandbox over while A's client is attached:
    // the REPL, its variable and its terminal go along.
    let mut on_b = b.attach(&id, &token).await;
    on_b.until_status("SANDBOX_RUNNING").await;
    on_b.send(json!({"action": "reconnect"})).await;
    assert_eq!(on_b.next().await, "SANDBOX_EXECUTION_RUNNING");
    on_b.send(json!({"action": "resize", "cols": 100, "rows": 30}))
        .await;
    on_b.send(json!({"event": "stdin",
                     "data": "import subprocess; print(x, subprocess.run(['stty', 'size']).returncode)\n"}))
        .await;
    // Up to the next prompt, where a Ctrl-D ends the REPL (see above).
    let seen = output_until(&mut on_b, "42 0\r\n>>> ").await;
    assert!(seen.contains("30 100\r\n"), "{seen:?}");
    on_b.send(json!({"event": "stdin", "data": "\u{4}"})).await;
    let rest = on_b.until_status("SANDBOX_EXECUTION_DONE").await;
    assert!(rest.contains(&"exit_code:0".to_owned()), "{rest:?}");
    drop(on_a);
}
