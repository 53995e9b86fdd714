//! The storage model's proxy against a real fake-gcs-server: the delay is
//! added, the per-object mutation rate answers 429, injected faults answer
//! 429/503, a partition cuts one instance off while another's proxy still
//! answers, and the records count sequential requests. Fails (never skips)
//! when fake-gcs-server is missing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use testkit::Emulator;
use testkit::storage::{Lognormal, MutationLimit, Partition, Profile, StorageModel, Tally};

/// Every request takes `ms` exactly (σ 0, no tail), mutations limited as GCS.
fn fixed(ms: u64) -> Profile {
    Profile {
        name: "fixed",
        read: Lognormal::millis(ms, 0.0),
        write: Lognormal::millis(ms, 0.0),
        list: Lognormal::millis(ms, 0.0),
        tail: None,
        body_bytes_per_s: None,
        mutation_limit: Some(MutationLimit::GCS),
    }
}

/// The tests' shared emulator, and a fresh bucket on it.
async fn bucket() -> (&'static Emulator, String) {
    let emulator = tokio::task::spawn_blocking(crate::support::emulator)
        .await
        .unwrap();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "model-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    emulator.create_bucket(&name).await.unwrap();
    (emulator, name)
}

fn client() -> reqwest::Client {
    testkit::http_client_builder()
        .timeout(Duration::from_millis(1500))
        .build()
        .unwrap()
}

async fn put(
    http: &reqwest::Client,
    (endpoint, bucket): (&str, &str),
    name: &str,
) -> Result<u16, reqwest::Error> {
    let url = format!("{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}");
    Ok(http.post(url).body("{}").send().await?.status().as_u16())
}

async fn get(
    http: &reqwest::Client,
    (endpoint, bucket): (&str, &str),
    name: &str,
) -> Result<u16, reqwest::Error> {
    let url = format!("{endpoint}/storage/v1/b/{bucket}/o/{name}?alt=media");
    Ok(http.get(url).send().await?.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_delays_limits_and_records() {
    let (emulator, bucket) = bucket().await;
    let model = StorageModel::new(emulator.socket_addr(), fixed(60));
    let proxy = model.proxy("a").await.unwrap();
    let endpoint = proxy.endpoint();
    let endpoint = (endpoint.as_str(), bucket.as_str());
    let http = client();

    // Three writes of one object pass (the burst), the next ones get 429.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(put(&http, endpoint, "hot.json").await.unwrap());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // Another object is not limited by the first one's writes.
    assert_eq!(put(&http, endpoint, "cold.json").await.unwrap(), 200);

    // Each request waits the modelled 60 ms at least.
    let started = Instant::now();
    for _ in 0..3 {
        assert_eq!(get(&http, endpoint, "cold.json").await.unwrap(), 200);
    }
    assert!(
        started.elapsed() >= Duration::from_millis(180),
        "{:?}",
        started.elapsed()
    );
    let sequential = Tally::of(&model.records_between(started, Instant::now()));
    assert_eq!(
        (sequential.total, sequential.sequential, sequential.reads),
        (3, 3, 3)
    );

    // Three at once: three requests, one round trip.
    let started = Instant::now();
    let (x, y, z) = tokio::join!(
        get(&http, endpoint, "cold.json"),
        get(&http, endpoint, "hot.json"),
        get(&http, endpoint, "cold.json"),
    );
    assert_eq!((x.unwrap(), y.unwrap(), z.unwrap()), (200, 200, 200));
    let parallel = Tally::of(&model.records_between(started, Instant::now()));
    assert_eq!((parallel.total, parallel.sequential), (3, 1));

    let all = Tally::of(&model.records());
    assert_eq!(all.throttled, 2);
    assert_eq!((all.writes, all.reads), (6, 6));
    let hot = model
        .records()
        .iter()
        .filter(|r| r.object == "hot.json" && r.status == 429)
        .count();
    assert_eq!(hot, 2, "the 429s name their object");

    // Every request refused at random: 429 or 503, never passed on.
    model.set_transient_faults(1.0);
    for _ in 0..6 {
        let status = get(&http, endpoint, "cold.json").await.unwrap();
        assert!(status == 429 || status == 503, "{status}");
    }
    assert_eq!(Tally::of(&model.records()).injected, 6);
    model.set_transient_faults(0.0);
    assert_eq!(get(&http, endpoint, "cold.json").await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_cuts_one_instance_off() {
    let (emulator, bucket) = bucket().await;
    let model = StorageModel::new(emulator.socket_addr(), Profile::loopback());
    let a = model.proxy("a").await.unwrap();
    let b = model.proxy("b").await.unwrap();
    let (a_end, b_end) = (a.endpoint(), b.endpoint());
    let (a_at, b_at) = (
        (a_end.as_str(), bucket.as_str()),
        (b_end.as_str(), bucket.as_str()),
    );
    assert_ne!(a.endpoint(), b.endpoint());
    let http = client();
    assert_eq!(put(&http, a_at, "x.json").await.unwrap(), 200);

    // Refused: fails fast with a connection error; B still answers.
    a.set_partition(Partition::Refuse);
    let started = Instant::now();
    let refused = get(&http, a_at, "x.json").await;
    assert!(refused.is_err(), "{refused:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(get(&http, b_at, "x.json").await.unwrap(), 200);

    // Black-holed: nothing comes back until the client's own deadline.
    a.set_partition(Partition::BlackHole);
    let started = Instant::now();
    let held = get(&http, a_at, "x.json").await;
    assert!(
        held.as_ref().is_err_and(reqwest::Error::is_timeout),
        "{held:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(1400));
    assert_eq!(get(&http, b_at, "x.json").await.unwrap(), 200);

    // Healed: A reaches the bucket again (a fresh client: the old one's
    // connection may still wait).
    a.set_partition(Partition::Connected);
    assert_eq!(get(&client(), a_at, "x.json").await.unwrap(), 200);
    assert!(
        model
            .records()
            .iter()
            .all(|r| r.instance == "a" || r.instance == "b")
    );
}
