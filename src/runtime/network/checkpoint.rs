//! Making an `egress` sandbox safe to checkpoint on this runsc.
//!
//! runsc 20221219 refuses to save a TCP endpoint in a connected state (any
//! state but LISTEN and CLOSE towards a non-loopback peer), and the refusal
//! stops the container: the sandbox would be lost. So before `runsc
//! checkpoint`:
//! 0. before the agent prepares anything, [`refuse_if_hopeless`] refuses a
//!    checkpoint that cannot succeed (nothing killed yet, even when forced);
//! 1. the firewall quiesces the sandbox ([`firewall::quiesce`]): its TCP
//!    segments are answered with resets, so a connection closed now ends at
//!    once instead of lingering, and no new one can open;
//! 2. the agent kills the processes that hold connections (their sockets
//!    close, the resets finish them);
//! 3. conntrack shows what the sandbox can no longer: TIME_WAIT and FIN_WAIT
//!    endpoints left by earlier closes, which gVisor keeps for 60 s and which
//!    ignore resets. If they do not clear within the configured wait, the
//!    checkpoint is refused and the sandbox goes on, its network restored.
//!    An unreadable table is a refusal too: the guard fails closed.
//!
//! Current runsc has `--net-disconnect-ok` (open connections are reset at
//! save instead of failing it) and `--allow-connected-on-save`; with it none
//! of this is needed, but it is harmless.

use std::time::{Duration, Instant};

use super::conntrack::{self, Lingering};
use super::{HostNetwork, NetworkError, SandboxNetwork, firewall};
use crate::runtime::agent::AgentConnection;
use crate::runtime::agent::protocol::{ConnectionsClosed, Request};

/// How often the quiet check runs while waiting.
const POLL: Duration = Duration::from_millis(200);

/// Refuses at once, before anything in the sandbox is killed, a checkpoint
/// that cannot succeed: the host cannot read its connection table, or a
/// closed connection lingers longer than the configured wait. Call it before
/// the agent prepares the checkpoint.
#[tracing::instrument(skip_all, fields(slot = sandbox.slot.index))]
pub async fn refuse_if_hopeless(
    network: &HostNetwork,
    sandbox: &SandboxNetwork,
) -> Result<(), NetworkError> {
    let wait = network.config().checkpoint_wait;
    let early = lingering_now(sandbox).await?;
    if early.iter().any(|l| l.clears_in > wait) {
        return Err(not_quiet(0, &early));
    }
    Ok(())
}

/// Quiesces the sandbox and waits until no TCP endpoint is left in it. On
/// error the sandbox's network is back to normal.
#[tracing::instrument(skip_all, fields(slot = sandbox.slot.index))]
pub async fn quiesce(
    network: &HostNetwork,
    sandbox: &SandboxNetwork,
    agent: &AgentConnection,
) -> Result<(), NetworkError> {
    // Checked again: the agent's preparation took time.
    refuse_if_hopeless(network, sandbox).await?;
    let result = match firewall::quiesce(sandbox.slot.index).await {
        Ok(()) => wait_until_quiet(network, sandbox, agent).await,
        Err(err) => Err(err.into()),
    };
    if result.is_err() {
        // Also after a failed quiesce: whatever part of it took effect goes.
        resume(sandbox).await;
    }
    result
}

/// What conntrack shows lingering in the sandbox; an unreadable table is a
/// refusal (the sandbox goes on), never "quiet".
async fn lingering_now(sandbox: &SandboxNetwork) -> Result<Vec<Lingering>, NetworkError> {
    conntrack::snapshot(sandbox.slot.sandbox)
        .await
        .map_err(|err| {
            NetworkError::NotQuiet(format!("cannot check the sandbox's connections: {err}"))
        })
}

/// Undoes [`quiesce`] (the checkpoint did not happen; the sandbox goes on).
pub async fn resume(sandbox: &SandboxNetwork) {
    if let Err(err) = firewall::unquiesce(sandbox.slot.index).await {
        tracing::warn!(%err, "could not lift the checkpoint quiesce rules");
    }
}

async fn wait_until_quiet(
    network: &HostNetwork,
    sandbox: &SandboxNetwork,
    agent: &AgentConnection,
) -> Result<(), NetworkError> {
    #[allow(
        clippy::disallowed_methods,
        reason = "waits on the host's network stack (connections closing) for a bounded time; no simulation runs runsc"
    )]
    let started = Instant::now();
    let deadline = started + network.config().checkpoint_wait;
    loop {
        let reply: ConnectionsClosed = agent
            .ask(Request::CloseConnections, Duration::from_secs(10))
            .await
            .map_err(|err| NetworkError::NotQuiet(format!("closing connections: {err}")))?;
        if !reply.killed.is_empty() {
            tracing::info!(
                killed = ?reply.killed,
                "killed processes holding connections for the checkpoint"
            );
        }
        let open = reply.remaining.len();
        let lingering = lingering_now(sandbox).await?;
        if open == 0 && lingering.is_empty() {
            tracing::debug!(
                waited_ms = started.elapsed().as_millis() as u64,
                "sandbox network quiet"
            );
            return Ok(());
        }
        #[allow(
            clippy::disallowed_methods,
            reason = "waits on the host's network stack (connections closing) for a bounded time; no simulation runs runsc"
        )]
        let now = Instant::now();
        let longest = lingering
            .iter()
            .map(|l| l.clears_in)
            .max()
            .unwrap_or_default();
        if now >= deadline || now + longest > deadline {
            return Err(not_quiet(open, &lingering));
        }
        tokio::time::sleep(POLL).await;
    }
}

fn not_quiet(open: usize, lingering: &[Lingering]) -> NetworkError {
    let longest = lingering
        .iter()
        .map(|l| l.clears_in)
        .max()
        .unwrap_or_default();
    let detail: Vec<String> = lingering
        .iter()
        .map(|l| format!("{} to {}", l.state, l.remote))
        .collect();
    NetworkError::NotQuiet(format!(
        "the sandbox still has {open} open and {} closing TCP connections ({}); this runsc \
         cannot checkpoint them, retry in {} s",
        lingering.len(),
        detail.join(", "),
        longest.as_secs().max(1)
    ))
}
