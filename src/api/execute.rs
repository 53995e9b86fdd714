//! `POST /execute?language=python|bash`: run one script in a fresh sandbox and
//! stream its output, as the earlier server did (stdout and stderr merged, in
//! arrival order, `text/plain`). The sandbox is destroyed afterwards, also when
//! the client goes away: a guard destroys it when the handler (JSON mode) or
//! the streaming task is dropped, and the streaming task stops as soon as the
//! response body is gone, even for a script that prints nothing.
//!
//! Extension: `&format=json` waits for the end and answers
//! `{"stdout": …, "stderr": …, "exit_code": N}`.
//!
//! Limits (docs/security.md; upstream had none, and one script printing 400 MB in
//! JSON mode took the server from 170 MB to 1.26 GB): a response carries at
//! most [`ExecuteLimits::max_output_bytes`] of output, then a marker line
//! (and, in JSON, `"truncated": true`); the rest is read and discarded as it
//! comes, so the server's memory stays flat whatever the script prints. A
//! script still running after [`ExecuteLimits::timeout`] is killed, with a
//! marker (and `"timed_out": true`).

use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use controllers::api::SandboxId;
use controllers::runtime::{Command, CreateOptions, ExecEvent, ExecRequest, SandboxRuntime};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::limits::ExecuteLimits;
use super::state::AppState;

impl ExecuteLimits {
    fn truncated_marker(&self) -> String {
        format!(
            "\n[sandboxd] output truncated: the response keeps the first {} bytes \
             (--execute-max-output-bytes); the rest was discarded\n",
            self.max_output_bytes
        )
    }

    fn timed_out_marker(&self) -> String {
        format!(
            "\n[sandboxd] the script was killed: it ran longer than the {}-second limit \
             (--execute-timeout-s)\n",
            self.timeout.as_secs()
        )
    }
}

#[derive(Debug, Deserialize)]
pub struct ExecuteParams {
    language: Option<String>,
    format: Option<String>,
}

fn detail(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"detail": message.into()}))).into_response()
}

/// The handler.
pub async fn execute(
    State(state): State<AppState>,
    Query(params): Query<ExecuteParams>,
    // One buffer (not `Bytes`, which keeps every piece of a chunked body
    // apart until the end: 2 MB sent a byte a chunk held 75 MB of the
    // server, before any check below).
    body: BytesMut,
) -> Response {
    let Some(runtime) = state.runtime.clone() else {
        return detail(
            StatusCode::SERVICE_UNAVAILABLE,
            "the sandbox runtime is not available on this server",
        );
    };
    let language = params.language.as_deref().unwrap_or("python");
    let json_format = match params.format.as_deref() {
        None | Some("text") => false,
        Some("json") => true,
        Some(other) => {
            return detail(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("unknown format {other:?}; use text or json"),
            );
        }
    };
    if body.is_empty() {
        return detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the request body (the script) is empty",
        );
    }
    let Ok(script) = String::from_utf8(Vec::from(body)) else {
        return detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the script is not valid UTF-8",
        );
    };
    let command = match language {
        "python" => Command::Python(script),
        "bash" => Command::Bash(script),
        other => {
            return detail(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("Unsupported language: '{other}'. Supported languages are: python, bash"),
            );
        }
    };
    let slot = match state.limits.execute_slot() {
        Ok(slot) => slot,
        Err(busy) => {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [(header::RETRY_AFTER, "1")],
                Json(json!({"detail": busy.to_string()})),
            )
                .into_response();
        }
    };
    let id = SandboxId::from_u128(uuid::Uuid::new_v4().as_u128());
    // The one-shot sandbox claims its memory until it is destroyed.
    let claim = match super::connect::admit(&state, &id).await {
        Ok(claim) => claim,
        Err(refusal) => {
            return detail(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("Failed to create a sandbox: {refusal}"),
            );
        }
    };
    if let Err(err) = runtime.create(&id, &CreateOptions::default()).await {
        tracing::error!(sandbox = %id, %err, "execute: cannot create a sandbox");
        return detail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Failed to create a sandbox: {err}"),
        );
    }
    let sandbox = Disposable {
        runtime: Arc::clone(&runtime),
        id: Some(id.clone()),
        claim,
        slot: Some(slot),
    };
    let execution = match runtime.exec(&id, ExecRequest::new(command)).await {
        Ok(execution) => execution,
        Err(err) => {
            drop(sandbox);
            return detail(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Failed to start the script: {err}"),
            );
        }
    };
    let limits = state.execute;
    let deadline = deadline(state.clock.instant(), limits);
    if json_format {
        collect(sandbox, execution, limits, deadline).await
    } else {
        stream(sandbox, execution, limits, deadline)
    }
}

