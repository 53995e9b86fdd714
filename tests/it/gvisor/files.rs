//! The filesystem API end to end: a real WebSocket client (and a plain HTTP
//! client) against the real server on real runsc. Every call and its POSIX
//! errors, paths refused (/proc, also through a symlink user code planted),
//! calls while an execution runs, a 100 MB upload and download whose
//! digests match, and files that survive a checkpoint, a handoff to another
//! instance and an HTTP call on a sandbox held elsewhere.

use crate::support;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use support::ws::{Server, Ws};
use tokio_tungstenite::tungstenite::protocol::Message;

/// Sends a call and returns its `fs_result` / `fs_error`, skipping other
/// frames (execution output).
async fn call(ws: &mut Ws, action: &str, mut fields: Value) -> Value {
    fields["action"] = json!(action);
    fields["request_id"] = json!(format!("{action}-1"));
    ws.send(fields).await;
    loop {
        let frame = ws.next_value().await;
        if frame["event"] == "fs_result" || frame["event"] == "fs_error" {
            assert_eq!(frame["request_id"], json!(format!("{action}-1")), "{frame}");
            return frame;
        }
    }
}

async fn ok(ws: &mut Ws, action: &str, fields: Value) -> Value {
    let frame = call(ws, action, fields).await;
    assert_eq!(frame["event"], "fs_result", "{action}: {frame}");
    frame["result"].clone()
}

async fn code(ws: &mut Ws, action: &str, fields: Value) -> String {
    let frame = call(ws, action, fields).await;
    assert_eq!(frame["event"], "fs_error", "{action}: {frame}");
    frame["code"].as_str().unwrap().to_owned()
}

async fn read_text(ws: &mut Ws, path: &str) -> String {
    let result = ok(ws, "fs_read", json!({"path": path})).await;
    String::from_utf8(BASE64.decode(result["data"].as_str().unwrap()).unwrap()).unwrap()
}

