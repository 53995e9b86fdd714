//! `POST /execute` on real runsc: the earlier server's one-shot form and the
//! JSON extension with the exit code.

use crate::support;

use std::sync::Arc;

use sandboxd::store::LocalStore;
use serde_json::Value;

async fn server(dir: &std::path::Path) -> String {
    let server = support::server(
        "test-instance",
        Arc::new(LocalStore::open(dir.join("meta")).unwrap()),
        Some(Arc::new(support::runtime(dir).await)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server.run(listener, std::future::pending()));
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_streams_merged_output_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = server(dir.path()).await;
    let http = testkit::http_client();

    let response = http
        .post(format!("{base}/execute?language=bash"))
        .body("echo out; sleep 0.2; echo err >&2; exit 3")
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "a failing script still answers 200, as upstream"
    );
    assert_eq!(
        response.headers()["content-type"],
        "text/plain; charset=utf-8"
    );
    assert_eq!(response.text().await.unwrap(), "out\nerr\n");

    // Python is the default language.
    let response = http
        .post(format!("{base}/execute"))
        .body("print(6 * 7)")
        .send()
        .await
        .unwrap();
    assert_eq!(response.text().await.unwrap(), "42\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_json_reports_streams_and_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = server(dir.path()).await;
    let body: Value = testkit::http_client()
        .post(format!("{base}/execute?language=bash&format=json"))
        .body("echo out; echo err >&2; exit 3")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["stdout"], "out\n");
    assert_eq!(body["stderr"], "err\n");
    assert_eq!(body["exit_code"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_rejects_bad_requests_with_422() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = server(dir.path()).await;
    let http = testkit::http_client();
    for (query, body, needle) in [
        ("language=ruby", "puts 1", "Unsupported language: 'ruby'"),
        ("language=bash", "", "empty"),
        ("language=bash&format=xml", "echo", "unknown format"),
    ] {
        let response = http
            .post(format!("{base}/execute?{query}"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 422, "{query}");
        let detail: Value = response.json().await.unwrap();
        assert!(
            detail["detail"].as_str().unwrap().contains(needle),
            "{query}: {detail}"
        );
    }
    let response = http
        .post(format!("{base}/execute?language=bash"))
        .body(vec![0xff, 0xfe])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 422);
}

/// The containers under the test server's runsc root.
async fn containers(dir: &std::path::Path) -> Vec<String> {
    let runsc = sandboxd::runtime::Runsc {
        binary: "runsc".into(),
        root: dir.join("runsc"),
        platform: "ptrace".into(),
        timeouts: sandboxd::runtime::RunscTimeouts::default(),
    };
    runsc.list().await.unwrap()
}

/// Waits until no container is left (a destroy's `runsc delete` takes about
/// 2 s here); panics naming `what` if some outlive the wait.
async fn all_destroyed(dir: &std::path::Path, what: &str) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let left = containers(dir).await;
        if left.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: the sandbox outlived its client: {left:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Sends `script` and hangs up after 3 s, before it ends.
async fn post_and_hang_up(base: &str, query: &str, script: &str) {
    let http = testkit::http_client();
    let request = http
        .post(format!("{base}/execute?{query}"))
        .body(script.to_owned());
    let answered = tokio::time::timeout(std::time::Duration::from_secs(3), async {
        let response = request.send().await.unwrap();
        // Stream mode answers at once; wait for a body that never comes.
        response.bytes().await.ok();
    })
    .await;
    assert!(answered.is_err(), "the 120 s script ended early");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_json_destroys_the_sandbox_when_the_client_disconnects() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = server(dir.path()).await;
    post_and_hang_up(&base, "language=bash&format=json", "sleep 120").await;
    all_destroyed(dir.path(), "json mode").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_stream_stops_a_silent_script_when_the_client_disconnects() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = server(dir.path()).await;
    post_and_hang_up(&base, "language=bash", "sleep 120").await;
    all_destroyed(dir.path(), "stream mode").await;
}

/// A server whose `/execute` keeps 64 KiB of output and allows 3 s.
async fn limited_server(dir: &std::path::Path) -> String {
    let server = support::server_counted(
        "test-instance",
        Arc::new(LocalStore::open(dir.join("meta")).unwrap()),
        Some(Arc::new(support::runtime(dir).await)),
        Arc::default(),
        |parts| {
            parts.execute = sandboxd::api::limits::ExecuteLimits {
                max_output_bytes: 64 << 10,
                timeout: std::time::Duration::from_secs(3),
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server.run(listener, std::future::pending()));
    format!("http://{addr}")
}

/// One script printing 400 MB took the server from 170 MB to
/// 1.26 GB (JSON mode kept it all). Output past the limit is discarded after
/// a marker, in both modes, and the script still runs to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_output_is_capped_with_a_marker() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = limited_server(dir.path()).await;
    let http = testkit::http_client();
    let script = "head -c 20000000 /dev/zero | tr '\\0' x; echo; echo finished >&2";
    let body: Value = http
        .post(format!("{base}/execute?language=bash&format=json"))
        .body(script)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let stdout = body["stdout"].as_str().unwrap();
    let stderr = body["stderr"].as_str().unwrap();
    assert_eq!(stdout.len(), 64 << 10, "exactly the limit is kept");
    assert!(stderr.contains("output truncated"), "{stderr}");
    assert_eq!(body["truncated"], true);
    assert_eq!(body["exit_code"], 0, "the script ran to its end");

    let text = http
        .post(format!("{base}/execute?language=bash"))
        .body(script)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.len() < (64 << 10) + 1024, "{} bytes", text.len());
    assert!(text.contains("output truncated"));
}

/// `/execute` had no time limit; a script past it is killed and
/// the answer says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_kills_a_script_past_its_time_limit() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = limited_server(dir.path()).await;
    let started = std::time::Instant::now();
    let body: Value = testkit::http_client()
        .post(format!("{base}/execute?language=bash&format=json"))
        .body("echo before; sleep 60; echo after")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    assert_eq!(body["stdout"], "before\n");
    assert_eq!(body["timed_out"], true);
    assert!(
        body["stderr"].as_str().unwrap().contains("3-second limit"),
        "{body}"
    );
}
