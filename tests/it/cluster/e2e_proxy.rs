//! Through `deploy/local`'s HAProxy, as on Cloud Run: two `sandboxd`
//! processes behind one address with cookie affinity (`GAESA`) and one
//! connection per instance. A client that keeps its cookie comes back to its
//! instance; when affinity misses (its cookie names the other instance, as when
//! Cloud Run routes elsewhere), the sandbox moves and the client gets its state.

use crate::support;

use serde_json::json;
use support::process::Launch;
use support::proxy::Proxy;
use support::ws::Ws;

/// The instance name inside a `GAESA=<name>; path=/` header value.
fn instance_of(set_cookie: &str) -> String {
    set_cookie
        .split(';')
        .next()
        .and_then(|pair| pair.strip_prefix("GAESA="))
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn affinity_holds_with_the_cookie_and_a_miss_moves_the_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let a = Launch::new("proxy-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let b = Launch::new("proxy-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let proxy = Proxy::start(dir.path(), &[&a, &b]).await;
    let base = format!("ws://127.0.0.1:{}", proxy.port);

    let (mut ws, set_cookie) = Ws::connect_for_cookie(&format!("{base}/create"), None).await;
    let set_cookie = set_cookie.expect("the proxy sets the affinity cookie");
    let home = instance_of(&set_cookie);
    ws.send(
        json!({"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true}),
    )
    .await;
    let frame = loop {
        let frame = ws.next_value().await;
        if frame["event"] == "sandbox_id" {
            break frame;
        }
    };
    let (id, token) = (
        frame["sandbox_id"].as_str().unwrap().to_owned(),
        frame["sandbox_token"].as_str().unwrap().to_owned(),
    );
    assert_eq!(ws.next().await, "SANDBOX_RUNNING");
    ws.exec("bash", "echo through-the-proxy > /tmp/p").await;
    ws.close().await;

    // The client replays the whole Set-Cookie value (the Python client does,
    // attributes included): same instance, no restore.
    let attach = format!("{base}/attach/{id}?sandbox_token={token}");
    let mut ws = Ws::try_connect(&attach, Some(&set_cookie)).await.unwrap();
    assert_eq!(
        ws.next().await,
        "SANDBOX_RUNNING",
        "affinity kept it on {home}"
    );
    ws.close().await;

    // Affinity misses: the front end picks the other instance.
    let other = if home == a.name { &b.name } else { &a.name };
    let mut ws = Ws::try_connect(&attach, Some(&format!("GAESA={other}")))
        .await
        .unwrap();
    assert_eq!(
        ws.until_status("SANDBOX_RUNNING").await,
        [
            "SANDBOX_RESTORING",
            "SANDBOX_LOCK_ACQUIRING",
            "SANDBOX_LOCK_ACQUIRED",
            "SANDBOX_RUNNING"
        ]
    );
    let frames = ws.exec("bash", "cat /tmp/p").await;
    assert_eq!(frames[1], "stdout:through-the-proxy\n");
}
