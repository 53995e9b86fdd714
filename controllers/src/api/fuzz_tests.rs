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
