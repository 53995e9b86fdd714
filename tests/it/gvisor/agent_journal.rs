//! The agent's side of executions that survive a move (decision 0012), with
//! the real agent program (`sandbox_agent`, as the init runs it) run as a plain process on the host (no sandbox: what
//! is tested is its bookkeeping) and the real host connection to it: a
//! checkpoint that keeps an execution pauses its output and holds back its
//! exit, stdin written meanwhile still reaches it, and `resume` replays
//! exactly what was not acknowledged; events never end inside a UTF-8
//! character. Needs root (the agent drops to the configured user).

use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use controllers::runtime::ExecEvent;
use sandboxd::runtime::agent::protocol::{Command as AgentCommand, Request};
use sandboxd::runtime::agent::{AgentConnection, ExecEvents, Sequenced};
use sandboxd::runtime::bundle::agent_program;
use serde_json::{Value, json};
use tokio::net::unix::pipe;

const WAIT: Duration = Duration::from_secs(10);

struct Agent {
    connection: Arc<AgentConnection>,
    child: Child,
    _home: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn agent() -> Agent {
    assert_eq!(
        nix_uid(),
        0,
        "this test runs the agent as on a sandbox's init: it needs root"
    );
    let home = tempfile::tempdir().unwrap();
    let config = json!({
        "python": "/usr/bin/python3",
        "uid": 0,
        "gid": 0,
        "home": home.path().join("home"),
        "workspace": home.path().join("workspace"),
        "env": {"PATH": "/usr/bin:/bin", "HOME": home.path().join("home")},
    });
    let mut child = Command::new("/usr/bin/python3")
        .args(["-S", "-c", agent_program(), &config.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 runs the agent");
    let commands = pipe::Sender::from_owned_fd(OwnedFd::from(child.stdin.take().unwrap())).unwrap();
    let events =
        pipe::Receiver::from_owned_fd(OwnedFd::from(child.stdout.take().unwrap())).unwrap();
    let (connection, hello) = AgentConnection::start(commands, events);
    tokio::time::timeout(WAIT, hello)
        .await
        .expect("the agent says hello")
        .unwrap();
    Agent {
        connection,
        child,
        _home: home,
    }
}

fn nix_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().next()?.parse().ok())
        .unwrap()
}

async fn next(events: &mut ExecEvents) -> Sequenced {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .expect("an event within 10 s")
        .expect("the stream goes on")
}

fn stdout(text: &str) -> ExecEvent {
    ExecEvent::Stdout(Bytes::copy_from_slice(text.as_bytes()))
}

/// A request written as the JSON the agent reads (typed on the way).
fn typed(request: Value) -> Request {
    serde_json::from_value(request).expect("a request of the protocol")
}

/// A whole command line (with its id, or none) as JSON.
fn command(command: Value) -> AgentCommand {
    serde_json::from_value(command).expect("a command of the protocol")
}

async fn request(agent: &Agent, request: Value) -> Value {
    let reply = agent
        .connection
        .request(typed(request), WAIT)
        .await
        .unwrap();
    serde_json::to_value(reply).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_execution_is_paused_holds_its_exit_and_replays_what_was_not_acknowledged() {
    let agent = agent().await;
    let id = agent.connection.new_id("e");
    let mut events = agent
        .connection
        .start_exec(
            &id,
            typed(json!({"op": "exec", "resumable": true,
                   "argv": ["bash", "-c", "echo one; read line; echo \"$line\"; exit 4"]})),
        )
        .await
        .unwrap();
    assert_eq!(next(&mut events).await, (1, stdout("one\n")));

    // The checkpoint keeps it; the client got nothing yet (acked 0).
    let ready = request(
        &agent,
        json!({"op": "prepare_checkpoint", "force": true, "keep": true, "acked": {id.clone(): 0}}),
    )
    .await;
    assert_eq!(ready["running"], json!([]), "{ready}");
    assert_eq!(ready["kept"], json!([id]), "{ready}");
    // Stdin still reaches it; it prints and exits, but nothing leaves the
    // agent while it is paused.
    agent
        .connection
        .send(&command(
            json!({"op": "stdin", "id": id, "data": BASE64.encode("two\n")}),
        ))
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), events.recv())
            .await
            .is_err(),
        "a paused execution emitted"
    );
    let journals = request(&agent, json!({"op": "journals"})).await;
    assert_eq!(journals["paused"], true, "{journals}");
    assert_eq!(
        journals["executions"],
        json!([{"id": id, "acked": 0, "running": true}]),
        "the exit is held back: still running for the next host"
    );

    // A new host resumes with a replay from the last acknowledged event.
    let resumed = request(&agent, json!({"op": "resume", "replay": true})).await;
    assert_eq!(resumed["ev"], "resumed");
    assert_eq!(next(&mut events).await, (1, stdout("one\n")), "replayed");
    assert_eq!(next(&mut events).await, (2, stdout("two\n")));
    assert_eq!(next(&mut events).await, (3, ExecEvent::Exited(4)));

    // Acknowledged up to the exit: nothing is journaled any more.
    agent
        .connection
        .send(&command(json!({"op": "ack", "exec": id, "seq": 3})))
        .await
        .unwrap();
    let journals = request(&agent, json!({"op": "journals"})).await;
    assert_eq!(journals["paused"], false, "{journals}");
    assert_eq!(journals["executions"], json!([]), "{journals}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_keep_replays_only_what_the_first_host_did_not_deliver() {
    let agent = agent().await;
    let id = agent.connection.new_id("e");
    let mut events = agent
        .connection
        .start_exec(
            &id,
            typed(json!({"op": "exec", "resumable": true,
                   "argv": ["bash", "-c", "for i in 1 2 3; do echo $i; sleep 0.2; done; read x"]})),
        )
        .await
        .unwrap();
    for n in 1..=3 {
        assert_eq!(next(&mut events).await, (n, stdout(&format!("{n}\n"))));
    }
    // The first host delivered 2 of the 3.
    request(
        &agent,
        json!({"op": "prepare_checkpoint", "force": true, "keep": true, "acked": {id.clone(): 2}}),
    )
    .await;
    request(&agent, json!({"op": "resume", "replay": true})).await;
    assert_eq!(next(&mut events).await, (3, stdout("3\n")));
    // A checkpoint that failed resumes without a replay: nothing again.
    request(
        &agent,
        json!({"op": "prepare_checkpoint", "force": true, "keep": true, "acked": {id.clone(): 2}}),
    )
    .await;
    request(&agent, json!({"op": "resume", "replay": false})).await;
    agent
        .connection
        .send(&command(
            json!({"op": "stdin", "id": id, "data": BASE64.encode("\n")}),
        ))
        .await
        .unwrap();
    assert_eq!(next(&mut events).await, (4, ExecEvent::Exited(0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumable_output_never_ends_inside_a_character() {
    let agent = agent().await;
    let id = agent.connection.new_id("e");
    let mut events = agent
        .connection
        .start_exec(
            &id,
            typed(json!({"op": "exec", "resumable": true,
                   "argv": ["bash", "-c", "printf 'a\\xc3'; sleep 0.3; printf '\\xa9b'"]})),
        )
        .await
        .unwrap();
    assert_eq!(next(&mut events).await, (1, stdout("a")));
    assert_eq!(next(&mut events).await, (2, stdout("éb")));
    assert_eq!(next(&mut events).await, (3, ExecEvent::Exited(0)));
    // Not acknowledged yet, so journaled; a checkpoint that keeps nothing
    // (periodic, restored in place) forgets it, or a later move would replay it.
    let journals = request(&agent, json!({"op": "journals"})).await;
    assert_eq!(journals["executions"].as_array().map(Vec::len), Some(1));
    request(
        &agent,
        json!({"op": "prepare_checkpoint", "force": false, "keep": false}),
    )
    .await;
    let journals = request(&agent, json!({"op": "journals"})).await;
    assert_eq!(journals["executions"], json!([]), "{journals}");
    assert_eq!(journals["paused"], false, "{journals}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executions_without_the_option_are_not_numbered_or_kept() {
    let agent = agent().await;
    let id = agent.connection.new_id("e");
    let mut events = agent
        .connection
        .start_exec(
            &id,
            typed(json!({"op": "exec", "argv": ["bash", "-c", "echo plain"]})),
        )
        .await
        .unwrap();
    assert_eq!(next(&mut events).await, (0, stdout("plain\n")));
    assert_eq!(next(&mut events).await, (0, ExecEvent::Exited(0)));
    let journals = request(&agent, json!({"op": "journals"})).await;
    assert_eq!(journals["executions"], json!([]), "{journals}");
}

/// A file through the filesystem API's chunked upload and reads at offsets,
/// on the real agent, in the form of protocol `version` (decision 19): raw
/// bytes beside the JSON from version 2 on, base64 inside it for an agent
/// restored from a version-1 checkpoint. Bytes that look like the channel's
/// framing (newlines, braces, `"bytes":`) must arrive unchanged.
async fn file_round_trip(version: u32) {
    use controllers::api::SandboxId;
    use controllers::files::{FsReply, FsRequest};
    use sandboxd::runtime::files_access::fs_on_agent;
    let agent = agent().await;
    agent.connection.set_version(version);
    let sandbox = SandboxId::parse(&"1".repeat(32)).unwrap();
    let fs = |request| fs_on_agent(&agent.connection, &sandbox, request);
    let mut data = Vec::new();
    for i in 0u32..(3 << 18) {
        data.extend_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
    }
    data.extend_from_slice(b"\n{\"ev\":\"done\",\"id\":\"r1\",\"bytes\":4}\n\n");
    fs(FsRequest::UploadOpen {
        upload: "u1".into(),
        path: "big.bin".into(),
        mode: None,
        parents: true,
    })
    .await
    .unwrap();
    let mut written = 0;
    for piece in data.chunks(1 << 20) {
        let reply = fs(FsRequest::UploadChunk {
            upload: "u1".into(),
            data: Bytes::copy_from_slice(piece),
        })
        .await
        .unwrap();
        written += piece.len() as u64;
        assert!(
            matches!(reply, FsReply::Written(size) if size == written),
            "{reply:?}"
        );
    }
    fs(FsRequest::UploadCommit {
        upload: "u1".into(),
        size: written,
    })
    .await
    .unwrap();
    let mut back = Vec::new();
    loop {
        let reply = fs(FsRequest::Read {
            path: "big.bin".into(),
            offset: back.len() as u64,
            length: 1 << 20,
        })
        .await
        .unwrap();
        let FsReply::Data(read) = reply else {
            panic!("{reply:?}")
        };
        assert_eq!(read.size, data.len() as u64);
        back.extend_from_slice(&read.data);
        if read.eof {
            break;
        }
    }
    assert!(
        back == data,
        "version {version}: the file came back different"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_bytes_travel_raw_to_a_version_2_agent() {
    file_round_trip(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_bytes_travel_as_base64_to_an_agent_spoken_to_as_version_1() {
    file_round_trip(1).await;
}
