//! The connection driver: one task per sandbox that owns the WebSocket, routes
//! server frames to the current process or to the sandbox, and when the
//! connection drops, reconnects (with the affinity cookie, back-off, and a
//! `reconnect` action for the replay) while buffering outgoing frames.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::error::ClientError;

pub(crate) type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How long reconnecting is tried before giving up.
const RECONNECT_FOR: Duration = Duration::from_secs(120);

/// A server frame, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    Status {
        status: String,
        message: Option<String>,
    },
    Stdout(String),
    Stderr(String),
    ExitCode(i32),
    Error(String),
    SandboxId {
        id: String,
        token: String,
    },
    /// A filesystem API event (`fs_result`, `fs_error`, `fs_download`).
    Fs(Value),
    /// A binary frame: a download's bytes.
    Binary(bytes::Bytes),
    /// The connection ended for good (with why).
    Closed(String),
}

impl Event {
    pub(crate) fn parse(text: &str) -> Result<Self, ClientError> {
        let frame: Value = serde_json::from_str(text)
            .map_err(|err| ClientError::Protocol(format!("a frame is not JSON: {err}")))?;
        let text = |key: &str| frame[key].as_str().unwrap_or_default().to_owned();
        Ok(match frame["event"].as_str() {
            Some("status_update") => Self::Status {
                status: text("status"),
                message: frame["message"].as_str().map(str::to_owned),
            },
            Some("stdout") => Self::Stdout(text("data")),
            Some("stderr") => Self::Stderr(text("data")),
            Some("error") => Self::Error(text("message")),
            Some("exit_code") => Self::ExitCode(
                frame["exit_code"]
                    .as_i64()
                    .and_then(|code| i32::try_from(code).ok())
                    .unwrap_or(-1),
            ),
            Some("sandbox_id") => Self::SandboxId {
                id: text("sandbox_id"),
                token: text("sandbox_token"),
            },
            Some("fs_result" | "fs_error" | "fs_download") => Self::Fs(frame),
            other => {
                return Err(ClientError::Protocol(format!(
                    "unknown event {other:?} in {frame}"
                )));
            }
        })
    }
}

/// The affinity cookie: the `name=value` of the last `Set-Cookie` seen.
#[derive(Debug, Default)]
pub(crate) struct CookieJar(Mutex<Option<String>>);

impl CookieJar {
    fn get(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, header: &str) {
        // Keep the pair, not the attributes (`; path=/`): that is what a
        // browser would send back.
        let pair = header.split(';').next().unwrap_or(header).trim().to_owned();
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(pair);
    }
}

/// Opens a WebSocket to `url`, sending the jar's cookie and keeping the new one.
pub(crate) async fn open(url: &str, jar: &CookieJar) -> Result<Socket, ClientError> {
    let connect_error = |detail: String| ClientError::connect(url, &detail);
    let mut request = url
        .into_client_request()
        .map_err(|err| connect_error(err.to_string()))?;
    if let Some(cookie) = jar.get()
        && let Ok(value) = cookie.parse()
    {
        request.headers_mut().insert("cookie", value);
    }
    // TCP_NODELAY (`true`): small frames must not wait for the server's
    // delayed ACK.
    let (socket, response) = tokio_tungstenite::connect_async_with_config(request, None, true)
        .await
        .map_err(|err| connect_error(err.to_string()))?;
    if let Some(set_cookie) = response
        .headers()
        .get("set-cookie")
        .and_then(|value| value.to_str().ok())
    {
        jar.set(set_cookie);
    }
    Ok(socket)
}

/// Why a socket gave no next frame.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SocketEnd {
    #[error("{0}")]
    Unreadable(ClientError),
    #[error("closed")]
    Closed,
    #[error("closed with {0}")]
    ClosedWith(u16),
    #[error("{0}")]
    Transport(#[from] tokio_tungstenite::tungstenite::Error),
    #[error("connection lost")]
    Lost,
}

