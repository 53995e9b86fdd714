//! Filesystem snapshots belong to whoever made them (docs/security.md): on
//! real runsc through the real WebSocket protocol, another client can
//! neither read nor overwrite a snapshot it only knows the name of, its
//! refusal is the one an unknown name gets, the owner proves itself with its
//! sandbox token or the snapshot token (also inside the name, which is what
//! the earlier clients can send), a consumer's read-only token creates from
//! a snapshot and overwrites none, a shared deployment keeps the earlier
//! server's names, and `sandboxctl gc`'s snapshot collection keeps what is
//! current and removes what is expired or superseded.

use crate::support;

use std::sync::Arc;

use chrono::{Duration, Utc};
use controllers::api::{API_VERSION, BlobDigest, ExtraFields, SandboxId, SnapshotManifest, encode};
use controllers::layout::{SNAPSHOTS_PREFIX, snapshot_archive_key, snapshot_manifest_key};
use controllers::store::{PutMode, Store};
use sandboxd::store::LocalStore;
use serde_json::{Value, json};
use support::ws::{Server, Ws};

/// Takes snapshot `name` on `ws`; the `SANDBOX_FILESYSTEM_SNAPSHOT_CREATED`
/// frame as sent.
async fn snapshot(ws: &mut Ws, name: &str, extra: Value) -> Value {
    let mut frame = json!({"action": "snapshot_filesystem", "name": name});
    if let (Some(frame), Some(extra)) = (frame.as_object_mut(), extra.as_object()) {
        frame.extend(extra.clone());
    }
    ws.send(frame).await;
    assert_eq!(ws.next().await, "SANDBOX_FILESYSTEM_SNAPSHOT_CREATING");
    let created = ws.next_value().await;
    assert_eq!(
        created["status"], "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED",
        "{created}"
    );
    created
}

/// A sandbox whose `/tmp/who` says `who`.
async fn sandbox_saying(server: &Server, who: &str) -> (Ws, String, String) {
    let (mut ws, id, token) = server.create(json!({"idle_timeout": 60})).await;
    ws.exec("bash", &format!("echo {who} > /tmp/who")).await;
    (ws, id, token)
}

