//! `sandboxctl list` and `get` as an operator runs them, on the local store and
//! on fake-gcs-server.

use crate::support;

use std::process::Command;
use std::sync::Arc;

use chrono::Utc;
use controllers::api::{InstanceId, SandboxId, SandboxMetadata, encode};
use controllers::clock::SystemClock;
use controllers::layout::metadata_key;
use controllers::leasing::{LeaseConfig, Leases};
use controllers::store::{PutMode, Store};
use sandboxd::store::LocalStore;

const HELD: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const BROKEN: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

async fn populate(store: Arc<dyn Store>) {
    let held = SandboxId::parse(HELD).unwrap();
    let metadata = SandboxMetadata::new(held.clone(), Utc::now(), "ab".repeat(32));
    store
        .put(&metadata_key(&held), encode(&metadata), PutMode::Create)
        .await
        .unwrap();
    let leases = Leases::new(
        store.clone(),
        Arc::new(SystemClock),
        InstanceId::parse("instance-a").unwrap(),
        LeaseConfig::default(),
    );
    controllers::testing::hold(&leases, &held).await.unwrap();
    let broken = SandboxId::parse(BROKEN).unwrap();
    store
        .put(
            &metadata_key(&broken),
            "{\"apiVersion\": \"sandboxd.dev/v1\", \"spec\": 3}".into(),
            PutMode::Create,
        )
        .await
        .unwrap();
}

fn sandboxctl(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sandboxctl"));
    command.args(args);
    for var in [
        "SANDBOX_METADATA_BUCKET",
        "STORAGE_EMULATOR_HOST",
        "SANDBOX_METADATA_MOUNT_PATH",
    ] {
        command.env_remove(var);
    }
    command.envs(envs.iter().copied());
    let output = command.output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn check_listing(stdout: &str) {
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("HOLDER") && lines[0].contains("EPOCH"),
        "{stdout}"
    );
    let held = lines
        .iter()
        .find(|l| l.starts_with(HELD))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        held.contains("Pending") && held.contains("instance-a"),
        "{held}"
    );
    let broken = lines
        .iter()
        .find(|l| l.starts_with(BROKEN))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        broken.contains("INVALID") && broken.contains("spec"),
        "the bad field is named: {broken}"
    );
}

#[tokio::test]
async fn list_and_get_on_the_local_store() {
    let dir = tempfile::tempdir().unwrap();
    populate(Arc::new(LocalStore::open(dir.path()).unwrap())).await;
    let data_dir = dir.path().to_str().unwrap();

    let (code, stdout, stderr) = sandboxctl(&["--data-dir", data_dir, "list"], &[]);
    assert_eq!(code, 0, "{stderr}");
    check_listing(&stdout);

    let (code, stdout, _) = sandboxctl(&["--data-dir", data_dir, "get", HELD], &[]);
    assert_eq!(code, 0);
    let value: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(value["lock"]["holder"], "instance-a");
    assert_eq!(value["metadata"]["spec"]["desired_state"], "running");

    let (code, _, stderr) = sandboxctl(
        &[
            "--data-dir",
            data_dir,
            "get",
            "cccccccccccccccccccccccccccccccc",
        ],
        &[],
    );
    assert_eq!(code, 3, "missing sandbox: {stderr}");
    let (code, _, stderr) = sandboxctl(&["--data-dir", data_dir, "get", "../etc"], &[]);
    assert_eq!(code, 2, "invalid id: {stderr}");
    assert!(stderr.contains("32 lowercase hex"), "{stderr}");
}

#[tokio::test]
async fn list_on_fake_gcs_server() {
    let store = support::gcs_store().await;
    populate(store.clone()).await;
    let host = support::emulator().endpoint();
    let (code, stdout, stderr) = sandboxctl(
        &["list"],
        &[
            ("SANDBOX_METADATA_BUCKET", store.bucket()),
            ("STORAGE_EMULATOR_HOST", &host),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    check_listing(&stdout);
}
