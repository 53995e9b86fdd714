//! `sandboxctl` as people run it: the operator verbs (describe, get -o yaml,
//! edit, evict, delete, break-lease, gc) against the local store and against
//! fake-gcs-server, and the user verbs (run, create, attach, checkpoint, kill)
//! against a real server on runsc.

use crate::support;

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::sync::Arc;

use chrono::{Duration, Utc};
use controllers::api::{
    BlobDigest, CheckpointManifest, ConditionStatus, DesiredState, ExtraFields, InstanceId, Lease,
    Phase, SandboxId, SandboxMetadata, decode, encode,
};
use controllers::clock::SystemClock;
use controllers::layout::{checkpoint_image_key, checkpoint_manifest_key, lock_key, metadata_key};
use controllers::leasing::{LeaseConfig, Leases};
use controllers::store::{PutMode, Store};
use sandboxd::store::LocalStore;

const HELD: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const PLAIN: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
const TOMBSTONE: &str = "dddddddddddddddddddddddddddddddd";
const ORPHAN: &str = "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee";
/// A checkpoint only a lock carries (its record never landed).
const CARRIED: &str = "ffffffffffffffffffffffffffffffff";

fn id(text: &str) -> SandboxId {
    SandboxId::parse(text).unwrap()
}

async fn populate(store: Arc<dyn Store>) {
    let mut held = SandboxMetadata::new(id(HELD), Utc::now(), "ab".repeat(32));
    held.spec.enable_checkpoint = true;
    store
        .put(&metadata_key(&id(HELD)), encode(&held), PutMode::Create)
        .await
        .unwrap();
    let leases = Leases::new(
        store.clone(),
        Arc::new(SystemClock),
        InstanceId::parse("instance-a").unwrap(),
        LeaseConfig::default(),
    );
    controllers::testing::hold(&leases, &id(HELD))
        .await
        .unwrap();
    let plain = SandboxMetadata::new(id(PLAIN), Utc::now(), "ab".repeat(32));
    store
        .put(&metadata_key(&id(PLAIN)), encode(&plain), PutMode::Create)
        .await
        .unwrap();
    // A tombstone deleted an hour ago.
    let mut tombstone = SandboxMetadata::new(
        id(TOMBSTONE),
        Utc::now() - Duration::hours(2),
        "ab".repeat(32),
    );
    tombstone.spec.desired_state = DesiredState::Deleted;
    tombstone.status.phase = Phase::Deleted;
    tombstone.status.set_condition(
        "Ready",
        ConditionStatus::False,
        "Deleted",
        "",
        Utc::now() - Duration::hours(1),
    );
    store
        .put(
            &metadata_key(&id(TOMBSTONE)),
            encode(&tombstone),
            PutMode::Create,
        )
        .await
        .unwrap();
    // A checkpoint nothing points at, an hour old.
    stored_checkpoint(store.as_ref(), ORPHAN, PLAIN, 60, 1).await;
    // One as old that only HELD's lock carries: a hand-back whose record
    // never landed. It is the sandbox's latest checkpoint, not garbage.
    let carried = stored_checkpoint(store.as_ref(), CARRIED, HELD, 60, 1).await;
    let lock = store.get(&lock_key(&id(HELD))).await.unwrap();
    let mut lease: Lease = decode(&lock.data).unwrap();
    lease.checkpoint = Some(carried);
    store
        .put(
            &lock_key(&id(HELD)),
            encode(&lease),
            PutMode::Update(lock.generation),
        )
        .await
        .unwrap();
}

struct Ctl {
    args: Vec<String>,
    envs: Vec<(String, String)>,
}