/// `message` with every sandbox id (32 hex digits) replaced by `ID`.
fn without_ids(message: &str) -> String {
    message
        .split(' ')
        .map(|word| {
            let hex = word.trim_end_matches(':');
            if hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                word.replace(hex, "ID")
            } else {
                word.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Creates from a snapshot; `Ok(/tmp/who)` or `Err(the error message)`
/// with the new sandbox's id replaced by `ID`.
async fn create_from(server: &Server, init: Value) -> Result<String, String> {
    let mut ws = server.connect("/create").await;
    ws.send(init).await;
    loop {
        let frame = ws.next_value().await;
        if frame["event"] == "error" {
            return Err(without_ids(frame["message"].as_str().unwrap()));
        }
        if frame["status"] == "SANDBOX_RUNNING" {
            break;
        }
    }
    let frames = ws.exec("bash", "cat /tmp/who").await;
    ws.send(json!({"action": "kill_sandbox"})).await;
    ws.until_close().await;
    Ok(frames[1].trim_start_matches("stdout:").trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_is_its_owners_alone() {
    let server = Server::start().await;
    let (mut alice, _, alice_token) = sandbox_saying(&server, "alice").await;
    let created = snapshot(&mut alice, "base", json!({})).await;
    assert_eq!(created["filesystem_snapshot_name"], "base");
    let snapshot_token = created["filesystem_snapshot_token"]
        .as_str()
        .expect("the snapshot token comes with CREATED")
        .to_owned();

    // Bob knows the name only: refused, in the words an unknown name gets.
    let (mut bob, _, bob_token) = sandbox_saying(&server, "bob").await;
    let by_name = create_from(&server, json!({"filesystem_snapshot_name": "base"})).await;
    let with_bobs_token = create_from(
        &server,
        json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": bob_token}),
    )
    .await;
    let unknown = create_from(
        &server,
        json!({"filesystem_snapshot_name": "never-taken", "filesystem_snapshot_token": bob_token}),
    )
    .await;
    let unknown = unknown.expect_err("an unknown name is refused");
    assert!(
        unknown.contains("no filesystem snapshot named"),
        "{unknown}"
    );
    assert_eq!(
        by_name.expect_err("no proof"),
        unknown.replace("never-taken", "base")
    );
    assert_eq!(
        with_bobs_token.expect_err("another owner's name"),
        unknown.replace("never-taken", "base")
    );

    // Bob's snapshot under the same name is his own; Alice's is untouched.
    let bobs = snapshot(&mut bob, "base", json!({})).await;
    assert_ne!(
        bobs["filesystem_snapshot_token"],
        created["filesystem_snapshot_token"]
    );
    for proof in [&alice_token, &snapshot_token] {
        assert_eq!(
            create_from(
                &server,
                json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": proof}),
            )
            .await,
            Ok("alice".to_owned())
        );
    }
    // The earlier clients send only the name: the proof rides in it.
    assert_eq!(
        create_from(
            &server,
            json!({"idle_timeout": 60, "filesystem_snapshot_name": format!("base@{alice_token}")}),
        )
        .await,
        Ok("alice".to_owned())
    );
    assert_eq!(
        create_from(
            &server,
            json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": bob_token}),
        )
        .await,
        Ok("bob".to_owned())
    );
    // Overwriting Alice's needs her proof: with it, Bob's files replace hers.
    snapshot(
        &mut bob,
        "base",
        json!({"filesystem_snapshot_token": snapshot_token}),
    )
    .await;
    assert_eq!(
        create_from(
            &server,
            json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": alice_token}),
        )
        .await,
        Ok("bob".to_owned())
    );

    // The bucket holds hashes only, never a token.
    let keys: Vec<String> = server
        .store
        .list_all(SNAPSHOTS_PREFIX)
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key.to_string())
        .collect();
    assert!(
        keys.iter()
            .any(|k| k.starts_with("filesystem_snapshots/owner.")),
        "{keys:?}"
    );
    for secret in [&alice_token, &bob_token, &snapshot_token[4..].to_owned()] {
        assert!(
            !keys.iter().any(|k| k.contains(secret.as_str())),
            "{keys:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_deployment_keeps_the_earlier_servers_names() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let server = Server::sharing("instance-a", store, |parts| {
        parts.features.shared_snapshots = true;
    })
    .await;
    let (mut alice, _, _) = sandbox_saying(&server, "alice").await;
    let created = snapshot(&mut alice, "team-base", json!({})).await;
    assert_eq!(
        created,
        json!({"event": "status_update", "status": "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED"})
    );
    assert_eq!(
        create_from(&server, json!({"filesystem_snapshot_name": "team-base"})).await,
        Ok("alice".to_owned())
    );
}

fn manifest(path: &str, archive: &str, created_at: chrono::DateTime<Utc>) -> SnapshotManifest {
    SnapshotManifest {
        api_version: API_VERSION.to_owned(),
        name: path.to_owned(),
        source_sandbox: SandboxId::random(),
        created_at,
        archive: BlobDigest {
            key: archive.to_owned(),
            size: 1,
            sha256: "0".repeat(64),
        },
        entries: 1,
        sandbox_image: None,
        extra: ExtraFields::new(),
    }
}

#[tokio::test]
async fn gc_removes_expired_snapshots_and_superseded_archives_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::open(dir.path()).unwrap();
    let now = Utc::now();
    let owned = "owner.0123456789abcdef0123456789abcdef/base";
    // (path, age in days, archives: current first)
    let cases = [("old", 100), ("fresh", 1), (owned, 10)];
    let mut archives = std::collections::HashMap::new();
    for (path, days) in cases {
        let current = snapshot_archive_key(path, &SandboxId::random()).unwrap();
        let superseded = snapshot_archive_key(path, &SandboxId::random()).unwrap();
        for key in [&current, &superseded] {
            store
                .put(key, bytes::Bytes::from_static(b"x"), PutMode::Overwrite)
                .await
                .unwrap();
        }
        let manifest = manifest(path, current.as_str(), now - Duration::days(days));
        store
            .put(
                &snapshot_manifest_key(path).unwrap(),
                encode(&manifest),
                PutMode::Overwrite,
            )
            .await
            .unwrap();
        archives.insert(path, (current, superseded));
    }

    let dry = sandboxd::ctl::gc_snapshots(
        &store,
        Some(Duration::days(90)),
        Duration::seconds(600),
        now,
        true,
    )
    .await
    .unwrap();
    assert_eq!(dry.expired, vec!["old".to_owned()]);
    assert_eq!(dry.unreferenced_archives.len(), 2, "{dry:?}");
    assert!(
        store
            .get(&snapshot_manifest_key("old").unwrap())
            .await
            .is_ok()
    );

    let done = sandboxd::ctl::gc_snapshots(
        &store,
        Some(Duration::days(90)),
        Duration::seconds(600),
        now,
        false,
    )
    .await
    .unwrap();
    assert_eq!(done, dry);
    assert!(
        store
            .get(&snapshot_manifest_key("old").unwrap())
            .await
            .is_err()
    );
    assert!(store.get(&archives["old"].0).await.is_err());
    for path in ["fresh", owned] {
        let (current, superseded) = &archives[path];
        assert!(
            store
                .get(&snapshot_manifest_key(path).unwrap())
                .await
                .is_ok()
        );
        assert!(
            store.get(current).await.is_ok(),
            "{path}: the current archive stays"
        );
        assert!(
            store.get(superseded).await.is_err(),
            "{path}: the superseded one goes"
        );
    }
    // 0 days (no retention) keeps every snapshot.
    let kept = sandboxd::ctl::gc_snapshots(&store, None, Duration::seconds(600), now, false)
        .await
        .unwrap();
    assert_eq!(kept, sandboxd::ctl::SnapshotGcReport::default());
}

/// `snapshot_filesystem` of `name` refused; the error's message, ids replaced.
async fn snapshot_refused(ws: &mut Ws, name: &str, extra: Value) -> String {
    let mut frame = json!({"action": "snapshot_filesystem", "name": name});
    if let (Some(frame), Some(extra)) = (frame.as_object_mut(), extra.as_object()) {
        frame.extend(extra.clone());
    }
    ws.send(frame).await;
    loop {
        let frame = ws.next_value().await;
        assert_ne!(
            frame["status"], "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED",
            "{frame}"
        );
        if frame["event"] == "error" {
            return without_ids(frame["message"].as_str().unwrap());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_token_creates_from_a_snapshot_and_overwrites_none() {
    let server = Server::start().await;
    let (mut alice, _, alice_token) = sandbox_saying(&server, "alice").await;
    let created = snapshot(&mut alice, "base", json!({})).await;
    let read_token = created["filesystem_snapshot_read_token"]
        .as_str()
        .expect("the read-only token comes with CREATED")
        .to_owned();
    assert!(read_token.starts_with("ssr-"), "{created}");
    assert_ne!(created["filesystem_snapshot_token"], read_token);

    // A consumer with the read-only token creates from it, both ways.
    for init in [
        json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": read_token}),
        json!({"filesystem_snapshot_name": format!("base@{read_token}")}),
    ] {
        assert_eq!(create_from(&server, init).await, Ok("alice".to_owned()));
    }

    // It cannot overwrite: refused, in the same words for a name that
    // exists and one that does not.
    let (mut mallory, _, _) = sandbox_saying(&server, "mallory").await;
    let proof = json!({"filesystem_snapshot_token": read_token});
    let existing = snapshot_refused(&mut mallory, "base", proof.clone()).await;
    let unknown = snapshot_refused(&mut mallory, "never-taken", proof).await;
    assert!(
        existing.contains("no filesystem snapshot named"),
        "{existing}"
    );
    assert_eq!(existing, unknown.replace("never-taken", "base"));
    assert_eq!(
        create_from(
            &server,
            json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": alice_token}),
        )
        .await,
        Ok("alice".to_owned())
    );
    // The owner's proofs keep overwrite.
    let owner_token = created["filesystem_snapshot_token"].clone();
    snapshot(
        &mut mallory,
        "base",
        json!({"filesystem_snapshot_token": owner_token}),
    )
    .await;
    assert_eq!(
        create_from(
            &server,
            json!({"filesystem_snapshot_name": "base", "filesystem_snapshot_token": read_token}),
        )
        .await,
        Ok("mallory".to_owned())
    );

    // A snapshot taken before read-only tokens (under the scope of the
    // snapshot token) still opens for the owner, not for the reader.
    snapshot(&mut alice, "old", json!({})).await;
    let owner = sandboxd::api::snapshot_owner::SnapshotProof::new(alice_token.clone());
    let current = snapshot_manifest_key(&owner.path("old")).unwrap();
    let earlier = snapshot_manifest_key(&owner.earlier_path("old").unwrap()).unwrap();
    let mut manifest: Value =
        serde_json::from_slice(&server.store.get(&current).await.unwrap().data).unwrap();
    manifest["name"] = json!(owner.earlier_path("old").unwrap());
    server
        .store
        .put(&earlier, manifest.to_string().into(), PutMode::Create)
        .await
        .unwrap();
    server.store.delete(&current).await.unwrap();
    assert_eq!(
        create_from(
            &server,
            json!({"filesystem_snapshot_name": "old", "filesystem_snapshot_token": alice_token}),
        )
        .await,
        Ok("alice".to_owned())
    );
    let refused = create_from(
        &server,
        json!({"filesystem_snapshot_name": "old", "filesystem_snapshot_token": read_token}),
    )
    .await
    .expect_err("the earlier scope is the owner's");
    assert!(
        refused.contains("no filesystem snapshot named"),
        "{refused}"
    );
}