/// The one-shot sandbox: destroyed when this is dropped, whether the script
/// ended or the client left and its handler was dropped mid-wait.
struct Disposable {
    runtime: Arc<dyn SandboxRuntime>,
    id: Option<SandboxId>,
    /// Its memory in the admission ledger, released once it is destroyed.
    claim: Option<super::admission::Claim>,
    /// Its `--max-concurrent-executes` slot, released with the claim.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Disposable {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let runtime = Arc::clone(&self.runtime);
        let claim = (self.claim.take(), self.slot.take());
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(sandbox = %id, "execute: no runtime left to destroy the sandbox");
            return;
        };
        handle.spawn(async move {
            if let Err(err) = runtime.destroy(&id).await {
                tracing::warn!(sandbox = %id, %err, "execute: destroying the sandbox failed");
            }
            drop(claim);
        });
    }
}

/// The next event of the execution, or `None` once the time limit is
/// reached (the script is then killed).
async fn next_event(
    execution: &mut controllers::runtime::Execution,
    deadline: tokio::time::Instant,
) -> Option<Option<ExecEvent>> {
    tokio::select! {
        event = execution.events.recv() => Some(event),
        () = tokio::time::sleep_until(deadline) => {
            if let Err(err) = execution.control.kill().await {
                tracing::warn!(%err, "execute: killing a script past its time limit failed");
            }
            None
        }
    }
}

/// The time limit's end, from `now`.
fn deadline(now: tokio::time::Instant, limits: ExecuteLimits) -> tokio::time::Instant {
    now.checked_add(limits.timeout).unwrap_or(now)
}

/// Output kept up to a budget shared by stdout and stderr.
#[derive(Debug)]
struct Budget {
    left: usize,
    truncated: bool,
}

impl Budget {
    /// The part of `data` that still fits; marks the budget truncated when
    /// some of it does not.
    fn take<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        let kept = data.len().min(self.left);
        self.left = self.left.saturating_sub(kept);
        if kept < data.len() {
            self.truncated = true;
        }
        &data[..kept]
    }
}

async fn collect(
    sandbox: Disposable,
    mut execution: controllers::runtime::Execution,
    limits: ExecuteLimits,
    deadline: tokio::time::Instant,
) -> Response {
    let (mut stdout, mut stderr, mut exit_code) = (Vec::new(), Vec::new(), None);
    let mut budget = Budget {
        left: limits.max_output_bytes,
        truncated: false,
    };
    let mut timed_out = false;
    loop {
        let event = match next_event(&mut execution, deadline).await {
            Some(Some(event)) => event,
            Some(None) => break,
            None => {
                timed_out = true;
                break;
            }
        };
        match event {
            ExecEvent::Stdout(data) => stdout.extend_from_slice(budget.take(&data)),
            ExecEvent::Stderr(data) => stderr.extend_from_slice(budget.take(&data)),
            // `/execute` never asks for rich results.
            ExecEvent::Result(_) => {}
            ExecEvent::Exited(code) => {
                exit_code = Some(code);
                break;
            }
            // Disposable sandboxes have no after-exec hooks, nor checkpoints.
            ExecEvent::AfterExecFailed(_) | ExecEvent::ForceKilled => {}
            // Nor leases: never sent for them; the end, if it were.
            ExecEvent::HoldLost => break,
        }
    }
    drop(sandbox);
    if budget.truncated {
        stderr.extend_from_slice(limits.truncated_marker().as_bytes());
    }
    if timed_out {
        stderr.extend_from_slice(limits.timed_out_marker().as_bytes());
    }
    let mut body = json!({
        "stdout": String::from_utf8_lossy(&stdout),
        "stderr": String::from_utf8_lossy(&stderr),
        "exit_code": exit_code,
    });
    if budget.truncated {
        body["truncated"] = json!(true);
    }
    if timed_out {
        body["timed_out"] = json!(true);
    }
    Json(body).into_response()
}