/// Reads the next frame; `Err` with the reason when the socket ends.
pub(crate) async fn next_event(socket: &mut Socket) -> Result<Event, SocketEnd> {
    loop {
        match socket.next().await {
            Some(Ok(Message::Text(text))) => {
                return Event::parse(text.as_str()).map_err(SocketEnd::Unreadable);
            }
            Some(Ok(Message::Binary(data))) => return Ok(Event::Binary(data)),
            Some(Ok(Message::Close(frame))) => {
                return Err(frame.map_or(SocketEnd::Closed, |f| {
                    SocketEnd::ClosedWith(u16::from(f.code))
                }));
            }
            Some(Ok(_)) => {}
            Some(Err(err)) => return Err(err.into()),
            None => return Err(SocketEnd::Lost),
        }
    }
}

/// State shared by the driver and the handles.
#[derive(Debug)]
pub(crate) struct Shared {
    pub jar: CookieJar,
    /// `…/attach/<id>?sandbox_token=…`: where to reconnect.
    pub attach_url: String,
    pub reconnect: AtomicBool,
    /// The user asked for a checkpoint: its CHECKPOINTED ends the session.
    pub user_checkpoint: AtomicBool,
    /// The current process's event channel, if an execution is active.
    pub process: Mutex<Option<mpsc::UnboundedSender<Event>>>,
    pub sandbox_events: mpsc::UnboundedSender<Event>,
    /// Filesystem calls waiting for their events, by request id.
    pub files: Mutex<std::collections::HashMap<String, mpsc::UnboundedSender<Event>>>,
    /// The call whose download's binary frames are arriving.
    pub download: Mutex<Option<String>>,
}

impl Shared {
    /// Makes `sender` the current process's channel unless one is active
    /// (one execution at a time, as the server allows).
    pub fn claim_process(&self, sender: mpsc::UnboundedSender<Event>) -> bool {
        let mut process = self.process.lock().unwrap_or_else(PoisonError::into_inner);
        if process.as_ref().is_some_and(|p| !p.is_closed()) {
            return false;
        }
        *process = Some(sender);
        true
    }

    fn clear_process_if(&self, ended: &mpsc::UnboundedSender<Event>) {
        let mut process = self.process.lock().unwrap_or_else(PoisonError::into_inner);
        if process
            .as_ref()
            .is_some_and(|current| current.same_channel(ended))
        {
            *process = None;
        }
    }

    pub fn set_process(&self, sender: Option<mpsc::UnboundedSender<Event>>) {
        *self.process.lock().unwrap_or_else(PoisonError::into_inner) = sender;
    }

