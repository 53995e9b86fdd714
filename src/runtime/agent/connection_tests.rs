//! The host connection against a scripted agent end.

use std::io::Write as _;
use std::os::fd::OwnedFd;

use serde_json::{Value, json};

use super::*;
use crate::runtime::agent::MAX_QUEUED_OUTPUT_BYTES;

fn archive() -> Request {
    Request::Archive {
        paths: vec![],
        since: None,
    }
}

/// A connection whose agent end the test plays: it writes events to the
/// returned file and may read commands from the returned pipe.
fn connect() -> (Arc<AgentConnection>, std::fs::File, std::io::PipeReader) {
    let (command_reader, command_writer) = std::io::pipe().unwrap();
    let (event_reader, event_writer) = std::io::pipe().unwrap();
    let commands = pipe::Sender::from_owned_fd(OwnedFd::from(command_writer)).unwrap();
    let events = pipe::Receiver::from_owned_fd(OwnedFd::from(event_reader)).unwrap();
    let (connection, _hello) = AgentConnection::start_tagged(commands, events, String::new());
    (
        connection,
        std::fs::File::from(OwnedFd::from(event_writer)),
        command_reader,
    )
}

/// An `exec` of `argv` on pipes, with the stdin window asked for.
fn exec_of(argv: &[&str], stdin_window: Option<u64>) -> Request {
    Request::Exec {
        argv: Some(argv.iter().map(|arg| (*arg).to_owned()).collect()),
        session: false,
        code: None,
        env: None,
        cwd: None,
        resumable: false,
        pty: None,
        results: false,
        stdin_window,
    }
}

