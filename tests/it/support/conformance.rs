//! The Store conformance suite: plain async functions, each a property every
//! backend must have, run against the in-memory, local-directory and GCS
//! (fake-gcs-server) stores by `pure::store_conformance`,
//! `store::conformance` and `store::blobs`.

use std::sync::Arc;

use bytes::Bytes;
use controllers::store::{BlobSource, LIST_PAGE_SIZE, ObjectKey, PutMode, Store, StoreError};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn key(value: &str) -> ObjectKey {
    ObjectKey::new(value).unwrap()
}

pub async fn create_if_absent(store: Arc<dyn Store>) {
    let k = key("sandboxes/a/lock.json");
    let generation = store
        .put(&k, Bytes::from_static(b"{\"v\":1}"), PutMode::Create)
        .await
        .unwrap();
    let read = store.get(&k).await.unwrap();
    assert_eq!(read.data, Bytes::from_static(b"{\"v\":1}"));
    assert_eq!(read.generation, generation);

    let err = store
        .put(&k, Bytes::from_static(b"{\"v\":2}"), PutMode::Create)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::PreconditionFailed { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("sandboxes/a/lock.json"),
        "the error names the key: {err}"
    );
    assert_eq!(
        store.get(&k).await.unwrap().data,
        Bytes::from_static(b"{\"v\":1}"),
        "loser changed nothing"
    );
}

pub async fn compare_and_swap(store: Arc<dyn Store>) {
    let k = key("sandboxes/b/metadata.json");
    // Created, not overwritten: an overwrite sent twice (a hedge under
    // load) may answer with the generation its twin replaced, so no
    // conditional write starts from an overwrite's generation.
    let g1 = store
        .put(&k, Bytes::from_static(b"one"), PutMode::Create)
        .await
        .unwrap();
    let g2 = store
        .put(&k, Bytes::from_static(b"two"), PutMode::Update(g1))
        .await
        .unwrap();
    assert_ne!(g1, g2, "every write makes a new generation");

    // The stale generation loses, and changes nothing.
    let err = store
        .put(&k, Bytes::from_static(b"stale"), PutMode::Update(g1))
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::PreconditionFailed { .. }),
        "{err}"
    );
    let read = store.get(&k).await.unwrap();
    assert_eq!(
        (read.data, read.generation),
        (Bytes::from_static(b"two"), g2)
    );

    // The current one wins.
    let g3 = store
        .put(&k, Bytes::from_static(b"three"), PutMode::Update(g2))
        .await
        .unwrap();
    assert_eq!(store.get(&k).await.unwrap().generation, g3);

    // Overwrite ignores generations.
    store
        .put(&k, Bytes::from_static(b"four"), PutMode::Overwrite)
        .await
        .unwrap();
    assert_eq!(
        store.get(&k).await.unwrap().data,
        Bytes::from_static(b"four")
    );

    // A compare-and-swap against a missing object fails as a precondition.
    let missing = key("sandboxes/b/missing.json");
    let err = store
        .put(&missing, Bytes::from_static(b"x"), PutMode::Update(g3))
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::PreconditionFailed { .. }),
        "{err}"
    );
    assert!(matches!(
        store.get(&missing).await,
        Err(StoreError::NotFound { .. })
    ));
}

