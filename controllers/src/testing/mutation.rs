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

/// Values an operator (or a hostile writer) might put in a field: extremes
/// of every JSON type, timestamps at the ends of what `chrono` holds.
const EDIT_VALUES: [&str; 24] = [
    "null",
    "true",
    "0",
    "-1",
    "1",
    "18446744073709551615",
    "9223372036854775807",
    "-9223372036854775808",
    "9007199254740992",
    "1e308",
    "-1e308",
    "0.5",
    "\"\"",
    "\"x\"",
    "\"+262142-12-31T23:59:59Z\"",
    "\"-262143-01-01T00:00:00Z\"",
    "\"9999-12-31T23:59:59.999999999Z\"",
    "\"1970-01-01T00:00:00Z\"",
    "\"2026-11-22T03:00:00Z\"",
    "\"../../etc/passwd\"",
    "[]",
    "{}",
    "[null]",
    "{\"x\": 1}",
];

/// Edits `input` (a JSON document) as an operator might: one to three
/// fields replaced by extreme values, removed, or copied from elsewhere in the
/// document; a document that is not JSON gets byte mutations instead.
pub fn edit_json(rng: &mut StdRng, input: &[u8]) -> Vec<u8> {
    let Ok(mut document) = serde_json::from_slice::<serde_json::Value>(input) else {
        return mutate(rng, input);
    };
    for _ in 0..rng.random_range(1..=3) {
        let mut paths = Vec::new();
        collect_paths(&document, &mut Vec::new(), &mut paths);
        if paths.is_empty() {
            break;
        }
        let path = paths[rng.random_range(0..paths.len())].clone();
        let replacement = match rng.random_range(0..4) {
            0 => None,
            1 => {
                let other = &paths[rng.random_range(0..paths.len())];
                pointer(&document, other).cloned()
            }
            _ => serde_json::from_str(EDIT_VALUES[rng.random_range(0..EDIT_VALUES.len())]).ok(),
        };
        set(&mut document, &path, replacement);
    }
    serde_json::to_vec_pretty(&document).unwrap_or_default()
}

/// A path is a list of object keys and array indices (as strings).
fn collect_paths(value: &serde_json::Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, child) in map {
                at.push(key.clone());
                out.push(at.clone());
                collect_paths(child, at, out);
                at.pop();
            }
        }
        serde_json::Value::Array(items) => {
            for (index, child) in items.iter().enumerate() {
                at.push(index.to_string());
                out.push(at.clone());
                collect_paths(child, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn pointer<'a>(value: &'a serde_json::Value, path: &[String]) -> Option<&'a serde_json::Value> {
    path.iter().try_fold(value, |value, segment| match value {
        serde_json::Value::Object(map) => map.get(segment),
        serde_json::Value::Array(items) => items.get(segment.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Sets (or, with `None`, removes) the value at `path`.
fn set(document: &mut serde_json::Value, path: &[String], value: Option<serde_json::Value>) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut parent = document;
    for segment in parents {
        let next = match parent {
            serde_json::Value::Object(map) => map.get_mut(segment),
            serde_json::Value::Array(items) => segment
                .parse::<usize>()
                .ok()
                .and_then(|index| items.get_mut(index)),
            _ => None,
        };
        let Some(next) = next else { return };
        parent = next;
    }
    match (parent, value) {
        (serde_json::Value::Object(map), Some(value)) => {
            map.insert(last.clone(), value);
        }
        (serde_json::Value::Object(map), None) => {
            map.remove(last);
        }
        (serde_json::Value::Array(items), value) => {
            if let Ok(index) = last.parse::<usize>()
                && index < items.len()
            {
                match value {
                    Some(value) => items[index] = value,
                    None => {
                        items.remove(index);
                    }
                }
            }
        }
        _ => {}
    }
}
