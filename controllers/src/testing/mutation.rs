//! Seeded random edits of valid inputs, for mutation fuzzing of decoders.

use rand::Rng;
use rand::rngs::StdRng;

const TOKENS: [&str; 12] = [
    "null",
    "\"x\"",
    "-1",
    "{}",
    "[]",
    "1e999",
    "\"\\u0000\"",
    "true",
    "18446744073709551616",
    ",",
    "\"",
    "}",
];

/// Applies one to three random edits to `input`.
pub fn mutate(rng: &mut StdRng, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.random_range(1..=3) {
        if out.is_empty() {
            out.extend_from_slice(b"{");
        }
        let at = rng.random_range(0..out.len());
        match rng.random_range(0..6) {
            0 => out[at] ^= 1 << rng.random_range(0..8),
            1 => {
                let end = (at + rng.random_range(1..16)).min(out.len());
                out.drain(at..end);
            }
            2 => {
                let end = (at + rng.random_range(1..32)).min(out.len());
                let copy = out[at..end].to_vec();
                out.splice(at..at, copy);
            }
            3 => {
                let token = TOKENS[rng.random_range(0..TOKENS.len())];
                out.splice(at..at, token.bytes());
            }
            4 => out.truncate(at),
            _ => out[at] = rng.random(),
        }
    }
    out
}
