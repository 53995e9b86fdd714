//! Every reqwest client is built after the TLS provider is installed.
//!
//! reqwest is built without a default crypto provider (`src/tls.rs`), and a
//! client built before one is installed panics. Clippy's `disallowed-methods`
//! refuses the plain constructors in the server crate's library, but this
//! test binary allows disallowed methods (it reads the host's clock), so the
//! rule is checked here, over every Rust source of the workspace.

use std::path::{Path, PathBuf};

/// The constructors that skip the provider, and the two files that may call
/// them (after installing it).
const PLAIN: [&str; 3] = [
    "reqwest::Client::new(",
    "reqwest::Client::builder(",
    "reqwest::get(",
];
const ALLOWED: [&str; 2] = ["src/tls.rs", "testkit/src/lib.rs"];

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

#[test]
fn every_http_client_is_built_after_the_tls_provider() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        "src",
        "tests",
        "testkit/src",
        "bench/src",
        "controllers/src",
    ] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 100, "found only {} sources", files.len());
    let this = Path::new(file!());
    let offenders: Vec<String> = files
        .iter()
        .filter(|path| !path.ends_with(this))
        .filter(|path| !ALLOWED.iter().any(|allowed| path.ends_with(allowed)))
        .flat_map(|path| {
            let text = std::fs::read_to_string(path).unwrap();
            text.lines()
                .enumerate()
                .filter(|(_, line)| PLAIN.iter().any(|plain| line.contains(plain)))
                .map(|(n, line)| format!("{}:{}: {}", path.display(), n + 1, line.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "build HTTP clients with sandboxd::tls::http_client_builder or testkit::http_client:\n{}",
        offenders.join("\n")
    );
}
