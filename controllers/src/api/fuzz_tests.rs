//! Mutation fuzzing of the decoders operators' JSON goes through: thousands of
//! seeded mutations of valid documents must never panic, and whatever decodes
//! must survive an encode/decode round trip unchanged.

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::testing::mutate;

fn fuzz<T: ApiObject + PartialEq + std::fmt::Debug>(
    seed_document: &str,
    iterations: usize,
) -> usize {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut decoded = 0;
    for _ in 0..iterations {
        let input = mutate(&mut rng, seed_document.as_bytes());
        match decode::<T>(&input) {
            Ok(object) => {
                decoded += 1;
                let again: T = decode(&encode(&object)).expect("an encoded object decodes");
                assert_eq!(
                    again,
                    object,
                    "round trip of {}",
                    String::from_utf8_lossy(&input)
                );
            }
            Err(err) => assert!(!err.to_string().is_empty()),
        }
    }
    decoded
}

const METADATA: &str = include_str!("testdata/metadata.json");
const LEASE: &str = include_str!("testdata/lock.json");

#[test]
fn mutated_metadata_never_panics_and_round_trips() {
    let decoded = fuzz::<SandboxMetadata>(METADATA, 20_000);
    assert!(
        decoded > 100,
        "mutations must sometimes stay valid ({decoded})"
    );
}

#[test]
fn mutated_leases_never_panic_and_round_trip() {
    let decoded = fuzz::<Lease>(LEASE, 20_000);
    assert!(
        decoded > 100,
        "mutations must sometimes stay valid ({decoded})"
    );
}

/// An operator's edit (a far-future `renewed_at`, a huge duration
/// or epoch) must never make the lease arithmetic panic.
#[test]
fn operator_edits_of_leases_never_panic_their_arithmetic() {
    use crate::testing::edit_json;
    use chrono::{DateTime, Duration, Utc};
    const INSTANCE_LEASE: &str = r#"{"apiVersion": "sandboxd.dev/v1", "instance": "instance-a",
        "started_at": "2026-11-22T03:00:00Z", "renewed_at": "2026-11-22T03:20:10Z",
        "lease_duration_s": 30}"#;
    let mut rng = StdRng::seed_from_u64(0xed17);
    let moments = [
        DateTime::<Utc>::MIN_UTC,
        DateTime::<Utc>::UNIX_EPOCH,
        DateTime::<Utc>::MAX_UTC,
    ];
    let skews = [Duration::zero(), Duration::seconds(5), Duration::MAX];
    let mut decoded = 0;
    for _ in 0..20_000 {
        if let Ok(lease) = decode::<Lease>(&edit_json(&mut rng, LEASE.as_bytes())) {
            decoded += 1;
            let _ = lease.expires_at();
            for (now, skew) in moments.iter().zip(skews) {
                let _ = lease.is_free(*now, skew);
                let _ = lease.live_intent(*now);
            }
        }
        if let Ok(instance) =
            decode::<InstanceLease>(&edit_json(&mut rng, INSTANCE_LEASE.as_bytes()))
        {
            decoded += 1;
            let _ = instance.expires_at();
            for (now, skew) in moments.iter().zip(skews) {
                let _ = instance.is_live(*now, skew);
            }
        }
    }
    assert!(decoded > 1000, "edits must often stay valid ({decoded})");
}
