//! Two OS processes hammering one local-directory key with compare-and-swap:
//! the local store's locking must hold across processes, not just threads.
//!
//! The parent test re-runs this test binary twice as workers (selecting the
//! `hammer_worker` test and passing the directory in the environment). Each
//! worker increments a counter object 200 times with read + CAS, retrying lost
//! races. If two writers ever both won against one generation, an increment
//! would be lost and the final count would fall short of the reported wins.

use std::process::Command;
use std::time::Instant;

use bytes::Bytes;
use controllers::store::{ObjectKey, PutMode, Store, StoreError};
use sandboxd::store::LocalStore;

const WINS_PER_WORKER: u64 = 200;
const DIR_ENV: &str = "SANDBOXD_HAMMER_DIR";

fn counter_key() -> ObjectKey {
    ObjectKey::new("counters/hammer.json").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_hammering_one_key_never_both_win() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::open(dir.path()).unwrap();
    store
        .put(&counter_key(), Bytes::from_static(b"0"), PutMode::Create)
        .await
        .unwrap();

    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args([
                    "pure::local_store_processes::hammer_worker",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(DIR_ENV, dir.path())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut total_wins = 0;
    let mut total_conflicts = 0;
    for worker in workers {
        let output = worker.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "worker failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report = stdout
            .lines()
            .find_map(|line| line.split_once("HAMMER ").map(|(_, report)| report))
            .unwrap_or_else(|| panic!("worker printed no report:\n{stdout}"));
        let numbers: Vec<u64> = report
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect();
        total_wins += numbers[0];
        total_conflicts += numbers[1];
    }
    let final_count: u64 = std::str::from_utf8(&store.get(&counter_key()).await.unwrap().data)
        .unwrap()
        .parse()
        .unwrap();
    eprintln!(
        "2 processes: {total_wins} wins, {total_conflicts} lost races, {:?}",
        started.elapsed()
    );
    assert_eq!(total_wins, 2 * WINS_PER_WORKER);
    assert_eq!(
        final_count, total_wins,
        "an increment was lost: two writers won one generation"
    );
    assert!(
        total_conflicts > 0,
        "the workers never raced; the test proved nothing"
    );
}

/// The worker half, run only by the test above (as an ignored test, so
/// that a plain run does not report it as a test that passed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker the cross-process test starts; not a test of its own"]
async fn hammer_worker() {
    let dir =
        std::env::var(DIR_ENV).expect("started by the cross-process test, with its directory");
    let store = LocalStore::open(dir).unwrap();
    let (mut wins, mut conflicts) = (0u64, 0u64);
    while wins < WINS_PER_WORKER {
        let current = store.get(&counter_key()).await.unwrap();
        let n: u64 = std::str::from_utf8(&current.data).unwrap().parse().unwrap();
        let next = Bytes::from((n + 1).to_string());
        match store
            .put(&counter_key(), next, PutMode::Update(current.generation))
            .await
        {
            Ok(_) => wins += 1,
            Err(StoreError::PreconditionFailed { .. }) => conflicts += 1,
            Err(other) => panic!("{other}"),
        }
    }
    println!("HAMMER {wins} {conflicts}");
}
