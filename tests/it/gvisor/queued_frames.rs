//! The per-socket budget of queued client frames (one socket could
//! queue 1,024 frames of up to 1 MiB each while its session was busy), end to
//! end: a real WebSocket client on a real server on real runsc.
//!
//! A session takes its frames one after another. While it cannot take the
//! next one (here: a download to a client that does not read, which holds the
//! session's worker as long as the client likes; a checkpoint holds it the
//! same way) the socket's reader queues what arrives, up to `QUEUED_BYTES`
//! (8 MiB). Then it stops reading the socket, TCP's window closes and the
//! client's sends block: the server's answer to a flood is back-pressure, not
//! memory. Nothing is dropped: once the session catches up, every frame sent
//! takes effect, in order.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use support::ws::Server;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The file the stalled download reads: far more than the socket's writer,
/// the kernel's buffers and the client's tiny window hold.
const DOWNLOAD_BYTES: usize = 32 << 20;
/// Stdin bytes per flooding frame: the frame stays under the 1 MiB limit.
const CHUNK: usize = (1 << 20) - 256;
/// Frames the client tries to push. Without the budget the server reads
/// every one (it would queue up to 1,024).
const FLOOD_FRAMES: usize = 200;
/// What the server may have taken while its session is held: the 8 frames
/// of its budget, the one its reader holds, and what the kernel buffers on
/// loopback (the receive buffer grows to at most 32 MiB here, the client's
/// send buffer to 4 MiB) and tungstenite's read buffer.
const MOST_ACCEPTED: usize = 8 + 1 + 32 + 4 + 3;
/// No send completed for this long: the client is held back.
const STALLED: Duration = Duration::from_secs(3);

/// A client socket with a tiny receive window, so that what it does not
/// read backs up into the server (the download's frames hold the session).
async fn connect(url: &str) -> Socket {
    support::ws::small_window_socket(url).await
}

async fn next(stream: &mut SplitStream<Socket>) -> Message {
    tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("a frame within 60 s")
        .expect("the socket is open")
        .expect("a frame")
}

async fn next_value(stream: &mut SplitStream<Socket>) -> Value {
    loop {
        match next(stream).await {
            Message::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
            Message::Close(frame) => panic!("socket closed: {frame:?}"),
            _ => {}
        }
    }
}

/// Frames up to the status `status`; panics on an error status.
async fn until_status(stream: &mut SplitStream<Socket>, status: &str) -> Vec<Value> {
    let mut frames = Vec::new();
    loop {
        let frame = next_value(stream).await;
        let this = frame["status"].as_str().unwrap_or_default().to_owned();
        assert!(!this.ends_with("_ERROR"), "{frame} (after {frames:?})");
        frames.push(frame);
        if this == status {
            return frames;
        }
    }
}

fn stdout(frames: &[Value]) -> String {
    frames
        .iter()
        .filter(|frame| frame["event"] == "stdout")
        .filter_map(|frame| frame["data"].as_str())
        .collect()
}

async fn send(sink: &mut SplitSink<Socket, Message>, frame: Value) {
    sink.send(Message::text(frame.to_string()))
        .await
        .expect("send a frame");
}