fn emit(agent: &mut std::fs::File, event: &Value) {
    let mut line = serde_json::to_vec(event).unwrap();
    line.push(b'\n');
    agent.write_all(&line).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_archive_consumer_does_not_stall_replies() {
    let (connection, mut agent, commands) = connect();
    // Nobody reads the archive's chunks (a slow snapshot writer).
    let (_chunks, _done) = connection.start_archive(archive()).await.unwrap();
    let pinging = Arc::clone(&connection);
    let reply = tokio::spawn(async move {
        pinging
            .request(Request::Ping, Duration::from_secs(30))
            .await
    });
    // The ping's route exists once its line is sent: the agent answers only
    // after reading it (answered earlier, the pong would have no route).
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(commands).lines() {
            if line.unwrap().contains("\"r2\"") {
                return;
            }
        }
        panic!("the ping was never sent");
    })
    .await
    .unwrap();
    for _ in 0..500 {
        emit(
            &mut agent,
            &json!({"ev": "chunk", "id": "a1", "data": "eA=="}),
        );
    }
    emit(
        &mut agent,
        &json!({"ev": "pong", "id": "r2", "version": 1, "running": []}),
    );
    let reply = reply.await.unwrap();
    assert!(
        reply.is_ok(),
        "the ping's reply queued behind unread archive chunks: {reply:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_base64_output_is_reported_not_silently_empty() {
    let (connection, mut agent, _commands) = connect();
    let starting = Arc::clone(&connection);
    let started =
        tokio::spawn(async move { starting.start_exec("e1", exec_of(&["true"], None)).await });
    // `started` only once the request waits for it (it would be dropped).
    while !connection.routes().replies.contains_key("e1") {
        tokio::task::yield_now().await;
    }
    emit(&mut agent, &json!({"ev": "started", "id": "e1", "pid": 2}));
    let mut events = started.await.unwrap().unwrap();
    emit(
        &mut agent,
        &json!({"ev": "out", "id": "e1", "fd": 1, "data": "not base64!"}),
    );
    emit(&mut agent, &json!({"ev": "exit", "id": "e1", "code": 0}));
    let (_, first) = events.recv().await.unwrap();
    let ExecEvent::Stderr(notice) = first else {
        panic!("bad output became {first:?}, not a reported loss");
    };
    let notice = String::from_utf8_lossy(&notice).into_owned();
    assert!(notice.contains("output lost"), "{notice}");
    assert!(matches!(
        events.recv().await,
        Some((0, ExecEvent::Exited(0)))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_execution_is_not_ended_when_the_agent_goes_away() {
    let (connection, mut agent, _commands) = connect();
    let mut kept = connection.adopt_exec("kept", None).unwrap();
    let mut other = connection.adopt_exec("other", None).unwrap();
    emit(
        &mut agent,
        &json!({"ev": "out", "id": "kept", "fd": 1, "data": "eA==", "seq": 7}),
    );
    assert_eq!(
        kept.recv().await,
        Some((7, ExecEvent::Stdout(Bytes::from_static(b"x")))),
        "the agent's sequence number travels with the event"
    );
    connection.suspend("kept", true);
    drop(agent); // the sandbox was checkpointed: the agent's stdout ends
    assert_eq!(
        kept.recv().await,
        None,
        "a kept execution must end without an exit here"
    );
    assert_eq!(other.recv().await, Some((0, ExecEvent::Exited(137))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_archive_chunk_fails_the_archive() {
    let (connection, mut agent, _commands) = connect();
    let (_chunks, done) = connection.start_archive(archive()).await.unwrap();
    emit(
        &mut agent,
        &json!({"ev": "chunk", "id": "a1", "data": "%%%"}),
    );
    emit(&mut agent, &json!({"ev": "done", "id": "a1"}));
    let outcome = done.await.unwrap();
    assert!(
        outcome.as_ref().is_err_and(|m| m.contains("unreadable")),
        "{outcome:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_reply_fails_its_request_at_once() {
    let (connection, mut agent, commands) = connect();
    let started = std::time::Instant::now();
    // Answered once asked, so the reply has its route.
    let answerer = std::thread::spawn(move || {
        let (command, _) = next_command(&mut std::io::BufReader::new(commands));
        assert_eq!(command["id"], "r1", "{command}");
        // A pong without its version: no message of the protocol.
        emit(&mut agent, &json!({"ev": "pong", "id": "r1"}));
        agent
    });
    let reply = connection
        .request(Request::Ping, Duration::from_secs(20))
        .await;
    drop(answerer.join().unwrap());
    assert!(
        matches!(&reply, Err(AgentError::Refused(message)) if message.contains("malformed")),
        "{reply:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "it waited for the timeout"
    );
}

#[test]
fn another_protocol_version_is_refused_naming_both() {
    assert_eq!(
        check_version(AGENT_PROTOCOL_VERSION).unwrap(),
        AGENT_PROTOCOL_VERSION
    );
    assert_eq!(
        check_version(OLDEST_AGENT_PROTOCOL_VERSION).unwrap(),
        OLDEST_AGENT_PROTOCOL_VERSION,
        "an agent restored from an older checkpoint is still spoken to"
    );
    for other in [0, AGENT_PROTOCOL_VERSION + 1] {
        let err = check_version(other).expect_err("another version");
        let text = err.to_string();
        assert!(text.contains(&format!("version {other}")), "{text}");
        assert!(
            text.contains(&format!(
                "versions {OLDEST_AGENT_PROTOCOL_VERSION} to {AGENT_PROTOCOL_VERSION}"
            )),
            "{text}"
        );
    }
}

/// Output waiting for a consumer that fell behind is bounded. The
/// agent writes 12 MiB to an execution nobody reads; what is queued stays
/// under the limit, the first dropped event is a notice, and every event keeps
/// its number (a resumable execution counts them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_queued_for_a_slow_consumer_is_bounded_with_a_notice() {
    let (connection, mut agent, _commands) = connect();
    let mut events = connection.adopt_exec("e1", None).unwrap();
    // A reply after the output: once it arrived, the reader has routed all
    // of it (and nobody read any).
    let routed = connection.expect_reply("r9").unwrap();
    let chunk = BASE64.encode(vec![b'x'; 64 << 10]);
    for seq in 1..=192u64 {
        emit(
            &mut agent,
            &json!({"ev": "out", "id": "e1", "fd": 1, "data": chunk, "seq": seq}),
        );
    }
    emit(
        &mut agent,
        &json!({"ev": "exit", "id": "e1", "code": 0, "seq": 193}),
    );
    emit(
        &mut agent,
        &json!({"ev": "pong", "id": "r9", "version": 1, "running": []}),
    );
    tokio::time::timeout(Duration::from_secs(30), routed)
        .await
        .expect("the reply within 30 s")
        .expect("a reply")
        .expect("no refusal");
    let (mut bytes, mut notices, mut expected) = (0usize, 0, 1u64);
    loop {
        let (seq, event) = events.recv().await.unwrap();
        assert_eq!(seq, expected, "events keep their numbers");
        expected += 1;
        match event {
            ExecEvent::Stdout(data) => bytes += data.len(),
            ExecEvent::Stderr(data) => {
                assert!(String::from_utf8_lossy(&data).contains("output dropped"));
                notices += 1;
            }
            ExecEvent::Exited(code) => {
                assert_eq!(code, 0);
                break;
            }
            ExecEvent::AfterExecFailed(message) => panic!("the agent sent {message:?}"),
            ExecEvent::HoldLost => panic!("a runtime never sends HoldLost"),
            ExecEvent::ForceKilled => panic!("the agent sends no ForceKilled"),
            ExecEvent::Result(_) => panic!("no rich result was asked for"),
        }
    }
    assert!(
        bytes <= MAX_QUEUED_OUTPUT_BYTES,
        "{bytes} bytes were queued for nobody"
    );
    assert!(bytes >= MAX_QUEUED_OUTPUT_BYTES / 2, "{bytes}");
    assert_eq!(notices, 1);
}

/// A line longer than the limit (an agent gone wrong writing to its
/// pipe) is skipped, not buffered whole, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_agent_line_is_skipped_and_the_connection_goes_on() {
    let (connection, mut agent, commands) = connect();
    let writer = std::thread::spawn(move || {
        // Answered only once it was asked: a reply to a request not yet
        // routed is dropped as unknown.
        let (command, _) = next_command(&mut std::io::BufReader::new(commands));
        assert_eq!(command["id"], "r1", "{command}");
        let block = vec![b'x'; 1 << 20];
        for _ in 0..(MAX_AGENT_LINE_BYTES >> 20) + 2 {
            agent.write_all(&block).unwrap();
        }
        agent.write_all(b"\n").unwrap();
        emit(
            &mut agent,
            &json!({"ev": "pong", "id": "r1", "version": 1, "running": []}),
        );
        agent
    });
    let reply = connection
        .request(Request::Ping, Duration::from_secs(30))
        .await;
    assert!(reply.is_ok(), "{reply:?}");
    assert!(!connection.is_gone());
    drop(writer.join().unwrap());
}

/// A line of many tiny values (an agent gone wrong) is
/// refused before it is parsed, whose cost is many times its bytes: the
/// request it names fails at once, saying why, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_of_too_many_values_is_refused_unparsed_and_the_connection_goes_on() {
    use super::super::lines::MAX_AGENT_LINE_VALUES;
    let (connection, mut agent, commands) = connect();
    let asked = {
        let connection = Arc::clone(&connection);
        tokio::spawn(async move {
            connection
                .request(Request::Ping, Duration::from_secs(30))
                .await
        })
    };
    let writer = std::thread::spawn(move || {
        // Answered only once it was asked (its reply is routed then).
        let mut commands = std::io::BufReader::new(commands);
        let (command, _) = next_command(&mut commands);
        assert_eq!(command["id"], "r1", "{command}");
        let flood = "0,".repeat(MAX_AGENT_LINE_VALUES);
        let line = format!("{{\"ev\":\"done\",\"id\":\"r1\",\"a\":[{flood}0]}}\n");
        agent.write_all(line.as_bytes()).unwrap();
        (agent, commands)
    });
    let started = std::time::Instant::now();
    let refused = asked.await.unwrap();
    let err = refused.expect_err("the flooded reply was taken");
    assert!(err.to_string().contains("too many values"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "it waited for its timeout"
    );
    let (mut agent, mut commands) = writer.join().unwrap();
    // Answered only once it was asked, as above: a reply to a request not
    // yet routed is dropped as unknown.
    let answerer = std::thread::spawn(move || {
        let (command, _) = next_command(&mut commands);
        assert_eq!(command["id"], "r2", "{command}");
        emit(
            &mut agent,
            &json!({"ev": "pong", "id": "r2", "version": 1, "running": []}),
        );
        agent
    });
    let reply = connection
        .request(Request::Ping, Duration::from_secs(30))
        .await;
    assert!(reply.is_ok(), "{reply:?}");
    assert!(!connection.is_gone());
    drop(answerer.join().unwrap());
}

/// The next command line the host wrote, as JSON, and the raw bytes its
/// `bytes` announces.
fn next_command(commands: &mut std::io::BufReader<std::io::PipeReader>) -> (Value, Vec<u8>) {
    use std::io::{BufRead as _, Read as _};
    let mut line = String::new();
    commands.read_line(&mut line).unwrap();
    let command: Value = serde_json::from_str(&line).unwrap();
    let mut payload = vec![0; command["bytes"].as_u64().unwrap_or(0) as usize];
    commands.read_exact(&mut payload).unwrap();
    (command, payload)
}

/// Decision 19: file bytes travel raw beside the JSON to an agent of
/// version 2, and as base64 inside it to one of version 1 (restored from an
/// older checkpoint); a read's raw bytes are checked against what was asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_bytes_take_the_form_the_agents_version_speaks() {
    use controllers::api::SandboxId;
    use controllers::files::{FsError, FsReply, FsRequest};

    use crate::runtime::files_access::fs_on_agent;
    let (connection, mut agent, commands) = connect();
    let mut commands = std::io::BufReader::new(commands);
    let sandbox = SandboxId::parse(&"0".repeat(32)).unwrap();
    let chunk = |data: &'static [u8]| FsRequest::UploadChunk {
        upload: "u1".into(),
        data: Bytes::from_static(data),
    };
    let read = |length| FsRequest::Read {
        path: "/f".into(),
        offset: 0,
        length,
    };
    let spawn = |request| {
        let (connection, sandbox) = (Arc::clone(&connection), sandbox.clone());
        tokio::spawn(async move { fs_on_agent(&connection, &sandbox, request).await })
    };

    connection.set_version(1);
    let sent = spawn(chunk(b"a\nb"));
    let (command, payload) = tokio::task::block_in_place(|| next_command(&mut commands));
    assert_eq!(command["op"], "fs_upload_chunk", "{command}");
    assert_eq!(command["data"], BASE64.encode(b"a\nb"));
    assert!(
        payload.is_empty() && command.get("bytes").is_none(),
        "{command}"
    );
    emit(
        &mut agent,
        &json!({"ev": "done", "id": command["id"], "size": 3}),
    );
    assert!(matches!(sent.await.unwrap(), Ok(FsReply::Written(3))));

    connection.set_version(2);
    let sent = spawn(chunk(b"a\nb"));
    let (command, payload) = tokio::task::block_in_place(|| next_command(&mut commands));
    assert_eq!(command["op"], "fs_upload_bytes", "{command}");
    assert_eq!(
        (command["bytes"].as_u64(), payload),
        (Some(3), b"a\nb".to_vec())
    );
    assert!(command.get("data").is_none(), "{command}");
    emit(
        &mut agent,
        &json!({"ev": "done", "id": command["id"], "size": 6}),
    );
    assert!(matches!(sent.await.unwrap(), Ok(FsReply::Written(6))));

    let facts = json!({"size": 3, "mode": 420, "ino": 1, "mtime_ns": 1, "eof": true});
    for (asked, expect_ok) in [(10, true), (2, false)] {
        let reading = spawn(read(asked));
        let (command, _) = tokio::task::block_in_place(|| next_command(&mut commands));
        assert_eq!(command["op"], "fs_read_bytes", "{command}");
        let mut reply = json!({"ev": "done", "id": command["id"], "bytes": 3});
        reply
            .as_object_mut()
            .unwrap()
            .extend(facts.as_object().unwrap().clone());
        let mut line = serde_json::to_vec(&reply).unwrap();
        line.extend_from_slice(b"\nx\ny");
        agent.write_all(&line).unwrap();
        match (reading.await.unwrap(), expect_ok) {
            (Ok(FsReply::Data(data)), true) => assert_eq!(&data.data[..], b"x\ny"),
            (Err(FsError::BadAnswer(_)), false) => {}
            (other, _) => panic!("a read of {asked}: {other:?}"),
        }
    }
    // The raw bytes were framed off: the connection goes on.
    let pinging = Arc::clone(&connection);
    let ping =
        tokio::spawn(async move { pinging.request(Request::Ping, Duration::from_secs(5)).await });
    let (command, _) = tokio::task::block_in_place(|| next_command(&mut commands));
    emit(
        &mut agent,
        &json!({"ev": "pong", "id": command["id"], "version": 2, "running": []}),
    );
    ping.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_an_agent_does_not_read_are_bounded_and_their_sender_waits() {
    // The agent end reads nothing: the pipe fills, then the queue.
    let (connection, _events, _commands) = connect();
    let stdin = Request::Stdin {
        data: BASE64.encode(vec![b'x'; 1 << 20]),
    }
    .with_id("e1");
    let mut sent = 0_usize;
    let waited = tokio::time::timeout(Duration::from_secs(5), async {
        for _ in 0..64 {
            connection.send(&stdin).await.unwrap();
            sent += 1;
        }
    })
    .await;
    assert!(
        waited.is_err(),
        "64 MiB of stdin were queued for an agent that reads nothing"
    );
    // A kill does not wait behind them; a flood of them stops at its own budget.
    let kill = Request::Kill.with_id("e1");
    connection
        .send_control(&kill)
        .expect("a kill is queued at once");
    let kill_line = serde_json::to_vec(&kill).unwrap().len() + 1;
    let accepted = (0..MAX_QUEUED_CONTROL_BYTES)
        .take_while(|_| connection.send_control(&kill).is_ok())
        .count();
    assert!(
        accepted < MAX_QUEUED_CONTROL_BYTES / kill_line,
        "{accepted} kills were queued"
    );
    // What was queued fits the budget (plus what the pipe took).
    let line = serde_json::to_vec(&stdin).unwrap().len() + 1;
    assert!(
        sent * line <= MAX_QUEUED_COMMAND_BYTES + (1 << 20) + line,
        "{sent} lines of {line} bytes were queued"
    );
}

/// A burst of resizes to an agent that reads nothing yet: none is refused,
/// none takes the control budget (a kill still goes), the lines queued stop
/// at what the pipe holds plus one, and the last written is the last size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_resizes_queues_one_line_at_a_time_and_ends_at_the_last() {
    const BURST: u16 = 20_000;
    let (connection, _events, commands) = connect();
    let size = Arc::new(LatestCommand::default());
    let resize = |n: u16| {
        Request::Resize {
            cols: 10 + n % 900,
            rows: 3 + n % 90,
        }
        .with_id("e1")
    };
    for n in 0..BURST {
        connection
            .send_latest(&size, &resize(n))
            .unwrap_or_else(|err| panic!("resize {n} was refused: {err}"));
    }
    // Every turn of the burst is queued ahead of the kill.
    connection
        .send_control(&Request::Kill.with_id("e1"))
        .expect("a kill is queued at once after the burst");
    let read = tokio::task::spawn_blocking(move || {
        let mut commands = std::io::BufReader::new(commands);
        let mut resizes = Vec::new();
        loop {
            let (command, _) = next_command(&mut commands);
            if command["op"] == "kill" {
                return resizes;
            }
            resizes.push(command);
        }
    });
    let resizes = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the queued lines are readable")
        .unwrap();
    let last = serde_json::to_value(resize(BURST - 1)).unwrap();
    // The shortest line a size of the burst makes, as a bound.
    let shortest = serde_json::to_vec(&resize(0)).unwrap().len() + 1;
    let pipe_lines = (64 << 10) / shortest;
    assert!(
        resizes.len() <= pipe_lines + 2,
        "{} resize lines were queued for {pipe_lines} lines of pipe",
        resizes.len()
    );
    assert_eq!(resizes.last(), Some(&last));
}

/// Stdin to an execution whose agent granted a window: the sender waits
/// once the window is full, goes on when the agent reports what the program
/// took (never past the window, whatever the report says), and goes on at
/// once when the execution ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_waits_for_its_window_and_an_ended_execution_holds_no_sender() {
    const WINDOW: u64 = 64 << 10;
    const CHUNK: usize = 16 << 10;
    let (connection, mut agent, _commands) = connect();
    let starting = Arc::clone(&connection);
    let started = tokio::spawn(async move {
        starting
            .start_exec("e1", exec_of(&["cat"], Some(WINDOW)))
            .await
    });
    while !connection.routes().replies.contains_key("e1") {
        tokio::task::yield_now().await;
    }
    // A larger window than asked for is not taken.
    emit(
        &mut agent,
        &json!({"ev": "started", "id": "e1", "pid": 2, "stdin_window": WINDOW * 16}),
    );
    let _events = started.await.unwrap().unwrap();
    let chunk = vec![b'x'; CHUNK];
    let fill = |connection: Arc<AgentConnection>| {
        let chunk = chunk.clone();
        async move {
            for _ in 0..WINDOW as usize / CHUNK {
                connection.send_stdin("e1", &chunk).await.unwrap();
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), fill(Arc::clone(&connection)))
        .await
        .expect("a window's worth is sent at once");
    let sending = Arc::clone(&connection);
    let chunk_again = chunk.clone();
    let mut over = tokio::spawn(async move { sending.send_stdin("e1", &chunk_again).await });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut over)
            .await
            .is_err(),
        "stdin past the window was sent before the program took any"
    );
    emit(
        &mut agent,
        &json!({"ev": "stdin_taken", "id": "e1", "count": CHUNK}),
    );
    tokio::time::timeout(Duration::from_secs(5), over)
        .await
        .expect("room the program made lets the sender go on")
        .unwrap()
        .unwrap();
    // A report of more than was ever sent gives back the window, no more.
    emit(
        &mut agent,
        &json!({"ev": "stdin_taken", "id": "e1", "count": u64::MAX}),
    );
    let room = || {
        connection.routes().execs["e1"]
            .stdin_window
            .as_ref()
            .map(|window| window.room.available_permits())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while room() != Some(WINDOW as usize) {
        assert!(std::time::Instant::now() < deadline, "room: {:?}", room());
        tokio::task::yield_now().await;
    }
    tokio::time::timeout(Duration::from_secs(5), fill(Arc::clone(&connection)))
        .await
        .expect("the window's worth again");
    let sending = Arc::clone(&connection);
    let over = tokio::spawn(async move { sending.send_stdin("e1", &chunk).await });
    emit(&mut agent, &json!({"ev": "exit", "id": "e1", "code": 0}));
    tokio::time::timeout(Duration::from_secs(5), over)
        .await
        .expect("an ended execution holds no sender")
        .unwrap()
        .unwrap();
}

/// An execution a restore brought back keeps the room its journal reports,
/// in a window no larger than this host's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_execution_starts_from_the_room_its_journal_reports() {
    let (connection, _agent, _commands) = connect();
    let _events = connection.adopt_exec("e1", Some((u64::MAX, 100))).unwrap();
    let routes = connection.routes();
    let window = routes.execs["e1"].stdin_window.as_ref().unwrap();
    assert_eq!(window.room.available_permits(), 100);
    assert_eq!(window.size as u64, STDIN_WINDOW_BYTES);
}
