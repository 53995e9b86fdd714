//! One instance cut off from the bucket while its client stays connected
//! (`testkit::storage`'s partition, in front of the real emulator), with
//! real `sandboxd` processes on fast leases (6 s, 1 s skew):
//! - the cut-off holder stops acknowledging executions once it can no
//!   longer vouch for its hold, and its client gets a clear status
//!   (`SANDBOX_ERROR` saying the lease could not be renewed) in bounded
//!   time, not a hang;
//! - a client attaching through another instance gets the sandbox (its
//!   last checkpoint) once the holder's lease has expired, and the holder
//!   acknowledged nothing after that;
//! - healed, the cut-off instance serves again.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::process::Launch;
use testkit::storage::{Partition, Profile, StorageModel};

/// The holder's client must hear of the loss within this of the cut: the
/// lease (6 s) and the store's deadline (12 s) for the renewal that fails,
/// then the re-verification's, with room for a loaded machine.
const LOSS_BOUND: Duration = Duration::from_secs(50);

async fn partitioned_holder(partition: Partition) {
    let mut dir = tempfile::tempdir().unwrap();
    if std::env::var_os("KEEP_DIR").is_some() {
        dir.disable_cleanup(true);
        eprintln!("logs in {}", dir.path().display());
    }
    let bucket = support::create_bucket().await;
    let model = StorageModel::new(support::emulator().socket_addr(), Profile::loopback());
    let proxy_a = model.proxy("cut-a").await.unwrap();
    let proxy_b = model.proxy("cut-b").await.unwrap();
    let a = Launch::new("cut-a", dir.path())
        .on_emulator(&proxy_a.endpoint(), &bucket)
        .fast_leases()
        .start()
        .await;
    let b = Launch::new("cut-b", dir.path())
        .on_emulator(&proxy_b.endpoint(), &bucket)
        .fast_leases()
        .start()
        .await;
    let init =
        json!({"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true});
    let (mut ws, id, token) = a.create(init).await;
    ws.exec("bash", "echo v1 > /tmp/v").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let mut ws = a.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");

    proxy_a.set_partition(partition);
    let cut = Instant::now();
    // A's client keeps executing until A says it lost the sandbox.
    let holder_client = tokio::spawn(async move {
        let mut acks = Vec::new();
        let mut said = Vec::new();
        let mut pending = false;
        while cut.elapsed() < LOSS_BOUND {
            if !pending {
                // The server may have closed meanwhile: its close is read below.
                ws.try_send(json!({"language": "bash", "code": "echo tick"}))
                    .await;
                pending = true;
            }
            let Ok(frame) = tokio::time::timeout(Duration::from_millis(500), ws.next()).await
            else {
                continue;
            };
            if frame == "SANDBOX_EXECUTION_DONE" {
                acks.push(Instant::now());
                pending = false;
                tokio::time::sleep(Duration::from_millis(200)).await;
            } else if frame.starts_with("stdout:") || frame.starts_with("exit_code:") {
            } else {
                said.push((cut.elapsed(), frame.clone()));
                if frame.starts_with("close:") {
                    break;
                }
            }
        }
        (acks, said)
    });

    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut moved = b.attach(&id, &token).await;
    let frames = moved.until_status("SANDBOX_RUNNING").await;
    let running_on_b = Instant::now();
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    let out = moved.exec("bash", "cat /tmp/v").await;
    assert!(out.contains(&"stdout:v1\n".to_owned()), "{out:?}");

    let (acks, said) = holder_client.await.unwrap();
    let late: Vec<Duration> = acks
        .iter()
        .filter(|at| **at >= running_on_b)
        .map(|at| at.duration_since(running_on_b))
        .collect();
    assert!(
        late.is_empty(),
        "A acknowledged executions after B ran the sandbox: {late:?} after (said {said:?})"
    );
    let loss = said.iter().find(|(_, frame)| {
        frame.starts_with("error:") && frame.contains("stopped on this instance")
    });
    assert!(
        loss.is_some(),
        "A's client got no clear status within {LOSS_BOUND:?} of the cut: {said:?}"
    );
    eprintln!(
        "{partition:?}: A acknowledged {} executions after the cut, the last {:?} after it; \
         its client heard {said:?}; B ran the sandbox {:?} after the cut",
        acks.len(),
        acks.last().map(|at| at.duration_since(cut)),
        running_on_b.duration_since(cut),
    );

    // Healed: A serves new sandboxes again.
    proxy_a.set_partition(Partition::Connected);
    let (mut fresh, _, _) = a
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    let out = fresh.exec("bash", "echo back").await;
    assert!(out.contains(&"stdout:back\n".to_owned()), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_holder_stops_and_says_so() {
    partitioned_holder(Partition::BlackHole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_holder_stops_and_says_so() {
    partitioned_holder(Partition::Refuse).await;
}
