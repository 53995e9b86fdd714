//! The Rust client library against a real server on the fake runtime (no
//! runsc): what the client does on its own side of a connection, such as a
//! close while it is reconnecting.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::InstanceId;
use controllers::store::Store;
use controllers::testing::{FakeRuntime, MemoryStore};
use sandboxd::client::{CreateOptions, Sandbox};
use sandboxd::server::{Parts, Server};
use support::cutter::Cutter;

/// A server on the in-memory store and the fake runtime; its address.
async fn fake_server() -> String {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let runtime = FakeRuntime::new(Arc::clone(&store));
    let parts = Parts::new(
        InstanceId::parse("instance-a").unwrap(),
        store,
        Some(Arc::new(runtime)),
    );
    support::serve(Server::build(parts)).await
}

/// A client of a sandbox on the fake server whose connection was cut and
/// whose first reconnect attempt was turned away: it is reconnecting.
async fn reconnecting_client() -> (Cutter, Sandbox) {
    let cutter = Cutter::to(fake_server().await).await;
    let sandbox = Sandbox::create(&format!("ws://{}", cutter.addr), CreateOptions::default())
        .await
        .unwrap();
    cutter.refuse();
    cutter.cut();
    tokio::time::timeout(Duration::from_secs(10), cutter.turned_away())
        .await
        .expect("the client tries to reconnect");
    (cutter, sandbox)
}

/// A close while the connection is down has no socket to close: it returns
/// at once instead of waiting out `Sandbox::close`'s 10 s bound (the driver
/// used to watch for the close only while connected).
#[tokio::test]
async fn a_close_while_reconnecting_returns_at_once() {
    let (_cutter, sandbox) = reconnecting_client().await;
    let started = Instant::now();
    sandbox.close().await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "close took {took:?}");
}

/// With every handle dropped while the connection is down, nobody is left
/// to reconnect for: the driver stops trying at once (it used to go on for
/// its whole two-minute window, one attempt every few seconds).
#[tokio::test]
async fn a_client_dropped_while_reconnecting_stops_trying() {
    let (cutter, sandbox) = reconnecting_client().await;
    drop(sandbox);
    // An attempt already under way may still reach the forwarder.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let attempts = cutter.turned_away_so_far();
    // The back-off starts at 100 ms and doubles: a driver still trying makes
    // at least two attempts in this time.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        cutter.turned_away_so_far(),
        attempts,
        "the dropped client kept reconnecting"
    );
}
