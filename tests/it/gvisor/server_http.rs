//! The HTTP surface on the embedded local store: the router in-process, and the
//! real `sandboxd serve` binary as the README starts it.

use crate::support;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandboxd::store::{GcsConfig, GcsStore, LocalStore};
use serde_json::{Value, json};

async fn get_json(url: &str) -> (u16, Value) {
    let response = testkit::http_client().get(url).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn status_root_and_readiness_answer_like_the_earlier_server() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let server = support::server(
        "test-instance",
        Arc::new(LocalStore::open(dir.path()).unwrap()),
        Some(Arc::new(support::runtime(dir.path()).await)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));

    assert_eq!(
        get_json(&format!("http://{addr}/status")).await,
        (200, json!({"status": "ok"}))
    );
    assert_eq!(
        get_json(&format!("http://{addr}/")).await,
        (200, json!({"message": "Server is running"}))
    );
    assert_eq!(get_json(&format!("http://{addr}/healthz")).await.0, 200);
    let (code, body) = get_json(&format!("http://{addr}/readyz")).await;
    assert_eq!((code, &body["status"]), (200, &json!("ready")));

    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_server_counts_its_connections_and_its_shutdown_waits_for_them() {
    let dir = tempfile::tempdir().unwrap();
    let server = support::server(
        "test-instance",
        Arc::new(LocalStore::open(dir.path()).unwrap()),
        None,
    );
    let connections = server.connections().clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));
    let until = |open: usize| {
        let connections = connections.clone();
        async move {
            for _ in 0..100 {
                if connections.open() == open {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            panic!("{} connections open, not {open}", connections.open());
        }
    };
    let idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    until(1).await;
    assert_eq!(get_json(&format!("http://{addr}/status")).await.0, 200);
    drop(idle);
    until(0).await;
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still listening after shutdown"
    );
}

#[tokio::test]
async fn readiness_reports_an_unreachable_store() {
    // A loopback address with nothing on port 80: the store cannot be reached.
    let host = support::free_loopback(121..=250);
    let mut config = GcsConfig::new("nowhere").with_emulator_host(&host.to_string());
    config.retry.max_retries = 0;
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let server = support::server(
        "test-instance",
        Arc::new(GcsStore::connect(config).await.unwrap()),
        Some(Arc::new(support::runtime(dir.path()).await)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server.run(listener, std::future::pending()));
    let (code, body) = get_json(&format!("http://{addr}/readyz")).await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("sandboxes/"),
        "{body}"
    );
    // Liveness does not depend on the store.
    assert_eq!(get_json(&format!("http://{addr}/status")).await.0, 200);
}

#[tokio::test]
async fn without_a_runtime_the_server_is_alive_but_not_ready_and_refuses_work() {
    let dir = tempfile::tempdir().unwrap();
    let server = support::server(
        "test-instance",
        Arc::new(LocalStore::open(dir.path()).unwrap()),
        None,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(server.run(listener, std::future::pending()));
    assert_eq!(get_json(&format!("http://{addr}/status")).await.0, 200);
    let (code, body) = get_json(&format!("http://{addr}/readyz")).await;
    assert_eq!(code, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("runsc"), "{body}");
    let response = testkit::http_client()
        .post(format!("http://{addr}/execute?language=bash"))
        .body("echo hi")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 503);
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_readme_command_serves_status_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let server = Server(
        Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--runtime-dir")
            .arg(dir.path().join("runtime"))
            .current_dir(dir.path())
            .env_remove("SANDBOX_METADATA_BUCKET")
            .env_remove("PORT")
            // Warm sandboxes would outlive the SIGKILL that ends this test.
            .env("SANDBOXD_WARM_POOL", "0")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        match testkit::http_client()
            .get(format!("http://127.0.0.1:{port}/status"))
            .send()
            .await
        {
            Ok(response) => break response.json::<Value>().await.unwrap(),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(err) => panic!("sandboxd did not come up: {err}"),
        }
    };
    assert_eq!(body, json!({"status": "ok"}));
    assert!(
        dir.path().join("sandboxd-data/.sandboxd").is_dir(),
        "the embedded default store lives under ./sandboxd-data"
    );
    drop(server);
}
