//! GCS-specific checks against the real emulator: what the store writes is really
//! in the bucket, edits made by others through the plain HTTP API are seen, and
//! an unreachable endpoint fails loudly instead of hanging.

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use controllers::store::{BlobSource, ObjectKey, PutMode, Store, StoreError};
use sandboxd::store::{GcsConfig, GcsStore};

fn key(value: &str) -> ObjectKey {
    ObjectKey::new(value).unwrap()
}

#[tokio::test]
async fn written_bytes_are_in_the_emulator_bucket() {
    let store = support::gcs_store().await;
    let k = key("sandboxes/0123/metadata.json");
    let body = Bytes::from_static(b"{\n  \"apiVersion\": \"sandboxd.dev/v1\"\n}\n");
    let generation = store.put(&k, body.clone(), PutMode::Create).await.unwrap();

    let http = testkit::http_client();
    let response = http
        .get(format!(
            "{}?alt=media",
            support::object_url(store.bucket(), k.as_str())
        ))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    let header = response
        .headers()
        .get("x-goog-generation")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(
        header,
        Some(generation.to_string()),
        "the emulator reports the same generation"
    );
    assert_eq!(response.bytes().await.unwrap(), body);

    // A blob too: its size and content as the emulator sees them.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.img");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let blob = key("sandbox_checkpoints/c1/checkpoint.img");
    store
        .upload_blob(&blob, BlobSource::File(path))
        .await
        .unwrap();
    let metadata: serde_json::Value = http
        .get(support::object_url(store.bucket(), blob.as_str()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(metadata["size"], data.len().to_string());
    let content = http
        .get(format!(
            "{}?alt=media",
            support::object_url(store.bucket(), blob.as_str())
        ))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(content == data, "blob content differs in the emulator");
}

#[tokio::test]
async fn an_edit_through_the_http_api_defeats_a_stale_compare_and_swap() {
    let store = support::gcs_store().await;
    let k = key("sandboxes/0456/metadata.json");
    let generation = store
        .put(&k, Bytes::from_static(b"{\"v\":1}"), PutMode::Create)
        .await
        .unwrap();

    // An operator (or another tool) rewrites the object directly.
    let upload = format!(
        "{}/upload/storage/v1/b/{}/o?uploadType=media&name={}",
        support::emulator().endpoint(),
        store.bucket(),
        k.as_str()
    );
    let response = testkit::http_client()
        .post(upload)
        .header("content-type", "application/json")
        .body("{\"v\":\"operator\"}")
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());

    let err = store
        .put(
            &k,
            Bytes::from_static(b"{\"v\":2}"),
            PutMode::Update(generation),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::PreconditionFailed { .. }),
        "{err}"
    );
    let read = store.get(&k).await.unwrap();
    assert_eq!(read.data, Bytes::from_static(b"{\"v\":\"operator\"}"));
    assert_ne!(read.generation, generation);
}

#[tokio::test]
async fn an_unreachable_endpoint_fails_with_a_transient_error() {
    // A loopback address with nothing on port 80.
    let host = support::free_loopback(121..=250);
    let mut config = GcsConfig::new("nowhere").with_emulator_host(&format!("{host}:80"));
    config.retry = support::test_retries();
    let store = GcsStore::connect(config).await.unwrap();
    let started = Instant::now();
    let err = store.get(&key("sandboxes/x/lock.json")).await.unwrap_err();
    assert!(err.is_transient(), "connection refused is transient: {err}");
    assert!(err.to_string().contains("sandboxes/x/lock.json"), "{err}");
    let err = store.list_page("sandboxes/", None).await.unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "retries are bounded"
    );
}