/// Pushes stdin frames until `stop` (or [`FLOOD_FRAMES`]), counting those
/// the socket took; returns the sink and the count once the last send ended.
fn flood(
    mut sink: SplitSink<Socket, Message>,
    sent: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<SplitSink<Socket, Message>> {
    let frame = json!({"event": "stdin", "data": "x".repeat(CHUNK)}).to_string();
    tokio::spawn(async move {
        for _ in 0..FLOOD_FRAMES {
            if stop.load(Ordering::Acquire) {
                break;
            }
            sink.send(Message::text(frame.clone()))
                .await
                .expect("a flooding frame is taken, late or not");
            sent.fetch_add(1, Ordering::AcqRel);
        }
        sink
    })
}

/// Waits until the count stops moving for [`STALLED`] (`true`) or reaches
/// [`FLOOD_FRAMES`] (`false`: the server read everything).
async fn held_back(sent: &AtomicUsize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = (sent.load(Ordering::Acquire), Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = sent.load(Ordering::Acquire);
        if now == FLOOD_FRAMES {
            return false;
        }
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() >= STALLED {
            return true;
        }
        assert!(
            Instant::now() < deadline,
            "the flood neither ended nor stalled"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_frames_is_held_back_by_tcp_and_none_is_lost() {
    let server = Server::start().await;
    let (mut sink, mut stream) = connect(&server.url("/create")).await.split();
    send(&mut sink, json!({})).await;
    let mut sandbox = None;
    loop {
        let frame = next_value(&mut stream).await;
        if frame["event"] == "sandbox_id" {
            sandbox = Some((
                frame["sandbox_id"].as_str().unwrap().to_owned(),
                frame["sandbox_token"].as_str().unwrap().to_owned(),
            ));
        }
        assert_ne!(frame["status"], "SANDBOX_CREATION_ERROR", "{frame}");
        if frame["status"] == "SANDBOX_RUNNING" {
            break;
        }
    }
    let (id, token) = sandbox.expect("sandbox_id before SANDBOX_RUNNING");

    send(
        &mut sink,
        json!({"language": "bash",
               "code": format!("head -c {DOWNLOAD_BYTES} /dev/zero > /tmp/big.bin")}),
    )
    .await;
    until_status(&mut stream, "SANDBOX_EXECUTION_DONE").await;

    // A program that counts its stdin up to a final '!'.
    let counter = "import sys\nn = 0\nwhile True:\n    chunk = sys.stdin.buffer.read1(1 << 20)\n    \
                   if not chunk:\n        break\n    n += len(chunk)\n    \
                   if chunk.endswith(b'!'):\n        n -= 1\n        break\nprint('read', n, flush=True)\n";
    send(&mut sink, json!({"language": "python", "code": counter})).await;
    until_status(&mut stream, "SANDBOX_EXECUTION_RUNNING").await;

    // The session's worker sends the download and blocks once the unread
    // frames fill the client's window: the session takes nothing more.
    send(
        &mut sink,
        json!({"action": "fs_download", "request_id": "down", "path": "/tmp/big.bin"}),
    )
    .await;
    let sent = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let flooding = flood(sink, Arc::clone(&sent), Arc::clone(&stop));
    let stalled = held_back(&sent).await;
    stop.store(true, Ordering::Release);
    let accepted_while_held = sent.load(Ordering::Acquire);
    eprintln!("frames of 1 MiB the socket took while the session was held: {accepted_while_held}");
    assert!(
        stalled,
        "the server read all {FLOOD_FRAMES} frames of 1 MiB while its session could take none"
    );
    assert!(
        accepted_while_held <= MOST_ACCEPTED,
        "{accepted_while_held} frames of 1 MiB taken while the session was held \
         (at most {MOST_ACCEPTED}: its 8 MiB budget and the kernel's buffers)"
    );

    // The client reads again: the download ends whole, then the session
    // takes every queued frame and the held send goes through.
    let head = next_value(&mut stream).await;
    assert_eq!(head["event"], "fs_download", "{head}");
    let mut received = 0usize;
    let end = loop {
        match next(&mut stream).await {
            Message::Binary(bytes) => received += bytes.len(),
            Message::Text(text) => break serde_json::from_str::<Value>(text.as_str()).unwrap(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(end["event"], "fs_result", "{end}");
    assert_eq!(received, DOWNLOAD_BYTES);
    let mut sink = tokio::time::timeout(Duration::from_secs(120), flooding)
        .await
        .expect("the held send goes through once the session catches up")
        .unwrap();
    let accepted = sent.load(Ordering::Acquire);
    send(&mut sink, json!({"event": "stdin", "data": "!"})).await;
    // Pings keep the socket's reads alive: a program that never got its
    // '!' would keep this waiting for ever without a bound of its own.
    let frames = tokio::time::timeout(
        Duration::from_secs(120),
        until_status(&mut stream, "SANDBOX_EXECUTION_DONE"),
    )
    .await
    .expect("the program got every frame and its '!', and ended");
    assert_eq!(
        stdout(&frames),
        format!("read {}\n", accepted * CHUNK),
        "every frame the socket took reached the program ({accepted} frames)"
    );
    let _ = sink.close().await;
    drop(stream);

    // The sandbox goes on: a new attach runs code and sees the file.
    let mut ws = attach_when_free(&server, &id, &token).await;
    let frames = ws.exec("bash", "stat -c %s /tmp/big.bin").await;
    assert!(
        frames.contains(&format!("stdout:{DOWNLOAD_BYTES}\n")),
        "{frames:?}"
    );
}

/// A program that reads its stdin slower than the client sends it gets all
/// of it: the agent reports what the program took, the server sends no more
/// than the agent holds for it (8 MiB) and holds the client back instead.
/// Before, the agent dropped what was past its 8 MiB, with a notice (and a
/// flood whose last frame fell in the gap never ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_program_that_reads_slowly_gets_all_its_stdin() {
    const FRAMES: usize = 24;
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    // At most 64 KiB each 10 ms: a few MiB a second.
    let slow_counter = "import sys, time\nn = 0\nwhile True:\n    \
                        chunk = sys.stdin.buffer.read1(1 << 16)\n    \
                        if not chunk:\n        break\n    n += len(chunk)\n    \
                        if chunk.endswith(b'!'):\n        n -= 1\n        break\n    \
                        time.sleep(0.01)\nprint('read', n, flush=True)\n";
    ws.send(json!({"language": "python", "code": slow_counter}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    let started = Instant::now();
    let frames = tokio::time::timeout(Duration::from_secs(60), async {
        for _ in 0..FRAMES {
            ws.send(json!({"event": "stdin", "data": "x".repeat(CHUNK)}))
                .await;
        }
        ws.send(json!({"event": "stdin", "data": "!"})).await;
        ws.until_status("SANDBOX_EXECUTION_DONE").await
    })
    .await
    .expect("the program read everything and ended (input dropped, its '!' with it?)");
    eprintln!(
        "{FRAMES} frames of stdin read by a slow program in {:?}",
        started.elapsed()
    );
    let out: String = frames
        .iter()
        .filter_map(|frame| frame.strip_prefix("stdout:"))
        .collect();
    let errors: Vec<&String> = frames
        .iter()
        .filter(|frame| frame.starts_with("stderr:") || frame.starts_with("error:"))
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(out, format!("read {}\n", FRAMES * CHUNK));
}

/// Attaches once the previous socket's session has let go.
async fn attach_when_free(server: &Server, id: &str, token: &str) -> support::ws::Ws {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut ws = server.attach(id, token).await;
        let frames = ws
            .until(|f| f == "SANDBOX_RUNNING" || f == "SANDBOX_IN_USE")
            .await;
        if frames.last().map(String::as_str) == Some("SANDBOX_RUNNING") {
            return ws;
        }
        assert!(Instant::now() < deadline, "still in use: {frames:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An upload whose bytes a client never sends, then more text frames than
/// the budget holds: the session would wait for the bytes, and the socket's
/// reader for room in the queue, forever (the session never ended, even
/// when the client left, and the sandbox stayed attached). The upload ends
/// short with an `fs_error` instead, and the frames after it take effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upload_starved_of_its_bytes_by_a_full_queue_ends_with_an_error() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    let announced = 4 << 20;
    ws.send(
        json!({"action": "fs_upload", "request_id": "up", "path": "/tmp/up.bin",
                   "size": announced}),
    )
    .await;
    let frames = 10;
    for _ in 0..frames {
        ws.send(json!({"event": "stdin", "data": "x".repeat(CHUNK)}))
            .await;
    }
    let answer = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let frame = ws.next_value().await;
            if frame["request_id"] == "up" {
                return frame;
            }
        }
    })
    .await
    .expect("the upload is answered (the session did not wedge)");
    assert_eq!(answer["event"], "fs_error", "{answer}");
    assert!(
        answer
            .to_string()
            .contains(&format!("0 bytes arrived, {announced} were announced")),
        "{answer}"
    );
    // Each stdin frame is answered in turn (no program runs), then code runs.
    let mut refused = 0;
    while refused < frames {
        let frame = ws.next().await;
        assert!(!frame.starts_with("close:"), "{frame}");
        if frame == "error:No process is running in the sandbox." {
            refused += 1;
        }
    }
    let frames = ws
        .exec("bash", "echo still here; ls /tmp/up.bin 2>&1")
        .await;
    assert!(
        frames
            .iter()
            .any(|f| f.starts_with("stdout:still here\n") && f.contains("No such file")),
        "the sandbox runs code; nothing is left of the failed upload: {frames:?}"
    );
}
