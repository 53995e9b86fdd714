//! The Rust client library against real servers on runsc: the whole API, a
//! connection cut mid-execution (the output still arrives complete), and an
//! instance going away behind the local affinity proxy (the sandbox moves and
//! the client carries on without noticing), also with an execution running
//! (`keep_executions`: its output and stdin follow the sandbox).

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandboxd::client::{AttachOptions, ClientError, CreateOptions, Language, OutputChunk, Sandbox};
use support::cutter::Cutter;
use support::process::Launch;
use support::ws::Server;

fn checkpointable() -> CreateOptions {
    CreateOptions {
        idle_timeout_s: Some(300),
        enable_checkpoint: true,
        enable_sandbox_handoff: true,
        ..CreateOptions::default()
    }
}

#[tokio::test]
async fn the_library_drives_the_whole_api() {
    let server = Server::start().await;
    let url = format!("http://{}", server.addr);
    let sandbox = Sandbox::create(&url, checkpointable()).await.unwrap();

    let output = sandbox
        .exec(Language::Bash, "echo out; echo err >&2; exit 4")
        .await
        .unwrap()
        .output()
        .await
        .unwrap();
    assert_eq!(
        (output.stdout.as_str(), output.stderr.as_str()),
        ("out\n", "err\n")
    );
    assert_eq!(output.status.code, Some(4));

    let mut process = sandbox
        .exec(Language::Python, "print(input()[::-1])")
        .await
        .unwrap();
    process.write_stdin("olleh\n").unwrap();
    // Unbuffered Python writes "hello" and "\n" separately: they may arrive
    // as one chunk or two.
    let mut stdout = String::new();
    while !stdout.ends_with('\n') {
        match process.next().await.unwrap() {
            Some(OutputChunk::Stdout(text)) => stdout.push_str(&text),
            other => panic!("expected stdout, got {other:?}"),
        }
    }
    assert_eq!(stdout, "hello\n");
    assert!(process.wait().await.unwrap().success());

    let process = sandbox.exec(Language::Bash, "sleep 600").await.unwrap();
    process.kill().unwrap();
    let status = process.wait().await.unwrap();
    assert!(status.killed, "{status:?}");

    sandbox
        .exec(Language::PythonSession, "total = 40")
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    sandbox.snapshot_filesystem("client-snap").await.unwrap();
    assert!(matches!(
        sandbox.snapshot_filesystem("Not Valid").await,
        Err(ClientError::Snapshot(message)) if message.contains("invalid snapshot name")
    ));
    sandbox.checkpoint(Some("first")).await.unwrap();
    let (id, token) = (sandbox.id().to_owned(), sandbox.token().to_owned());
    sandbox.close().await;

    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let recorder = Arc::clone(&seen);
    let options = AttachOptions {
        progress: sandboxd::client::Progress::new(move |status| {
            recorder.lock().unwrap().push(status.to_owned());
        }),
        ..AttachOptions::default()
    };
    let sandbox = Sandbox::attach(&url, &id, &token, options).await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "SANDBOX_RESTORING",
            "SANDBOX_LOCK_ACQUIRING",
            "SANDBOX_LOCK_ACQUIRED",
            "SANDBOX_RUNNING"
        ],
        "progress is reported while the server restores"
    );
    let output = sandbox
        .exec(Language::PythonSession, "print(total + 2)")
        .await
        .unwrap()
        .output()
        .await
        .unwrap();
    assert_eq!(output.stdout, "42\n");
    sandbox.kill().await.unwrap();

    assert_eq!(
        Sandbox::attach(&url, &id, &token, AttachOptions::default())
            .await
            .unwrap_err(),
        ClientError::NotFound
    );
    assert!(matches!(
        Sandbox::attach(&url, &SandboxIdText::fresh(), "x", AttachOptions::default()).await,
        Err(ClientError::NotFound)
    ));
}

struct SandboxIdText;
impl SandboxIdText {
    fn fresh() -> String {
        controllers::api::SandboxId::random().to_string()
    }
}

