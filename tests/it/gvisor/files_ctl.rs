//! `sandboxctl cp | ls | cat` and the client's filesystem API against the
//! real server on runsc: a directory tree copied into a sandbox and back
//! keeps its contents and permission bits (checked inside the sandbox too).

use crate::support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use sandboxd::client::{AttachOptions, Language, Sandbox};
use sandboxd::ctl::{CpSide, FilesCommand, run_files_command};
use serde_json::json;
use support::ws::Server;

/// Every file and directory under `root`: relative path -> (mode, contents;
/// `None` for a directory).
fn tree(root: &Path) -> BTreeMap<String, (u32, Option<Vec<u8>>)> {
    let mut found = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.permissions().mode() & 0o7777;
            if meta.is_dir() {
                found.insert(rel, (mode, None));
                stack.push(path);
            } else {
                found.insert(rel, (mode, Some(std::fs::read(&path).unwrap())));
            }
        }
    }
    found
}

fn write(path: &Path, data: &[u8], mode: u32) {
    std::fs::write(path, data).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn mkdir(path: &Path, mode: u32) {
    std::fs::create_dir(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_of_a_tree_both_ways_keeps_contents_and_modes() {
    let server = Server::start().await;
    let (ws, id, token) = server.create(json!({"idle_timeout": 300})).await;
    ws.close().await;
    let url = server.url("");
    let local = tempfile::tempdir().unwrap();
    let src = local.path().join("project");
    mkdir(&src, 0o750);
    write(&src.join("notes.txt"), b"hello\n", 0o640);
    mkdir(&src.join("bin"), 0o700);
    write(&src.join("bin/run.sh"), b"#!/bin/sh\necho ran\n", 0o755);
    mkdir(&src.join("empty"), 0o755);
    let big: Vec<u8> = (0..(3 << 20) + 5)
        .map(|i: u32| (i * 7 % 251) as u8)
        .collect();
    write(&src.join("bin/blob.bin"), &big, 0o600);

    let cp = |from: String, to: String| FilesCommand::Cp {
        url: url.clone(),
        token: token.clone(),
        from: CpSide::parse(&from),
        to: CpSide::parse(&to),
    };
    // Each command closes with the handshake before it returns: the next
    // one, at once, finds the sandbox's one attach slot free.
    assert_eq!(
        run_files_command(cp(
            src.display().to_string(),
            format!("{id}:/home/sandbox/project"),
        ))
        .await
        .unwrap(),
        0
    );

    // Inside the sandbox: the same modes, the same bytes, runnable.
    let sandbox = Sandbox::attach(&url, &id, &token, AttachOptions::default())
        .await
        .unwrap();
    let output = sandbox
        .exec(
            Language::Bash,
            "cd ~/project && stat -c '%a %n' . notes.txt bin bin/run.sh bin/blob.bin empty && ./bin/run.sh && sha256sum bin/blob.bin | cut -c1-64",
        )
        .await
        .unwrap()
        .output()
        .await
        .unwrap();
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&big));
    assert_eq!(
        output.stdout,
        format!(
            "750 .\n640 notes.txt\n700 bin\n755 bin/run.sh\n600 bin/blob.bin\n755 empty\nran\n{digest}\n"
        ),
        "{}",
        output.stderr
    );
    // A file onto an existing directory lands inside it.
    write(&local.path().join("single.txt"), b"one", 0o604);
    let listing_before = sandbox.list("project", 1).await.unwrap().entries.len();
    sandbox.close().await;
    let single = local.path().join("single.txt").display().to_string();
    assert_eq!(
        run_files_command(cp(single, format!("{id}:project")))
            .await
            .unwrap(),
        0
    );

    // And back: the tree that comes out is the tree that went in.
    let back = local.path().join("back");
    assert_eq!(
        run_files_command(cp(
            format!("{id}:/home/sandbox/project"),
            back.display().to_string()
        ))
        .await
        .unwrap(),
        0
    );
    let mut expected = tree(&src);
    expected.insert("single.txt".into(), (0o604, Some(b"one".to_vec())));
    assert_eq!(tree(&back), expected);
    assert_eq!(
        std::fs::metadata(&back).unwrap().permissions().mode() & 0o7777,
        0o750
    );
    assert_eq!(
        listing_before + 1,
        expected.keys().filter(|k| !k.contains('/')).count()
    );

    // The binary: ls and cat, as a user types them.
    let ctl = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sandboxctl"))
            .args(args)
            .args(["--token", &token, "--url", &url])
            .output()
            .unwrap()
    };
    let cat = ctl(&["cat", &id, "project/notes.txt"]);
    assert!(cat.status.success(), "{cat:?}");
    assert_eq!(cat.stdout, b"hello\n");
    let ls = ctl(&["ls", &id, "project"]);
    assert!(ls.status.success(), "{ls:?}");
    let text = String::from_utf8(ls.stdout).unwrap();
    assert!(text.contains("d0700"), "{text}");
    assert!(text.contains("-0640            6 notes.txt"), "{text}");
    let missing = ctl(&["cat", &id, "project/nothing"]);
    assert_eq!(missing.status.code(), Some(3), "{missing:?}");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("ENOENT"));
}