pub async fn concurrent_creates_have_one_winner(store: Arc<dyn Store>) {
    let k = key("sandboxes/c/lock.json");
    let attempts = (0..20).map(|i| {
        let store = store.clone();
        let k = k.clone();
        tokio::spawn(async move {
            let body = Bytes::from(format!("writer {i}"));
            store.put(&k, body, PutMode::Create).await.map(|g| (i, g))
        })
    });
    let results = futures::future::join_all(attempts).await;
    let mut winners = Vec::new();
    for result in results {
        match result.unwrap() {
            Ok(winner) => winners.push(winner),
            Err(StoreError::PreconditionFailed { .. }) => {}
            Err(other) => {
                panic!("a losing create must fail with a precondition error, got {other}")
            }
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one of 20 concurrent creates wins: {winners:?}"
    );
    let (winner, generation) = winners[0];
    let read = store.get(&k).await.unwrap();
    assert_eq!(read.data, Bytes::from(format!("writer {winner}")));
    assert_eq!(read.generation, generation);
}

/// Eight writers add one to a counter five times each, by conditional
/// writes. Each writer's bytes name it (`<count> by <writer>`), as every
/// object the server writes names its writer: a write whose answer was lost
/// and whose retry fails its precondition is recognised by its bytes
/// (`GcsStore::landed_earlier`), which two writers of the same count would
/// defeat.
pub async fn concurrent_updates_lose_nothing(store: Arc<dyn Store>) {
    let k = key("counters/shared.json");
    store
        .put(&k, Bytes::from_static(b"0 by nobody"), PutMode::Create)
        .await
        .unwrap();
    let count = |data: &[u8]| -> u64 {
        let text = std::str::from_utf8(data).unwrap();
        text.split(' ').next().unwrap().parse().unwrap()
    };
    let workers = (0..8).map(|writer| {
        let store = store.clone();
        let k = k.clone();
        tokio::spawn(async move {
            for _ in 0..5 {
                loop {
                    let current = store.get(&k).await.unwrap();
                    let n = count(&current.data);
                    match store
                        .put(
                            &k,
                            Bytes::from(format!("{} by {writer}", n + 1)),
                            PutMode::Update(current.generation),
                        )
                        .await
                    {
                        Ok(_) => break,
                        Err(StoreError::PreconditionFailed { .. }) => continue,
                        Err(other) => panic!("{other}"),
                    }
                }
            }
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker.unwrap();
    }
    assert_eq!(count(&store.get(&k).await.unwrap().data), 40);
}

pub async fn list_paginates(store: Arc<dyn Store>) {
    const COUNT: usize = 1200;
    let keys: Vec<String> = (0..COUNT)
        .map(|i| format!("list/item-{i:05}.json"))
        .collect();
    futures::stream::iter(keys.iter().cloned())
        .map(|k| {
            let store = store.clone();
            async move {
                store
                    .put(&key(&k), Bytes::from(k.clone()), PutMode::Create)
                    .await
                    .unwrap()
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    // Neighbours that the prefix must exclude.
    for other in ["lis", "listing/x.json", "a/list/y.json"] {
        store
            .put(&key(other), Bytes::from_static(b"x"), PutMode::Overwrite)
            .await
            .unwrap();
    }

    let first = store.list_page("list/", None).await.unwrap();
    assert_eq!(
        first.objects.len(),
        LIST_PAGE_SIZE,
        "the first page is full"
    );
    let token = first.next_page_token.clone().expect("a second page");
    let second = store.list_page("list/", Some(token)).await.unwrap();
    assert_eq!(second.objects.len(), COUNT - LIST_PAGE_SIZE);
    assert!(
        second.next_page_token.is_none(),
        "the last page has no token"
    );

    let all = store.list_all("list/").await.unwrap();
    let listed: Vec<String> = all.iter().map(|o| o.key.to_string()).collect();
    assert_eq!(listed, keys, "every object once, in key order");
    assert!(all.iter().all(|o| o.size == o.key.as_str().len() as u64));

    let one = store.list_all("list/item-00042").await.unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(
        one[0].generation,
        store
            .get(&key("list/item-00042.json"))
            .await
            .unwrap()
            .generation
    );
    assert!(store.list_all("nothing-here/").await.unwrap().is_empty());
}

pub async fn delete_removes(store: Arc<dyn Store>) {
    let k = key("sandboxes/d/metadata.json");
    store
        .put(&k, Bytes::from_static(b"x"), PutMode::Create)
        .await
        .unwrap();
    store.delete(&k).await.unwrap();
    assert!(matches!(
        store.get(&k).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(store.list_all("sandboxes/d/").await.unwrap().is_empty());
    assert!(matches!(
        store.delete(&k).await,
        Err(StoreError::NotFound { .. })
    ));
    // The key can be created again.
    store
        .put(&k, Bytes::from_static(b"y"), PutMode::Create)
        .await
        .unwrap();
    assert_eq!(store.get(&k).await.unwrap().data, Bytes::from_static(b"y"));
}

pub async fn missing_objects(store: Arc<dyn Store>) {
    let k = key("sandboxes/nobody/metadata.json");
    let err = store.get(&k).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    assert!(
        err.to_string().contains("sandboxes/nobody/metadata.json"),
        "{err}"
    );
    assert!(matches!(
        store.download_blob(&k).await.err(),
        Some(StoreError::NotFound { .. })
    ));
}

pub async fn invalid_keys_rejected(store: Arc<dyn Store>) {
    for bad in [
        "../escape",
        "a//b",
        "/abs",
        "a/..",
        "sp ace",
        ".sandboxd/locks/x",
    ] {
        assert!(ObjectKey::new(bad).is_err(), "{bad:?} must not be a key");
    }
    for bad_prefix in ["../", "a//", "sp ace/"] {
        let err = store.list_page(bad_prefix, None).await.unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidKey(_)),
            "{bad_prefix:?}: {err}"
        );
    }
    // A valid prefix ending in a partial segment is fine.
    store.list_page("sandboxes/ab", None).await.unwrap();
}

pub async fn blob_from_a_stream(store: Arc<dyn Store>) {
    let k = key("filesystem_snapshots/s1/archive.tar");
    let data: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
    let (mut writer, reader) = tokio::io::duplex(64 * 1024);
    let feed = data.clone();
    let feeder = tokio::spawn(async move {
        writer.write_all(&feed).await.unwrap();
    });
    let info = store
        .upload_blob(&k, BlobSource::Reader(Box::pin(reader)))
        .await
        .unwrap();
    feeder.await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    let mut back = Vec::new();
    store
        .download_blob(&k)
        .await
        .unwrap()
        .read_to_end(&mut back)
        .await
        .unwrap();
    assert_eq!(back, data);
    // One landing of these bytes: a hedged twin may have landed after it.
    assert!(store.get(&k).await.unwrap().generation >= info.generation);
}

/// A blob adopted from a file reads back the same; a store that says where
/// its blobs are on this host names a file with those bytes. The source is
/// either moved (a directory store) or left (the others), never corrupted.
pub async fn adopted_blob(store: Arc<dyn Store>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.img");
    let expected = write_pattern_file(&path, 3 << 20).await;
    let k = key("sandbox_checkpoints/ckpt-adopted/checkpoint.img");
    let info = store.adopt_blob(&k, path.clone()).await.unwrap();
    assert_eq!(info.size, 3 << 20);
    let mut reader = store.download_blob(&k).await.unwrap();
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes).await.unwrap();
    assert_eq!(hex(&Sha256::digest(&bytes)), expected);
    if let Some(local) = store.local_path(&k) {
        assert_eq!(std::fs::read(&local).unwrap(), bytes);
        assert!(!path.exists(), "a directory store moves the file, no copy");
    }
}

/// A copied blob reads back the same under its new key, the source stays,
/// and copying a missing blob says `NotFound` (a fork of a deleted checkpoint).
pub async fn copied_blob(store: Arc<dyn Store>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.img");
    let expected = write_pattern_file(&path, 2 << 20).await;
    let from = key("sandbox_checkpoints/ckpt-source/checkpoint.img");
    let to = key("sandbox_checkpoints/ckpt-copy/checkpoint.img");
    store
        .upload_blob(&from, BlobSource::File(path))
        .await
        .unwrap();
    let info = store.copy_blob(&from, &to).await.unwrap();
    assert_eq!(info.key, to);
    assert_eq!(info.size, 2 << 20);
    for k in [&from, &to] {
        let mut bytes = Vec::new();
        store
            .download_blob(k)
            .await
            .unwrap()
            .read_to_end(&mut bytes)
            .await
            .unwrap();
        assert_eq!(hex(&Sha256::digest(&bytes)), expected, "{k}");
    }
    // The copy is its own object: deleting the source leaves it.
    store.delete(&from).await.unwrap();
    assert_eq!(store.get(&to).await.unwrap().data.len(), 2 << 20);
    let missing = key("sandbox_checkpoints/ckpt-missing/checkpoint.img");
    let err = store.copy_blob(&missing, &to).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
}

/// Peak-RSS growth allowed while streaming a large blob both ways.
pub struct MemoryLimit(pub Option<u64>);

/// Streams a `size`-byte file up and back down, checking content and, where
/// asked, that peak memory stayed flat.
pub async fn large_blob_round_trip(store: Arc<dyn Store>, size: u64, limit: MemoryLimit) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.img");
    let expected = write_pattern_file(&path, size).await;
    let k = key("sandbox_checkpoints/ckpt-large/checkpoint.img");

    let baseline = reset_peak_rss();
    let info = store
        .upload_blob(&k, BlobSource::File(path.clone()))
        .await
        .unwrap();
    assert_eq!(info.size, size);
    let mut reader = store.download_blob(&k).await.unwrap();
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buffer).await.unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        total += n as u64;
    }
    let peak = peak_rss();
    assert_eq!(total, size);
    assert_eq!(
        hex(&hasher.finalize()),
        expected,
        "downloaded bytes differ from the uploaded file"
    );
    if let Some(max_growth) = limit.0 {
        let growth = peak.saturating_sub(baseline);
        eprintln!(
            "large blob: {} MB each way, peak RSS growth {} MiB",
            size / 1_000_000,
            growth >> 20
        );
        assert!(
            growth <= max_growth,
            "peak RSS grew by {} MiB streaming {} MB; memory must stay flat",
            growth >> 20,
            size / 1_000_000
        );
    }
}

/// Writes a deterministic, incompressible pattern; returns its sha256.
async fn write_pattern_file(path: &std::path::Path, size: u64) -> String {
    let mut file = tokio::fs::File::create(path).await.unwrap();
    let mut hasher = Sha256::new();
    // One pseudo-random MiB, stamped with its chunk index so no two chunks match.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut chunk = vec![0u8; 1 << 20];
    for word in chunk.chunks_exact_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        word.copy_from_slice(&state.to_le_bytes());
    }
    let mut left = size;
    let mut index = 0u64;
    while left > 0 {
        chunk[..8].copy_from_slice(&index.to_le_bytes());
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n]).await.unwrap();
        hasher.update(&chunk[..n]);
        left -= n as u64;
        index += 1;
    }
    file.sync_all().await.unwrap();
    hex(&hasher.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Resets the kernel's peak-RSS mark (VmHWM) to the current RSS and returns it.
fn reset_peak_rss() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM needs Linux >= 4.0");
    status_kib("VmRSS:") * 1024
}

fn peak_rss() -> u64 {
    status_kib("VmHWM:") * 1024
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} missing from /proc/self/status"))
}

/// Runs every case of this suite on the store `$fixture` makes, as the
/// tests of module `$backend`.
macro_rules! conformance_suite {
    ($backend:ident, $fixture:path) => {
        mod $backend {
            macro_rules! case {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let fixture = $fixture().await;
                        crate::support::conformance::$name(fixture.store.clone()).await;
                    }
                };
            }
            case!(create_if_absent);
            case!(compare_and_swap);
            case!(concurrent_creates_have_one_winner);
            case!(concurrent_updates_lose_nothing);
            case!(list_paginates);
            case!(delete_removes);
            case!(missing_objects);
            case!(invalid_keys_rejected);
            case!(blob_from_a_stream);
            case!(adopted_blob);
            case!(copied_blob);
        }
    };
}
pub(crate) use conformance_suite;