#[tokio::test]
async fn typed_errors_carry_the_servers_message() {
    let server = Server::start().await;
    let url = format!("ws://{}", server.addr);
    let err = Sandbox::create(
        &url,
        CreateOptions {
            enable_sandbox_handoff: true,
            ..CreateOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(
        err,
        ClientError::Creation("Sandbox handoff requires checkpointing to be enabled.".into())
    );
    let sandbox = Sandbox::create(&url, CreateOptions::default())
        .await
        .unwrap();
    let err = Sandbox::attach(&url, sandbox.id(), "wrong", AttachOptions::default())
        .await
        .unwrap_err();
    // Answered as an unknown id: a wrong token learns nothing.
    assert_eq!(err, ClientError::NotFound);
}

#[tokio::test]
async fn a_cut_connection_mid_execution_still_delivers_all_the_output() {
    let server = Server::start().await;
    let cutter = Cutter::to(server.addr.clone()).await;
    let sandbox = Sandbox::create(&format!("ws://{}", cutter.addr), checkpointable())
        .await
        .unwrap();
    let mut process = sandbox
        .exec(
            Language::Bash,
            "echo line1; sleep 1; for i in $(seq 2 200); do echo line$i; done; sleep 0.5; echo end",
        )
        .await
        .unwrap();
    assert_eq!(
        process.next().await.unwrap(),
        Some(OutputChunk::Stdout("line1\n".into()))
    );
    cutter.cut();
    // Stdin written while disconnected is kept for the new connection.
    process.write_stdin("ignored\n").unwrap();
    let mut rest = String::new();
    while let Some(chunk) = process.next().await.unwrap() {
        if let OutputChunk::Stdout(data) = chunk {
            rest.push_str(&data);
        }
    }
    let expected: String = (2..=200).map(|i| format!("line{i}\n")).collect::<String>() + "end\n";
    assert_eq!(rest, expected);
    // And the sandbox is still usable through the new connection.
    let output = sandbox
        .exec(Language::Bash, "echo after")
        .await
        .unwrap()
        .output()
        .await
        .unwrap();
    assert_eq!(output.stdout, "after\n");
}

#[tokio::test]
async fn an_instance_going_away_behind_the_proxy_is_invisible_to_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let a = Launch::new("lib-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let b = Launch::new("lib-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let proxy = support::proxy::Proxy::start(dir.path(), &[&a, &b]).await;
    let sandbox = Sandbox::create(&proxy.url(), checkpointable())
        .await
        .unwrap();
    sandbox
        .exec(Language::PythonSession, "where = 'remembered'")
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    // Which instance got it? Stop that one (Cloud Run scaling in): it drains.
    let listed = |server: &support::process::ServerProcess| {
        let url = format!("http://{}/list", server.addr);
        async move {
            testkit::http_client()
                .get(url)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()["sandboxes"]
                .as_array()
                .map_or(0, Vec::len)
        }
    };
    let (mut home, other) = if listed(&a).await == 1 {
        (a, b)
    } else {
        (b, a)
    };
    // Returns once the drain is over and the process has exited.
    home.signal("-TERM");
    // The library reconnects through the proxy on its own, lands on the
    // other instance, which restores the drained checkpoint. Waited for, so
    // the exec below follows the library's reading of the close: a frame
    // written to the dead socket before that can be lost (a gap of the
    // library's, not this test's subject).
    let deadline = Instant::now() + Duration::from_secs(60);
    while listed(&other).await != 1 {
        assert!(
            Instant::now() < deadline,
            "the library never reconnected to the other instance"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let output = sandbox
        .exec(Language::PythonSession, "print(where)")
        .await
        .unwrap()
        .output()
        .await
        .unwrap();
    assert_eq!(output.stdout, "remembered\n");
    assert_eq!(support::eventually(|| listed(&other), |n| *n == 1).await, 1);
}

#[tokio::test]
async fn back_to_back_executions_never_lose_the_next_ones_output() {
    // Regression: the driver cleared the process slot after routing DONE,
    // and could clear the NEXT execution's slot when the caller was quicker.
    let server = Server::start().await;
    let sandbox = Sandbox::create(&format!("ws://{}", server.addr), CreateOptions::default())
        .await
        .unwrap();
    for i in 0..40 {
        let output = sandbox
            .exec(Language::Bash, &format!("echo {i}"))
            .await
            .unwrap()
            .output()
            .await
            .unwrap();
        assert_eq!(output.stdout, format!("{i}\n"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_execution_follows_a_drained_instance_with_its_output_and_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let a = Launch::new("keep-lib-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let b = Launch::new("keep-lib-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let proxy = support::proxy::Proxy::start(dir.path(), &[&a, &b]).await;
    let sandbox = Sandbox::create(
        &proxy.url(),
        CreateOptions {
            keep_executions: true,
            ..checkpointable()
        },
    )
    .await
    .unwrap();
    let mut process = sandbox
        .exec(
            Language::Python,
            "import sys, time\n\
             print('before', sys.stdin.readline().strip(), flush=True)\n\
             for i in range(1, 101):\n    print(i, flush=True)\n    time.sleep(0.05)\n\
             print('after', sys.stdin.readline().strip(), flush=True)\n\
             sys.exit(3)\n",
        )
        .await
        .unwrap();
    process.write_stdin("one\n").unwrap();
    let mut stdout = String::new();
    while stdout.matches('\n').count() < 11 {
        match process.next().await.unwrap() {
            Some(OutputChunk::Stdout(data)) => stdout.push_str(&data),
            Some(OutputChunk::Stderr(data)) => panic!("stderr: {data}"),
            None => panic!("ended early: {stdout}"),
        }
    }
    // Stop the instance that holds it: the drain checkpoints the running
    // execution, the library follows the sandbox to the other instance.
    let listed = |server: &support::process::ServerProcess| {
        let url = format!("http://{}/list", server.addr);
        async move {
            testkit::http_client()
                .get(url)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()["sandboxes"]
                .as_array()
                .map_or(0, Vec::len)
        }
    };
    let (mut home, other) = if listed(&a).await == 1 {
        (a, b)
    } else {
        (b, a)
    };
    tokio::task::block_in_place(|| home.signal("-TERM"));
    // Written while the library reconnects: buffered, then delivered to the
    // process on the other instance.
    process.write_stdin("two\n").unwrap();
    let output = process.output().await.unwrap();
    stdout.push_str(&output.stdout);
    let expected = "before one\n".to_owned()
        + &(1..=100).map(|i| format!("{i}\n")).collect::<String>()
        + "after two\n";
    assert_eq!(stdout, expected, "stderr: {}", output.stderr);
    assert_eq!(output.status.code, Some(3));
    assert!(!output.status.killed);
    assert_eq!(listed(&other).await, 1);
}