impl Ctl {
    fn run(&self, args: &[&str], stdin: &str) -> (i32, String, String) {
        let mut command = Command::new(env!("CARGO_BIN_EXE_sandboxctl"));
        for var in [
            "SANDBOX_METADATA_BUCKET",
            "SANDBOX_CHECKPOINT_BUCKET",
            "STORAGE_EMULATOR_HOST",
            "SANDBOX_METADATA_MOUNT_PATH",
            "EDITOR",
            "VISUAL",
        ] {
            command.env_remove(var);
        }
        command
            .args(&self.args)
            .args(args)
            .envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    fn with_editor(&self, editor: &str) -> Self {
        let mut envs = self.envs.clone();
        envs.push(("EDITOR".into(), editor.into()));
        Self {
            args: self.args.clone(),
            envs,
        }
    }
}

async fn desired(store: &dyn Store, sandbox: &str) -> DesiredState {
    decode::<SandboxMetadata>(&store.get(&metadata_key(&id(sandbox))).await.unwrap().data)
        .unwrap()
        .spec
        .desired_state
}

/// Every operator verb on one backend; `touch` rewrites HELD's metadata
/// out of band (to provoke a conflict during `edit`).
async fn operator_verbs(store: Arc<dyn Store>, ctl: Ctl, touch: &str) {
    populate(store.clone()).await;

    let (code, out, err) = ctl.run(&["describe", HELD], "");
    assert_eq!(code, 0, "{err}");
    for expected in [
        "Sandbox:      aaaa",
        "desired_state: running",
        "Lease:",
        "holder: instance-a",
        "expires in",
        "Checkpoints:",
        "carried by lock.json: its record in metadata.json has not landed",
    ] {
        assert!(out.contains(expected), "{expected:?} in:\n{out}");
    }
    let (code, out, _) = ctl.run(&["get", HELD, "-o", "yaml"], "");
    assert_eq!(code, 0);
    assert!(
        out.contains("\"metadata\":\n") && out.contains("    \"desired_state\": \"running\""),
        "{out}"
    );

    // edit: a valid change, an invalid one (refused, named), a conflict.
    let sed = |from: &str, to: &str| {
        format!("sed -i 's/\"desired_state\": \"{from}\"/\"desired_state\": \"{to}\"/'")
    };
    let (code, out, err) = ctl
        .with_editor(&sed("running", "checkpointed"))
        .run(&["edit", HELD], "");
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        desired(store.as_ref(), HELD).await,
        DesiredState::Checkpointed
    );
    let (code, _, err) = ctl
        .with_editor(&sed("checkpointed", "runing"))
        .run(&["edit", HELD], "");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("spec.desired_state") && err.contains("nothing was written"),
        "{err}"
    );
    assert_eq!(
        desired(store.as_ref(), HELD).await,
        DesiredState::Checkpointed
    );
    let racing = format!("{touch}; {}", sed("checkpointed", "running"));
    let (code, _, err) = ctl.with_editor(&racing).run(&["edit", HELD], "");
    assert_eq!(code, 5, "{err}");
    assert!(
        err.contains("conflict") && err.contains("your edit is kept in"),
        "{err}"
    );
    let (code, out, _) = ctl.with_editor("true").run(&["edit", HELD], "");
    assert_eq!((code, out.trim()), (0, "no changes"));

    // evict / delete.
    let (code, _, err) = ctl.run(&["evict", PLAIN], "");
    assert_eq!(code, 2, "not checkpointable: {err}");
    let (code, _, err) = ctl.run(&["delete", PLAIN], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(desired(store.as_ref(), PLAIN).await, DesiredState::Deleted);
    let (code, _, _) = ctl.run(&["evict", "cccccccccccccccccccccccccccccccc"], "");
    assert_eq!(code, 3);
    let (code, _, err) = ctl.run(&["evict", TOMBSTONE], "");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("deletion is final"), "{err}");

    // break-lease: asks first.
    let (code, _, _) = ctl.run(&["break-lease", HELD], "no\n");
    assert_eq!(code, 6);
    let (code, out, err) = ctl.run(&["break-lease", HELD], &format!("{HELD}\n"));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("was held by instance-a"), "{out}");
    let lease: Lease = decode(&store.get(&lock_key(&id(HELD))).await.unwrap().data).unwrap();
    assert_eq!(lease.holder, None);

    // gc: the dry run changes nothing, the real one removes both.
    let (code, out, err) = ctl.run(&["gc", "--dry-run"], "");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("would remove deleted sandbox {TOMBSTONE}")),
        "{out}"
    );
    assert!(
        out.contains(&format!("would remove unreferenced checkpoint {ORPHAN}")),
        "{out}"
    );
    assert!(store.get(&metadata_key(&id(TOMBSTONE))).await.is_ok());
    let (code, out, _) = ctl.run(&["gc"], "");
    assert_eq!(code, 0);
    assert!(out.contains("1 tombstones, 1 checkpoints"), "{out}");
    assert!(store.get(&metadata_key(&id(TOMBSTONE))).await.is_err());
    assert!(store.get(&checkpoint_image_key(&id(ORPHAN))).await.is_err());
    assert!(
        store.get(&metadata_key(&id(HELD))).await.is_ok(),
        "live sandboxes stay"
    );
    assert!(
        store.get(&checkpoint_image_key(&id(CARRIED))).await.is_ok(),
        "a checkpoint the lock carries is referenced"
    );
}

#[tokio::test]
async fn operator_verbs_on_the_local_store() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path()).unwrap());
    let data_dir = dir.path().to_str().unwrap().to_owned();
    let touch = format!("touch {data_dir}/sandboxes/{HELD}/metadata.json");
    let ctl = Ctl {
        args: vec!["--data-dir".into(), data_dir],
        envs: Vec::new(),
    };
    operator_verbs(store, ctl, &touch).await;
}