fn stdout(frames: &[String]) -> String {
    frames
        .iter()
        .filter_map(|frame| frame.strip_prefix("stdout:"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_and_its_errors_over_the_socket() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;

    let written = ok(
        &mut ws,
        "fs_write",
        json!({"path": "notes/a.txt", "text": "hello", "mode": 0o600}),
    )
    .await;
    assert_eq!(written["entry"]["path"], "/home/sandbox/notes/a.txt");
    assert_eq!(written["entry"]["size"], 5);
    assert_eq!(written["entry"]["mode"], 0o600);
    assert_eq!(
        read_text(&mut ws, "/home/sandbox/notes/a.txt").await,
        "hello"
    );
    // User code sees the file, with its mode.
    let frames = ws
        .exec("bash", "cat ~/notes/a.txt; stat -c ' %a' ~/notes/a.txt")
        .await;
    assert_eq!(stdout(&frames), "hello 600\n");

    let part = ok(
        &mut ws,
        "fs_read",
        json!({"path": "notes/a.txt", "offset": 1, "length": 3}),
    )
    .await;
    assert_eq!(part["data"], BASE64.encode("ell"));
    assert_eq!(
        (part["size"].clone(), part["eof"].clone()),
        (json!(5), json!(false))
    );
    let stat = ok(&mut ws, "fs_stat", json!({"path": "notes"})).await;
    assert_eq!(stat["entry"]["type"], "directory");

    ok(
        &mut ws,
        "fs_mkdir",
        json!({"path": "d/e/f", "parents": true}),
    )
    .await;
    let listed = ok(&mut ws, "fs_list", json!({"path": "d", "depth": 5})).await;
    let names: Vec<&str> = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["e", "e/f"]);
    assert_eq!(listed["truncated"], false);
    let moved = ok(
        &mut ws,
        "fs_rename",
        json!({"path": "notes/a.txt", "to": "d/e/b.txt"}),
    )
    .await;
    assert_eq!(moved["entry"]["path"], "/home/sandbox/d/e/b.txt");

    // The POSIX errors, by name.
    assert_eq!(
        code(&mut ws, "fs_read", json!({"path": "notes/a.txt"})).await,
        "ENOENT"
    );
    assert_eq!(
        code(&mut ws, "fs_read", json!({"path": "d"})).await,
        "EISDIR"
    );
    assert_eq!(
        code(&mut ws, "fs_list", json!({"path": "d/e/b.txt"})).await,
        "ENOTDIR"
    );
    assert_eq!(
        code(&mut ws, "fs_mkdir", json!({"path": "d"})).await,
        "EEXIST"
    );
    assert_eq!(
        code(&mut ws, "fs_remove", json!({"path": "d"})).await,
        "ENOTEMPTY"
    );
    assert_eq!(
        code(
            &mut ws,
            "fs_write",
            json!({"path": "/etc/passwd", "text": "x"})
        )
        .await,
        "EACCES"
    );
    assert_eq!(
        code(
            &mut ws,
            "fs_write",
            json!({"path": "x/y", "text": "", "parents": false})
        )
        .await,
        "ENOENT"
    );
    // What the agent could reach and user code cannot: its own host stdio.
    assert_eq!(
        code(&mut ws, "fs_read", json!({"path": "/proc/1/environ"})).await,
        "EACCES"
    );
    ws.exec("bash", "ln -s /proc/1/fd/0 ~/link; ln -s /etc ~/etc")
        .await;
    assert_eq!(
        code(&mut ws, "fs_read", json!({"path": "link"})).await,
        "EACCES"
    );
    // A symlink elsewhere in the sandbox is the sandbox's own business.
    assert!(read_text(&mut ws, "etc/hostname").await.len() > 1);
    // Malformed calls are refused before the sandbox sees them.
    assert_eq!(code(&mut ws, "fs_stat", json!({})).await, "EINVAL");
    assert_eq!(
        code(&mut ws, "fs_chmod", json!({"path": "d"})).await,
        "EINVAL"
    );

    ok(
        &mut ws,
        "fs_remove",
        json!({"path": "d", "recursive": true}),
    )
    .await;
    assert_eq!(
        code(&mut ws, "fs_stat", json!({"path": "d"})).await,
        "ENOENT"
    );
    // The earlier server's frames still mean what they meant.
    assert_eq!(
        ws.exec("python", "print(6 * 7)").await,
        [
            "SANDBOX_EXECUTION_RUNNING",
            "stdout:42\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_served_while_an_execution_runs() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(
        json!({"language": "bash", "code": "while [ ! -e ~/go ]; do sleep 0.05; done; cat ~/go"}),
    )
    .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    ok(&mut ws, "fs_write", json!({"path": "go", "text": "went"})).await;
    let frames = ws.until_status("SANDBOX_EXECUTION_DONE").await;
    assert_eq!(stdout(&frames), "went");
}

/// Deterministic bytes that do not compress into a pattern.
fn pseudo_random(size: usize) -> Vec<u8> {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut data = Vec::with_capacity(size);
    while data.len() < size {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    data.truncate(size);
    data
}

async fn upload(ws: &mut Ws, path: &str, data: &[u8], sha256: &str) -> Value {
    ws.send(
        json!({"action": "fs_upload", "request_id": "up", "path": path,
                   "size": data.len(), "sha256": sha256, "mode": 0o640}),
    )
    .await;
    for chunk in data.chunks(1 << 20) {
        ws.send_raw(Message::binary(chunk.to_vec())).await;
    }
    loop {
        let frame = ws.next_value().await;
        if frame["request_id"] == "up" {
            return frame;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_file_goes_up_and_comes_back_with_the_same_digest() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    let data = pseudo_random(100 << 20);
    let digest = hex::encode(Sha256::digest(&data));

    let started = std::time::Instant::now();
    let done = upload(&mut ws, "/tmp/big.bin", &data, &digest).await;
    let took = started.elapsed();
    assert_eq!(done["event"], "fs_result", "{done}");
    assert_eq!(done["result"]["sha256"], digest);
    assert_eq!(done["result"]["entry"]["size"], data.len());
    assert_eq!(done["result"]["entry"]["mode"], 0o640);
    eprintln!(
        "100 MB upload: {took:?} ({:.0} MB/s, debug build)",
        100.0 / took.as_secs_f64()
    );
    let frames = ws.exec("bash", "sha256sum /tmp/big.bin").await;
    assert!(stdout(&frames).starts_with(&digest), "{frames:?}");

    let started = std::time::Instant::now();
    ws.send(json!({"action": "fs_download", "request_id": "down", "path": "/tmp/big.bin"}))
        .await;
    let head = ws.next_value().await;
    assert_eq!(head["event"], "fs_download", "{head}");
    assert_eq!(head["size"], data.len());
    let mut hasher = Sha256::new();
    let mut received = 0usize;
    let end = loop {
        match ws.next_raw().await.expect("the download's frames") {
            Message::Binary(bytes) => {
                assert_eq!(&bytes[..], &data[received..received + bytes.len()]);
                received += bytes.len();
                hasher.update(&bytes);
            }
            Message::Text(text) => break serde_json::from_str::<Value>(text.as_str()).unwrap(),
            other => panic!("{other:?}"),
        }
    };
    let took = started.elapsed();
    assert_eq!(end["event"], "fs_result", "{end}");
    assert_eq!(received, data.len());
    eprintln!(
        "100 MB download: {took:?} ({:.0} MB/s, debug build)",
        100.0 / took.as_secs_f64()
    );
    assert_eq!(end["result"]["sha256"], hex::encode(hasher.finalize()));
    assert_eq!(end["result"]["sha256"], digest);

    // A wrong digest leaves nothing behind; the next upload is unaffected.
    let small = pseudo_random(3 << 20);
    let refused = upload(&mut ws, "/tmp/wrong.bin", &small, &"0".repeat(64)).await;
    assert_eq!(refused["event"], "fs_error", "{refused}");
    assert_eq!(refused["code"], "EIO");
    assert_eq!(
        code(&mut ws, "fs_stat", json!({"path": "/tmp/wrong.bin"})).await,
        "ENOENT"
    );
    let frames = ws
        .exec("bash", "ls -a /tmp | grep -c sandboxd-upload")
        .await;
    assert_eq!(stdout(&frames), "0\n");
    let digest = hex::encode(Sha256::digest(&small));
    let fine = upload(&mut ws, "/tmp/right.bin", &small, &digest).await;
    assert_eq!(fine["event"], "fs_result", "{fine}");
}

fn http(server: &Server, path: &str) -> String {
    format!("http://{}{path}", server.addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_outlive_a_checkpoint_and_a_handoff_and_http_reaches_a_sandbox_held_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let a = Server::sharing("instance-a", std::sync::Arc::clone(&store), |_| {}).await;
    let b = Server::sharing("instance-b", store, |_| {}).await;
    let init =
        json!({"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true});
    let (mut ws, id, token) = a.create(init).await;
    ok(
        &mut ws,
        "fs_write",
        json!({"path": "kept.txt", "text": "before the checkpoint"}),
    )
    .await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");

    // Restored on another instance: the file is there.
    let mut ws = b.attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(
        read_text(&mut ws, "kept.txt").await,
        "before the checkpoint"
    );
    ok(
        &mut ws,
        "fs_write",
        json!({"path": "second.txt", "text": "written on b"}),
    )
    .await;
    // While a client is attached, HTTP calls are refused (the one attach slot).
    let client = testkit::http_client();
    let busy = client
        .post(http(&b, &format!("/sandboxes/{id}/files")))
        .bearer_auth(&token)
        .json(&json!({"op": "stat", "path": "kept.txt"}))
        .send()
        .await
        .unwrap();
    assert_eq!(busy.status(), 409);
    ws.close().await;

    // Held by b: an HTTP call on a hands it over and reads the file there.
    let wrong = client
        .post(http(&a, &format!("/sandboxes/{id}/files")))
        .bearer_auth("0".repeat(64))
        .json(&json!({"op": "stat", "path": "kept.txt"}))
        .send()
        .await
        .unwrap();
    // A wrong token is answered as an unknown id (nothing revealed).
    assert_eq!(wrong.status(), 404);
    let read: Value = client
        .post(http(&a, &format!("/sandboxes/{id}/files")))
        .bearer_auth(&token)
        .json(&json!({"op": "read", "path": "second.txt"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(read["data"], BASE64.encode("written on b"), "{read}");
    let missing = client
        .post(http(&a, &format!("/sandboxes/{id}/files")))
        .bearer_auth(&token)
        .json(&json!({"op": "read", "path": "nothing-here"}))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.json::<Value>().await.unwrap()["code"], "ENOENT");
    // A body that is no JSON is refused before the sandbox is held.
    let garbled = client
        .post(http(&a, &format!("/sandboxes/{id}/files")))
        .bearer_auth(&token)
        .body("{\"op\": \"read\", ")
        .send()
        .await
        .unwrap();
    assert_eq!(garbled.status(), 400);
    let refusal = garbled.json::<Value>().await.unwrap();
    assert_eq!(refusal["code"], "EINVAL", "{refusal}");
    assert!(refusal.to_string().contains("not JSON"), "{refusal}");

    // Streamed content over HTTP, both ways.
    let data = pseudo_random(5 << 20 | 17);
    let digest = hex::encode(Sha256::digest(&data));
    let put: Value = client
        .put(http(&a, &format!("/sandboxes/{id}/files/content")))
        .query(&[
            ("path", "blob.bin"),
            ("mode", "750"),
            ("sha256", digest.as_str()),
        ])
        .bearer_auth(&token)
        .body(data.clone())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(put["sha256"], digest, "{put}");
    assert_eq!(put["entry"]["mode"], 0o750);
    let got = client
        .get(http(&a, &format!("/sandboxes/{id}/files/content")))
        .query(&[("path", "blob.bin")])
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(got.headers()["x-sandbox-file-mode"], "750");
    assert_eq!(got.bytes().await.unwrap(), data);
}
