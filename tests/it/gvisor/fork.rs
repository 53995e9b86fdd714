//! Forks on real runsc through the Rust client: three forks of one named
//! checkpoint start at once, each has the source's Python session and its
//! background process, and each then diverges without touching the others or
//! the source; a fork on another instance over fake-gcs-server (the store's
//! server-side copy); a wrong token, an unknown sandbox and a sandbox without
//! a checkpoint are refused, the first two with the same words.

use crate::support;

use std::time::Duration;

use sandboxd::client::{AttachOptions, ClientError, CreateOptions, ForkSource, Language, Sandbox};
use support::ws::Server;

fn checkpointable() -> CreateOptions {
    CreateOptions {
        idle_timeout_s: Some(300),
        enable_checkpoint: true,
        enable_sandbox_handoff: true,
        ..CreateOptions::default()
    }
}

fn fork_of(id: &str, token: &str, name: Option<&str>) -> CreateOptions {
    CreateOptions {
        from_checkpoint: Some(ForkSource {
            sandbox_id: id.to_owned(),
            sandbox_token: token.to_owned(),
            name: name.map(str::to_owned),
        }),
        ..checkpointable()
    }
}

async fn stdout(sandbox: &Sandbox, language: Language, code: &str) -> String {
    let output = sandbox
        .exec(language, code)
        .await
        .unwrap()
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{code}: {output:?}");
    output.stdout
}

/// Waits (up to 5 s) for the background process's heartbeat file.
const HEARTBEAT: &str = "for _ in $(seq 50); do [ -s /tmp/alive ] && exec cat /tmp/alive; \
                         sleep 0.1; done; echo no heartbeat >&2; exit 1";

/// The heartbeat the background process writes, read until it moved on
/// (10 s at most: a loaded host may run its 0.2 s loop late).
async fn background_runs(sandbox: &Sandbox) {
    let first = stdout(sandbox, Language::Bash, HEARTBEAT).await;
    assert!(!first.is_empty(), "no heartbeat at all");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let second = loop {
        let second = stdout(sandbox, Language::Bash, HEARTBEAT).await;
        if second != first || std::time::Instant::now() > deadline {
            break second;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_ne!(first, second, "the background process does not run");
}

/// The source: a Python session variable, a background process beating
/// into /tmp/alive, and a file; checkpointed as "base" (which stops it).
async fn source_with_state(url: &str) -> (String, String) {
    let source = Sandbox::create(url, checkpointable()).await.unwrap();
    stdout(&source, Language::PythonSession, "counter = 41").await;
    stdout(
        &source,
        Language::Bash,
        "setsid sh -c 'while true; do date +%s%N > /tmp/beat; mv /tmp/beat /tmp/alive; sleep 0.2; done' \
         </dev/null >/dev/null 2>&1 & echo source > /tmp/who",
    )
    .await;
    background_runs(&source).await;
    source.checkpoint(Some("base")).await.unwrap();
    (source.id().to_owned(), source.token().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_forks_of_one_checkpoint_diverge_on_their_own() {
    let server = Server::start().await;
    let url = format!("http://{}", server.addr);
    let (id, token) = source_with_state(&url).await;

    let started = futures::future::join_all(
        (0..3).map(|_| Sandbox::create(&url, fork_of(&id, &token, Some("base")))),
    )
    .await;
    let forks: Vec<Sandbox> = started.into_iter().map(Result::unwrap).collect();
    let mut ids: Vec<&str> = forks.iter().map(Sandbox::id).chain([id.as_str()]).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 4, "every fork has an id of its own");
    assert!(forks.iter().all(|fork| fork.token() != token));

    for (i, fork) in forks.iter().enumerate() {
        assert_eq!(
            stdout(fork, Language::PythonSession, "print(counter)").await,
            "41\n"
        );
        assert_eq!(
            stdout(fork, Language::Bash, "cat /tmp/who").await,
            "source\n"
        );
        background_runs(fork).await;
        stdout(fork, Language::PythonSession, &format!("counter = {i}")).await;
        stdout(fork, Language::Bash, &format!("echo fork{i} > /tmp/who")).await;
    }
    for (i, fork) in forks.iter().enumerate() {
        assert_eq!(
            stdout(fork, Language::PythonSession, "print(counter)").await,
            format!("{i}\n")
        );
        assert_eq!(
            stdout(fork, Language::Bash, "cat /tmp/who").await,
            format!("fork{i}\n")
        );
    }
    for fork in forks {
        fork.kill().await.unwrap();
    }
    // The source restores as it was checkpointed.
    let source = Sandbox::attach(&url, &id, &token, AttachOptions::default())
        .await
        .unwrap();
    assert_eq!(
        stdout(&source, Language::PythonSession, "print(counter)").await,
        "41\n"
    );
    assert_eq!(
        stdout(&source, Language::Bash, "cat /tmp/who").await,
        "source\n"
    );
    background_runs(&source).await;
    source.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_is_refused_without_the_token_or_a_checkpoint() {
    let server = Server::start().await;
    let url = format!("http://{}", server.addr);
    let (id, token) = source_with_state(&url).await;

    let refusal = |err: ClientError| match err {
        ClientError::Creation(message) => message,
        other => panic!("expected a creation error, got {other:?}"),
    };
    let wrong_token = refusal(
        Sandbox::create(&url, fork_of(&id, "not-the-token", None))
            .await
            .unwrap_err(),
    );
    let unknown = "0123456789abcdef0123456789abcdef";
    let no_such = refusal(
        Sandbox::create(&url, fork_of(unknown, &token, None))
            .await
            .unwrap_err(),
    );
    // Same words whether the sandbox exists or not: nothing is revealed.
    assert!(wrong_token.contains("no sandbox"), "{wrong_token}");
    assert_eq!(
        wrong_token.replace(&id, "ID"),
        no_such.replace(unknown, "ID")
    );
    assert!(!wrong_token.contains("base"), "{wrong_token}");

    let unnamed = refusal(
        Sandbox::create(&url, fork_of(&id, &token, Some("no-such-name")))
            .await
            .unwrap_err(),
    );
    assert!(unnamed.contains("no checkpoint named"), "{unnamed}");

    let fresh = Sandbox::create(&url, checkpointable()).await.unwrap();
    let never = refusal(
        Sandbox::create(&url, fork_of(fresh.id(), fresh.token(), None))
            .await
            .unwrap_err(),
    );
    assert!(never.contains("has no checkpoint yet"), "{never}");
    // The source was never touched by any of it.
    assert_eq!(
        stdout(&fresh, Language::Bash, "echo still here").await,
        "still here\n"
    );
    fresh.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_starts_on_another_instance_over_gcs() {
    let store: std::sync::Arc<dyn controllers::store::Store> = support::gcs_store().await;
    let a = Server::sharing("instance-a", store.clone(), |_| {}).await;
    let b = Server::sharing("instance-b", store, |_| {}).await;
    let (id, token) = source_with_state(&format!("http://{}", a.addr)).await;

    let fork = Sandbox::create(&format!("http://{}", b.addr), fork_of(&id, &token, None))
        .await
        .unwrap();
    assert_eq!(
        stdout(&fork, Language::PythonSession, "print(counter + 1)").await,
        "42\n"
    );
    background_runs(&fork).await;
    // The fork is checkpointable and movable on its own: back to A.
    fork.checkpoint(None).await.unwrap();
    let moved = Sandbox::attach(
        &format!("http://{}", a.addr),
        fork.id(),
        fork.token(),
        AttachOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        stdout(&moved, Language::PythonSession, "print(counter)").await,
        "41\n"
    );
    moved.kill().await.unwrap();
}