fn stream(
    sandbox: Disposable,
    mut execution: controllers::runtime::Execution,
    limits: ExecuteLimits,
    deadline: tokio::time::Instant,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut budget = Budget {
            left: limits.max_output_bytes,
            truncated: false,
        };
        let mut timed_out = false;
        loop {
            let event = tokio::select! {
                event = next_event(&mut execution, deadline) => event,
                // The client went away (its body was dropped): stop at once,
                // also for a script that prints nothing.
                () = tx.closed() => break,
            };
            let chunk = match event {
                Some(Some(ExecEvent::Stdout(data) | ExecEvent::Stderr(data))) => data,
                Some(Some(
                    ExecEvent::AfterExecFailed(_) | ExecEvent::Result(_) | ExecEvent::ForceKilled,
                )) => continue,
                Some(Some(ExecEvent::Exited(_) | ExecEvent::HoldLost) | None) => break,
                None => {
                    timed_out = true;
                    break;
                }
            };
            let was_truncated = budget.truncated;
            let kept = budget.take(&chunk);
            let mut out = Vec::new();
            if !kept.is_empty() {
                out.extend_from_slice(kept);
            }
            if budget.truncated && !was_truncated {
                out.extend_from_slice(limits.truncated_marker().as_bytes());
            }
            // Past the budget the rest is read and discarded, never queued.
            // A client that stops reading is held to the time limit too: a
            // send still waiting at the deadline ends the script.
            if !out.is_empty() {
                match tokio::time::timeout_at(deadline, tx.send(Ok(Bytes::from(out)))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => break,
                    Err(_) => {
                        timed_out = true;
                        break;
                    }
                }
            }
        }
        // The sandbox, its slot and its memory claim go first; the marker
        // then waits for a slow reader (a client that reads nothing is
        // closed by its connection's write deadline).
        drop(sandbox);
        if timed_out {
            let _ = tx.send(Ok(Bytes::from(limits.timed_out_marker()))).await;
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use controllers::runtime::{ExecControl, Execution, RuntimeError};
    use controllers::testing::FakeRuntime;

    use super::*;

    #[derive(Debug)]
    struct NoControl;

    #[async_trait::async_trait]
    impl ExecControl for NoControl {
        async fn write_stdin(&self, _data: Bytes) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn close_stdin(&self) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn kill(&self) -> Result<(), RuntimeError> {
            Ok(())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_reads_nothing_loses_the_sandbox_at_the_time_limit() {
        let runtime = FakeRuntime::new(Arc::new(controllers::testing::MemoryStore::new()));
        let id = SandboxId::random();
        runtime
            .create(&id, &CreateOptions::default())
            .await
            .unwrap();
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        let sandbox = Disposable {
            runtime: Arc::new(runtime.clone()),
            id: Some(id.clone()),
            claim: None,
            slot: Some(Arc::clone(&slots).try_acquire_owned().unwrap()),
        };
        // More output than the response's queue holds, and no exit: the
        // script prints, then sleeps.
        let (events_tx, events) = mpsc::channel(256);
        for _ in 0..200 {
            events_tx
                .try_send(ExecEvent::Stdout(Bytes::from_static(b"0123456789")))
                .unwrap();
        }
        let execution = Execution {
            events,
            control: Box::new(NoControl),
        };
        let limits = ExecuteLimits {
            max_output_bytes: 1 << 20,
            timeout: Duration::from_secs(1),
        };
        let deadline = deadline(tokio::time::Instant::now(), limits);
        // The response is held and its body never read.
        let _response = stream(sandbox, execution, limits, deadline);
        let released = tokio::time::timeout(Duration::from_secs(5), async {
            while slots.available_permits() == 0 || runtime.is_running(&id) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            released.is_ok(),
            "the sandbox and its slot outlived the time limit"
        );
        drop(events_tx);
    }
}
