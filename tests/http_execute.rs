//! `POST /execute` on real runsc: the earlier server's one-shot form and the
//! JSON extension with the exit code.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]

mod support;

use std::sync::Arc;

use sandboxd::server;
use sandboxd::store::LocalStore;
use serde_json::Value;

async fn server(dir: &std::path::Path) -> String {
    let state = support::app_state(
        "test-instance",
        Arc::new(LocalStore::open(dir.join("meta")).unwrap()),
        Some(Arc::new(support::runtime(dir).await)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server::run(listener, state, std::future::pending()));
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_streams_merged_output_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let base = server(dir.path()).await;
    let http = reqwest::Client::new();

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
    let body: Value = reqwest::Client::new()
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
    let http = reqwest::Client::new();
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