#[tokio::test]
async fn operator_verbs_on_fake_gcs_server() {
    let store = support::gcs_store().await;
    let bucket = store.bucket().to_owned();
    let emulator = support::emulator().endpoint();
    let touch = format!(
        "curl -sf '{emulator}/storage/v1/b/{bucket}/o/sandboxes%2F{HELD}%2Fmetadata.json?alt=media' -o /tmp/held-{bucket}.json && \
         curl -sf -X POST -H 'content-type: application/json' --data-binary @/tmp/held-{bucket}.json \
         '{emulator}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=sandboxes/{HELD}/metadata.json' >/dev/null"
    );
    let ctl = Ctl {
        args: vec![
            "--metadata-bucket".into(),
            bucket.clone(),
            "--checkpoint-bucket".into(),
            bucket,
            "--storage-emulator-host".into(),
            emulator,
        ],
        envs: Vec::new(),
    };
    operator_verbs(store, ctl, &touch).await;
}

// The CLI runs as a child process waited on synchronously: the in-process
// server needs worker threads of its own meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_verbs_against_a_real_server() {
    let server = support::ws::Server::start().await;
    let ctl = Ctl {
        args: Vec::new(),
        envs: vec![("SANDBOXD_URL".into(), format!("ws://{}", server.addr))],
    };
    let (code, out, err) = ctl.run(&["run", "python", "print(1)"], "");
    assert_eq!((code, out.as_str()), (0, "1\n"), "{err}");
    let (code, out, err) = ctl.run(&["run", "bash", "echo out; echo err >&2; exit 3"], "");
    assert_eq!((code, out.as_str(), err.as_str()), (3, "out\n", "err\n"));
    let (code, out, _) = ctl.run(&["run", "python", "-"], "print(6 * 7)\n");
    assert_eq!((code, out.as_str()), (0, "42\n"));

    let (code, out, err) = ctl.run(&["create", "--checkpoint"], "");
    assert_eq!(code, 0, "{err}");
    let created: serde_json::Value = serde_json::from_str(&out).unwrap();
    let sandbox = created["sandbox_id"].as_str().unwrap().to_owned();
    let token = created["sandbox_token"].as_str().unwrap().to_owned();
    let with = |verb: &str, extra: &[&str]| {
        let mut args = vec![
            verb.to_owned(),
            sandbox.clone(),
            "--token".into(),
            token.clone(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    let args = with("attach", &["read line; echo \"got $line\"; exit 7"]);
    let (code, out, err) = ctl.run(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "hello\n",
    );
    assert_eq!((code, out.as_str()), (7, "got hello\n"), "{err}");
    let args = with("checkpoint", &["first"]);
    let (code, _, err) = ctl.run(&args.iter().map(String::as_str).collect::<Vec<_>>(), "");
    assert_eq!(code, 0, "{err}");
    let args = with("kill", &[]);
    let (code, _, err) = ctl.run(&args.iter().map(String::as_str).collect::<Vec<_>>(), "");
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = ctl.run(&args.iter().map(String::as_str).collect::<Vec<_>>(), "");
    assert_eq!(code, 3, "gone: {err}");
}

const HISTORY: &str = "ffffffffffffffffffffffffffffffff";

/// A checkpoint (image + manifest) of `sandbox`, `minutes` old, taken at
/// `epoch`; the reference a metadata document would record for it.
async fn stored_checkpoint(
    store: &dyn Store,
    checkpoint: &str,
    sandbox: &str,
    minutes: i64,
    epoch: u64,
) -> controllers::api::CheckpointRef {
    let image = checkpoint_image_key(&id(checkpoint));
    store
        .put(&image, "image".into(), PutMode::Create)
        .await
        .unwrap();
    let created_at = Utc::now() - Duration::minutes(minutes);
    let manifest = CheckpointManifest {
        api_version: CheckpointManifest::api_version(),
        checkpoint_id: checkpoint.into(),
        sandbox_id: id(sandbox),
        epoch,
        name: None,
        created_at,
        image: BlobDigest {
            key: image.to_string(),
            size: 5,
            sha256: "0".repeat(64),
        },
        runsc_version: "test".into(),
        platform: "ptrace".into(),
        cpu_features: Vec::new(),
        network: Default::default(),
        sandbox_image: Some(format!("sha256-{}", "7".repeat(64))),
        agent_version: None,
        extra: ExtraFields::new(),
    };
    store
        .put(
            &checkpoint_manifest_key(&id(checkpoint)),
            encode(&manifest),
            PutMode::Create,
        )
        .await
        .unwrap();
    controllers::api::CheckpointRef {
        bucket: "b".into(),
        path: image.to_string(),
        epoch,
        sha256: "0".repeat(64),
        size: 5,
        created_at,
        name: None,
        extra: ExtraFields::new(),
    }
}

/// `checkpoints` (table, JSON, --delete) and `gc --keep-checkpoints`: the
/// latest cannot be deleted, a named one can, and trimming keeps named ones'
/// objects even when they were also superseded.
async fn checkpoint_verbs(store: Arc<dyn Store>, ctl: Ctl) {
    let c = |n: u8| format!("{:032x}", u128::from(n) + 0x1000);
    let mut doc = SandboxMetadata::new(id(HISTORY), Utc::now(), "ab".repeat(32));
    doc.spec.enable_checkpoint = true;
    doc.status.epoch = 5;
    doc.status.phase = Phase::Checkpointed;
    doc.status.latest_checkpoint =
        Some(stored_checkpoint(store.as_ref(), &c(1), HISTORY, 1, 5).await);
    for (n, minutes) in [(2, 2), (3, 3), (4, 4)] {
        let previous = stored_checkpoint(store.as_ref(), &c(n), HISTORY, minutes, 4).await;
        doc.status.previous_checkpoints.push(previous);
    }
    // "old" names a checkpoint that is also the oldest superseded one;
    // "keep" one of its own.
    let mut old = doc.status.previous_checkpoints[2].clone();
    old.name = Some("old".into());
    doc.status.named_checkpoints.insert("old".into(), old);
    let mut keep = stored_checkpoint(store.as_ref(), &c(5), HISTORY, 10, 3).await;
    keep.name = Some("keep".into());
    doc.status.named_checkpoints.insert("keep".into(), keep);
    store
        .put(&metadata_key(&id(HISTORY)), encode(&doc), PutMode::Create)
        .await
        .unwrap();

    let (code, out, err) = ctl.run(&["checkpoints", HISTORY], "");
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("CHECKPOINT"), "{out}");
    for n in 1..=5 {
        assert!(out.contains(&c(n)), "{} in:\n{out}", c(n));
    }
    assert!(out.contains("latest") && out.contains("previous") && out.contains("named"));
    assert!(out.contains(&format!("sha256-{}", "7".repeat(64))), "{out}");
    let (code, out, _) = ctl.run(&["checkpoints", HISTORY, "-o", "json"], "");
    assert_eq!(code, 0);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.len(), 6, "latest, three previous, two named: {out}");
    assert_eq!(rows[0]["role"], "latest", "newest first: {out}");

    let (code, _, err) = ctl.run(&["checkpoints", HISTORY, "--delete", &c(1)], "");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("latest checkpoint"), "{err}");
    let (code, _, err) = ctl.run(&["checkpoints", HISTORY, "--delete", "nosuch"], "");
    assert_eq!(code, 3, "{err}");
    let (code, out, err) = ctl.run(&["checkpoints", HISTORY, "--delete", "keep"], "");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 checkpoint(s) deleted"), "{out}");
    assert!(store.get(&checkpoint_image_key(&id(&c(5)))).await.is_err());

    let (code, out, err) = ctl.run(&["gc", "--keep-checkpoints", "1", "--dry-run"], "");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "would remove superseded checkpoint {HISTORY}/{}",
            c(3)
        )),
        "{out}"
    );
    let read = || async {
        decode::<SandboxMetadata>(&store.get(&metadata_key(&id(HISTORY))).await.unwrap().data)
            .unwrap()
    };
    assert_eq!(read().await.status.previous_checkpoints.len(), 3);
    let (code, _, err) = ctl.run(&["gc", "--keep-checkpoints", "1"], "");
    assert_eq!(code, 0, "{err}");
    let status = read().await.status;
    assert_eq!(status.previous_checkpoints.len(), 1);
    assert!(status.named_checkpoints.contains_key("old"));
    assert!(store.get(&checkpoint_image_key(&id(&c(2)))).await.is_ok());
    assert!(store.get(&checkpoint_image_key(&id(&c(3)))).await.is_err());
    assert!(
        store.get(&checkpoint_image_key(&id(&c(4)))).await.is_ok(),
        "a named checkpoint's objects stay"
    );
}

#[tokio::test]
async fn checkpoint_verbs_on_the_local_store() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path()).unwrap());
    let ctl = Ctl {
        args: vec!["--data-dir".into(), dir.path().to_str().unwrap().to_owned()],
        envs: Vec::new(),
    };
    checkpoint_verbs(store, ctl).await;
}

#[tokio::test]
async fn checkpoint_verbs_on_fake_gcs_server() {
    let store = support::gcs_store().await;
    let bucket = store.bucket().to_owned();
    let ctl = Ctl {
        args: vec![
            "--metadata-bucket".into(),
            bucket.clone(),
            "--checkpoint-bucket".into(),
            bucket,
            "--storage-emulator-host".into(),
            support::emulator().endpoint(),
        ],
        envs: Vec::new(),
    };
    checkpoint_verbs(store, ctl).await;
}
