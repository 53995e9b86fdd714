//! `sandboxctl mcp` driven as an agent drives it: the official Python MCP
//! SDK's stdio client (`pip install mcp`) spawns the binary against a real
//! server on runsc, lists the eight tools and their schemas, creates a
//! sandbox, writes a file, runs code that reads it (and code whose output
//! streams as progress, code beside which a file is read, code that floods
//! and code that times out), meets the errors (ENOENT, an
//! unknown id, a bad argument) and forks; the script is
//! `tests/it/support/mcp_agent.py`. When the client goes away the server kills
//! the sandboxes it made: checked here in the bucket's metadata.
//!
//! Needs `python3` with the `mcp` package: the test FAILS, never skips,
//! without them (`.ci/run` and `scripts/test.sh` install it).

use crate::support;

use std::process::Stdio;
use std::time::Duration;

use controllers::api::SandboxId;
use controllers::store::StoreError;
use support::ws::Server;

/// The whole agent session (a create, a fork, a restore, a timeout) on a
/// busy 2-core machine.
const SESSION: Duration = Duration::from_secs(300);

fn require_python_mcp() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import mcp.client.stdio, mcp"])
        .output()
        .unwrap_or_else(|err| panic!("python3 is needed for this test and cannot run: {err}"));
    assert!(
        probe.status.success(),
        "the Python `mcp` package is needed for this test (pip install mcp): {}",
        String::from_utf8_lossy(&probe.stderr)
    );
}

/// The sandbox's desired state in the bucket (`None`: no metadata left).
async fn desired_state(server: &Server, id: &str) -> Option<String> {
    let id = SandboxId::parse(id).unwrap();
    match sandboxd::ctl::describe_json(server.store.as_ref(), &id).await {
        Ok(value) => Some(
            value["metadata"]["spec"]["desired_state"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        ),
        Err(StoreError::NotFound { .. }) => None,
        Err(err) => panic!("reading {id}'s metadata: {err}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_uses_every_tool_through_the_python_sdk() {
    require_python_mcp();
    let server = Server::start().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/support/mcp_agent.py");
    let child = tokio::process::Command::new("python3")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_sandboxctl"))
        .arg(server.url(""))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 starts");
    let output = tokio::time::timeout(SESSION, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("the agent session took over {} s", SESSION.as_secs()))
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the agent script failed ({}):\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        output.status
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|err| panic!("no summary ({err}):\n{stdout}\n{stderr}"));
    eprintln!("{summary}\n{stderr}");
    assert!(summary["progress_notifications"].as_u64().unwrap() >= 2);

    // The server killed the sandbox it still had when stdin closed; the
    // forks were killed by the tool.
    for key in ["sandbox", "fork", "named_fork"] {
        let id = summary[key].as_str().unwrap();
        let state = desired_state(&server, id).await;
        assert!(
            state.is_none() || state.as_deref() == Some("deleted"),
            "{key} {id} is still {state:?} after the MCP server ended"
        );
    }
    assert!(
        stderr.contains(&format!(
            "created sandbox {}",
            summary["sandbox"].as_str().unwrap()
        )),
        "the server logs what it creates: {stderr}"
    );
}
