//! `sandboxctl mcp`: sandboxes as Model Context Protocol tools, served over
//! stdio with the official SDK (`rmcp`), so an agent (Claude Desktop, Claude
//! Code, any MCP client) can create sandboxes, run code and move files in
//! them. Everything goes through [`crate::client`]; the sandbox tokens stay
//! in this process ([`sandboxes`]), and every failure is a tool error whose
//! text says what went wrong: the process serves on whatever a call did.
//! See docs/mcp.md.

mod output;
mod params;
mod sandboxes;
mod tools;

use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt as _;

use sandboxes::{Sandboxes, ToolError};

/// How `sandboxctl mcp` runs.
#[derive(Debug, Clone)]
pub struct McpOptions {
    /// The sandbox server (`ws://`, `wss://`, `http://` or `https://`).
    pub url: String,
    /// The sandboxes' idle timeout: after it they are checkpointed (and
    /// restored by the next call), not lost.
    pub idle_timeout_s: u64,
    /// Leave the sandboxes running when the client goes away (their ids and
    /// tokens are printed on stderr) instead of killing them.
    pub keep_sandboxes: bool,
}

/// A connection unused this long is closed, so the idle timeout can
/// checkpoint its sandbox.
const LINGER: Duration = Duration::from_secs(60);
/// The longest the end of the server waits for its sandboxes' kills.
const KILL_AT_EXIT: Duration = Duration::from_secs(20);

/// Serves the tools on stdin/stdout until the client closes them (or sends
/// SIGTERM); then kills the sandboxes made here (unless told to keep them).
/// The caller should exit the process then: a read of stdin may still be
/// pending, and the runtime would wait for it.
pub async fn serve_stdio(options: McpOptions) -> Result<(), String> {
    let sandboxes = Arc::new(Sandboxes::new(&options.url));
    let sweeper = tokio::spawn({
        let sandboxes = Arc::clone(&sandboxes);
        async move {
            let mut tick = tokio::time::interval(LINGER / 4);
            loop {
                tick.tick().await;
                sandboxes.sweep(LINGER);
            }
        }
    });
    // A client ends its server by closing stdin, then (2 s later, as the
    // Python SDK and others do) SIGTERM: either one starts the cleanup.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|err| format!("cannot handle SIGTERM: {err}"))?;
    let server = tools::SandboxTools::new(Arc::clone(&sandboxes), options.idle_timeout_s);
    let outcome = match server.serve(rmcp::transport::stdio()).await {
        Ok(running) => tokio::select! {
            ended = running.waiting() => ended
                .map(drop)
                .map_err(|err| format!("the MCP session failed: {err}")),
            _ = terminate.recv() => Ok(()),
            _ = tokio::signal::ctrl_c() => Ok(()),
        },
        Err(err) => Err(format!("the MCP session did not start: {err}")),
    };
    sweeper.abort();
    end_sandboxes(&sandboxes, &options).await;
    outcome
}

/// Kills (or lists, with `keep_sandboxes`) what this process made: nobody
/// else holds their tokens.
async fn end_sandboxes(sandboxes: &Sandboxes, options: &McpOptions) {
    let owned = sandboxes.owned();
    if options.keep_sandboxes {
        for (id, token) in &owned {
            eprintln!("sandboxctl mcp: kept sandbox {id} (token {token})");
        }
        return;
    }
    let kills = owned.iter().map(|(id, _)| async move {
        let killed = async {
            let mut lease = sandboxes.lease(id)?;
            let sandbox = lease.sandbox().await?;
            let outcome = sandbox.kill().await;
            lease.check(outcome).await
        }
        .await;
        match killed {
            Ok(()) | Err(ToolError::Gone(_)) => sandboxes.remove(id),
            Err(err) => eprintln!("sandboxctl mcp: could not kill sandbox {id}: {err}"),
        }
    });
    if tokio::time::timeout(KILL_AT_EXIT, futures::future::join_all(kills))
        .await
        .is_err()
    {
        eprintln!(
            "sandboxctl mcp: gave up killing the sandboxes after {} s",
            KILL_AT_EXIT.as_secs()
        );
    }
}