    fn process(&self) -> Option<mpsc::UnboundedSender<Event>> {
        self.process
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Which handle the last status went to (the `error` event follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Process,
    Sandbox,
}

fn is_execution_status(status: &str) -> bool {
    (status.starts_with("SANDBOX_EXECUTION_") && status != "SANDBOX_EXECUTION_IN_PROGRESS_ERROR")
        || status == "SANDBOX_STDIN_ERROR"
}

/// Hands a filesystem event (or a download's bytes) to the call waiting.
fn route_file(shared: &Shared, event: Event) {
    let id = match &event {
        Event::Fs(frame) => {
            let id = frame["request_id"].as_str().unwrap_or_default().to_owned();
            let mut download = shared
                .download
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if frame["event"] == "fs_download" {
                *download = Some(id.clone());
            } else if download.as_deref() == Some(id.as_str()) {
                *download = None;
            }
            id
        }
        _ => match shared
            .download
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            Some(id) => id,
            None => return,
        },
    };
    let files = shared.files.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(waiting) = files.get(&id) {
        let _ = waiting.send(event);
    }
}

fn route(shared: &Shared, event: Event, last: &mut Route) {
    if matches!(event, Event::Fs(_) | Event::Binary(_)) {
        return route_file(shared, event);
    }
    let to_process = match &event {
        Event::Status { status, .. } => {
            if ClientError::is_fatal(status) || status == "SANDBOX_KILLED" {
                shared.reconnect.store(false, Ordering::Release);
            }
            // DELETED then CHECKPOINTED without our asking: the sandbox was
            // moved (a handoff, a drained instance), not ended: follow it.
            if status == "SANDBOX_CHECKPOINTED" && !shared.user_checkpoint.load(Ordering::Acquire) {
                shared.reconnect.store(true, Ordering::Release);
            }
            is_execution_status(status)
        }
        Event::Stdout(_) | Event::Stderr(_) | Event::ExitCode(_) => true,
        Event::Error(_) => *last == Route::Process,
        Event::SandboxId { .. } | Event::Closed(_) | Event::Fs(_) | Event::Binary(_) => false,
    };
    let done = matches!(&event, Event::Status { status, .. } if status == "SANDBOX_EXECUTION_DONE");
    if to_process && let Some(process) = shared.process() {
        *last = Route::Process;
        let _ = process.send(event);
        if done {
            // Only this process's channel: the next exec may already have
            // claimed the slot (the caller saw DONE and moved on).
            shared.clear_process_if(&process);
        }
        return;
    }
    *last = Route::Sandbox;
    let _ = shared.sandbox_events.send(event);
}

/// How long a close waits for the server's half of the close handshake.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Runs the connection until the handle goes away or reconnecting is over.
/// `close` fires when the handle asks for the close handshake
/// ([`super::Sandbox::close`]); a handle dropped without asking closes when
/// its last sender of frames goes.
pub(crate) async fn drive(
    mut socket: Socket,
    shared: Arc<Shared>,
    mut outgoing: mpsc::UnboundedReceiver<String>,
    mut binary: mpsc::Receiver<Message>,
    close: tokio::sync::oneshot::Receiver<()>,
) {
    let mut pending: VecDeque<String> = VecDeque::new();
    let mut last = Route::Sandbox;
    let mut close = std::pin::pin!(close);
    let mut close_asked_for = true;
    loop {
        while let Some(frame) = pending.pop_front() {
            if socket.send(Message::text(frame.clone())).await.is_err() {
                pending.push_front(frame);
                break;
            }
        }
        let why = loop {
            tokio::select! {
                event = next_event(&mut socket) => match event {
                    Ok(event) => route(&shared, event, &mut last),
                    Err(why) => break why,
                },
                // An upload (its frame, then its bytes, in order): not kept
                // across a reconnect (the upload fails and is retried whole).
                Some(message) = binary.recv() => {
                    let _ = socket.send(message).await;
                }
                frame = outgoing.recv() => match frame {
                    Some(frame) => {
                        if socket.send(Message::text(frame.clone())).await.is_err() {
                            pending.push_back(frame);
                        }
                    }
                    None => {
                        // The handle is gone: close politely.
                        let _ = socket.close(None).await;
                        return;
                    }
                },
                asked = &mut close, if close_asked_for => match asked {
                    Ok(()) => {
                        // What the handle queued before asking goes first
                        // (a kill, stdin, an upload's bytes).
                        while let Ok(frame) = outgoing.try_recv() {
                            let _ = socket.send(Message::text(frame)).await;
                        }
                        while let Ok(message) = binary.try_recv() {
                            let _ = socket.send(message).await;
                        }
                        close_handshake(&mut socket).await;
                        finish(&shared, "closed by the client".to_owned());
                        return;
                    }
                    // The handle went without asking: `outgoing` says when.
                    Err(_) => close_asked_for = false,
                },
            }
        };
        if !shared.reconnect.load(Ordering::Acquire) {
            finish(&shared, why.to_string());
            return;
        }
        tracing::debug!(%why, "connection lost; reconnecting");
        // A close asked for meanwhile, or every handle dropped, ends the
        // driver at once: there is no socket to hand-shake on, and frames
        // queued while disconnected go unsent. An attempt under way is
        // dropped with its socket, as a failed attempt's is: it is not
        // attached yet (the server may be restoring and answer nothing until
        // it is done), and the old connection went without a handshake
        // anyway, so waiting would free no slot sooner.
        let reconnected = {
            let mut attempt = std::pin::pin!(reconnect(&shared));
            loop {
                tokio::select! {
                    reconnected = &mut attempt => break reconnected,
                    // Frames written meanwhile (stdin) wait for the new
                    // connection; with every handle gone there is nobody to
                    // reconnect for.
                    frame = outgoing.recv() => match frame {
                        Some(frame) => pending.push_back(frame),
                        None => {
                            finish(&shared, "every handle was dropped".to_owned());
                            return;
                        }
                    },
                    asked = &mut close, if close_asked_for => match asked {
                        Ok(()) => {
                            finish(&shared, "closed by the client".to_owned());
                            return;
                        }
                        Err(_) => close_asked_for = false,
                    },
                }
            }
        };
        match reconnected {
            Ok(new_socket) => socket = new_socket,
            Err(err) => {
                finish(&shared, err.to_string());
                return;
            }
        }
    }
}

/// Sends a close frame and reads until the server's close frame or the end
/// of the stream. The server lets go of the sandbox's one attach slot when
/// it reads the client's close, before it answers it: once this returns, an
/// attach from anywhere finds the slot free.
async fn close_handshake(socket: &mut Socket) {
    let _ = tokio::time::timeout(CLOSE_WAIT, async {
        let _ = socket.close(None).await;
        while let Some(Ok(_)) = socket.next().await {}
    })
    .await;
}

fn finish(shared: &Shared, why: String) {
    if let Some(process) = shared.process() {
        let _ = process.send(Event::Closed(why.clone()));
    }
    for (_, waiting) in shared
        .files
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .drain()
    {
        let _ = waiting.send(Event::Closed(why.clone()));
    }
    shared.set_process(None);
    let _ = shared.sandbox_events.send(Event::Closed(why));
}

/// Re-attaches with back-off until `SANDBOX_RUNNING`, then asks for the replay.
#[allow(
    clippy::disallowed_methods,
    reason = "the client library runs in the client's process, outside any instance: its reconnect window is the host's time"
)]
async fn reconnect(shared: &Shared) -> Result<Socket, ClientError> {
    let started = tokio::time::Instant::now();
    let mut delay = Duration::from_millis(100);
    loop {
        if started.elapsed() > RECONNECT_FOR {
            return Err(ClientError::Closed(format!(
                "could not reconnect within {} s",
                RECONNECT_FOR.as_secs()
            )));
        }
        // One attempt, bounded by what is left of the window: a server that
        // accepts and then says nothing must not stall the reconnect.
        // `None`: try again after the back-off.
        let attempt = async {
            let mut socket = match open(&shared.attach_url, &shared.jar).await {
                Ok(socket) => socket,
                Err(err) => {
                    tracing::debug!(%err, "reconnect attempt failed");
                    return None;
                }
            };
            loop {
                match next_event(&mut socket).await {
                    Ok(Event::Status { status, .. }) if status == "SANDBOX_RUNNING" => {
                        let replay = Message::text(r#"{"action":"reconnect"}"#);
                        return Some(match socket.send(replay).await {
                            Ok(()) => Ok(socket),
                            Err(err) => Err(ClientError::Closed(err.to_string())),
                        });
                    }
                    Ok(Event::Status { status, message }) if ClientError::is_fatal(&status) => {
                        return Some(Err(ClientError::from_status(&status, message.as_deref())));
                    }
                    // RESTORING, lock progress, IN_USE (the old connection is
                    // not noticed yet: try again): keep reading or retry.
                    Ok(_) => {}
                    Err(_) => return None,
                }
            }
        };
        let left = RECONNECT_FOR.saturating_sub(started.elapsed());
        if let Ok(Some(reconnected)) = tokio::time::timeout(left, attempt).await {
            return reconnected;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_jar_keeps_the_pair_not_the_attributes() {
        let jar = CookieJar::default();
        jar.set("GAESA=abc123; expires=Tue, 01 Dec 2026 00:00:00 GMT; path=/");
        assert_eq!(jar.get().as_deref(), Some("GAESA=abc123"));
    }

    #[test]
    fn frames_decode_into_events() {
        assert_eq!(
            Event::parse(r#"{"event":"status_update","status":"SANDBOX_RUNNING"}"#).unwrap(),
            Event::Status {
                status: "SANDBOX_RUNNING".into(),
                message: None
            }
        );
        assert_eq!(
            Event::parse(r#"{"event":"exit_code","exit_code":3}"#).unwrap(),
            Event::ExitCode(3)
        );
        assert!(Event::parse("[1]").is_err());
    }
}
