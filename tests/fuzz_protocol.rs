//! Mutation fuzzing of the WebSocket message parsers: seeded mutations of
//! every kind of client frame (and of init messages) must never panic; each is
//! either parsed or refused with a message. `FUZZ_ITERATIONS` sets the count
//! per seed frame (CI: 5,000; a longer run:
//! `FUZZ_ITERATIONS=1000000 cargo test --release --test fuzz_protocol`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]

use controllers::testing::mutate;
use rand::SeedableRng;
use rand::rngs::StdRng;
use sandboxd::api::protocol::{ClientFrame, InitMessage};

const FRAMES: [&str; 9] = [
    r#"{"language":"python","code":"print(1)"}"#,
    r#"{"language":"bash","code":"echo hi","session":false}"#,
    r#"{"event":"stdin","data":"line\n"}"#,
    r#"{"action":"kill_process"}"#,
    r#"{"action":"kill_sandbox"}"#,
    r#"{"action":"checkpoint","name":"before-upgrade"}"#,
    r#"{"action":"snapshot_filesystem","name":"snap"}"#,
    r#"{"action":"reconnect"}"#,
    r#"{"idle_timeout": 60, "enable_checkpoint": true, "enable_sandbox_handoff": true, "filesystem_snapshot_name": "x"}"#,
];

fn iterations() -> usize {
    std::env::var("FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000)
}

#[test]
fn mutated_frames_never_panic_and_every_refusal_says_why() {
    let mut rng = StdRng::seed_from_u64(0xf7a3e);
    let (mut parsed, mut refused) = (0usize, 0usize);
    for seed in FRAMES {
        for _ in 0..iterations() {
            let bytes = mutate(&mut rng, seed.as_bytes());
            let text = String::from_utf8_lossy(&bytes);
            for outcome in [
                ClientFrame::parse(&text).map(|_| ()),
                InitMessage::parse(&text).map(|_| ()),
            ] {
                match outcome {
                    Ok(()) => parsed += 1,
                    Err(err) => {
                        refused += 1;
                        assert!(!err.to_string().is_empty());
                    }
                }
            }
        }
    }
    assert!(
        parsed > 100 && refused > 100,
        "parsed {parsed}, refused {refused}"
    );
}
