//! A real WebSocket client (tokio-tungstenite) speaking the upstream wire
//! protocol, and servers on real runsc to point it at.
//!
//! Frames are read back as short strings so tests can compare whole
//! sequences: a status is its string (`SANDBOX_RUNNING`), other events are
//! `stdout:<data>`, `stderr:<data>`, `error:<message>`, `exit_code:<n>`,
//! `sandbox_id`, and the end of the socket is `close:<code>`.

use std::sync::Arc;
use std::time::Duration;

use controllers::store::Store;
use futures::{SinkExt, StreamExt};
use sandboxd::server::{AppState, Parts};
use sandboxd::store::LocalStore;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long a test waits for one frame (runsc on a busy 2-core machine).
const FRAME_TIMEOUT: Duration = Duration::from_secs(60);

/// Sandbox `id`'s `metadata.json` as `server`'s store holds it now.
pub async fn metadata(server: &Server, id: &str) -> controllers::api::SandboxMetadata {
    let id = controllers::api::SandboxId::parse(id).expect("a sandbox id");
    let object = server
        .store
        .get(&controllers::layout::metadata_key(&id))
        .await
        .expect("the sandbox's metadata.json");
    controllers::api::decode(&object.data).expect("a metadata.json the server wrote")
}

/// One server instance on real runsc, with everything it needs kept alive.
pub struct Server {
    pub addr: String,
    pub state: AppState,
    pub store: Arc<dyn Store>,
    _cleanup: super::RunscCleanup,
    _dir: tempfile::TempDir,
}

impl Server {
    /// A server with its own directory store.
    pub async fn start() -> Self {
        let store_dir = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn Store> =
            Arc::new(LocalStore::open(store_dir.path().join("store")).expect("local store"));
        let mut server = Self::sharing("instance-a", store, |_| {}).await;
        server._dir = store_dir;
        server
    }

    /// A server named `instance` on `store` (which other servers may share),
    /// with `adjust` applied to its parts before it is built.
    pub async fn sharing(
        instance: &str,
        store: Arc<dyn Store>,
        adjust: impl FnOnce(&mut Parts),
    ) -> Self {
        Self::sharing_on(instance, store, super::images(), adjust).await
    }

    /// Like [`Self::sharing`], its sandboxes on the images of `images`.
    pub async fn sharing_on(
        instance: &str,
        store: Arc<dyn Store>,
        images: sandboxd::runtime::ImageCatalog,
        adjust: impl FnOnce(&mut Parts),
    ) -> Self {
        let counts = Arc::new(controllers::store::OperationCounts::default());
        let on = images.clone();
        Self::on_runtime(
            Arc::clone(&store),
            Arc::clone(&counts),
            images,
            |runtime, _| {
                super::server_counted(
                    instance,
                    Arc::clone(&store),
                    Some(runtime),
                    counts,
                    |parts| {
                        parts.images = Some(on);
                        adjust(parts);
                    },
                )
            },
        )
        .await
    }

    /// A server on `store` that syncs workspaces into `workspaces`, counting
    /// every storage operation into `counts`.
    pub async fn with_workspaces(
        instance: &str,
        store: Arc<dyn Store>,
        workspaces: Arc<dyn Store>,
        counts: Arc<controllers::store::OperationCounts>,
        limits: sandboxd::workspace::SyncLimits,
    ) -> Self {
        Self::on_runtime(
            Arc::clone(&store),
            Arc::clone(&counts),
            super::images(),
            |runtime, dir| {
                super::server_with_workspaces(
                    instance,
                    Arc::clone(&store),
                    runtime,
                    workspaces,
                    counts,
                    dir.to_path_buf(),
                    limits,
                )
            },
        )
        .await
    }

    /// Starts a gVisor runtime of its own (checkpoints in `store`, counted into
    /// `counts`) and serves the server `build` makes around it.
    async fn on_runtime(
        store: Arc<dyn Store>,
        counts: Arc<controllers::store::OperationCounts>,
        images: sandboxd::runtime::ImageCatalog,
        build: impl FnOnce(
            Arc<sandboxd::runtime::GvisorRuntime>,
            &std::path::Path,
        ) -> sandboxd::server::Server,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let cleanup = super::RunscCleanup(dir.path().join("runsc"));
        let runtime = super::runtime_with_images(
            dir.path(),
            sandboxd::server::counted(Arc::clone(&store), &counts),
            images,
        )
        .await;
        let server = build(Arc::new(runtime), dir.path());
        let state = server.state().clone();
        let addr = super::serve(server).await;
        Self {
            addr,
            state,
            store,
            _cleanup: cleanup,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("ws://{}{path}", self.addr)
    }

    pub async fn connect(&self, path: &str) -> Ws {
        Ws::connect(&self.url(path)).await
    }

    /// `/create` with `init`; returns the client after `SANDBOX_RUNNING` and
    /// the sandbox's id and token.
    pub async fn create(&self, init: Value) -> (Ws, String, String) {
        let mut ws = self.connect("/create").await;
        ws.send(init).await;
        let mut id = None;
        let mut token = None;
        loop {
            let frame = ws.next_value().await;
            if frame["event"] == "sandbox_id" {
                id = frame["sandbox_id"].as_str().map(str::to_owned);
                token = frame["sandbox_token"].as_str().map(str::to_owned);
            }
            if frame["status"] == "SANDBOX_RUNNING" {
                break;
            }
            assert!(
                frame["status"] != "SANDBOX_CREATION_ERROR",
                "create failed: {frame}"
            );
        }
        (
            ws,
            id.expect("sandbox_id before SANDBOX_RUNNING"),
            token.expect("a token"),
        )
    }

    pub async fn attach(&self, id: &str, token: &str) -> Ws {
        self.connect(&format!("/attach/{id}?sandbox_token={token}"))
            .await
    }
}

/// A client socket.
pub struct Ws {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
    closed: bool,
}

impl Ws {
    pub async fn connect(url: &str) -> Self {
        Self::try_connect(url, None)
            .await
            .unwrap_or_else(|err| panic!("cannot connect to {url}: {err}"))
    }

    /// Connects, optionally sending a `Cookie` header as the clients replay it.
    pub async fn try_connect(
        url: &str,
        cookie: Option<&str>,
    ) -> Result<Self, tokio_tungstenite::tungstenite::Error> {
        let mut request = url.into_client_request()?;
        if let Some(cookie) = cookie {
            request
                .headers_mut()
                .insert("cookie", cookie.parse().expect("cookie header"));
        }
        let (stream, _response) = tokio_tungstenite::connect_async(request).await?;
        Ok(Self {
            stream,
            closed: false,
        })
    }

    /// Connects with a tiny TCP receive window, so that whatever the test does
    /// not read backs up into the server instead of the kernel's buffers.
    pub async fn connect_small_window(url: &str) -> Self {
        let stream = small_window_socket(url).await;
        Self {
            stream,
            closed: false,
        }
    }

    /// Connects and returns the upgrade response's `Set-Cookie`, as the
    /// clients read it (to replay it on reconnects).
    pub async fn connect_for_cookie(url: &str, cookie: Option<&str>) -> (Self, Option<String>) {
        let mut request = url.into_client_request().expect("request");
        if let Some(cookie) = cookie {
            request
                .headers_mut()
                .insert("cookie", cookie.parse().expect("cookie header"));
        }
        let (stream, response) = tokio_tungstenite::connect_async(request)
            .await
            .unwrap_or_else(|err| panic!("cannot connect to {url}: {err}"));
        let set_cookie = response
            .headers()
            .get("set-cookie")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (
            Self {
                stream,
                closed: false,
            },
            set_cookie,
        )
    }

    pub async fn send(&mut self, frame: Value) {
        self.send_raw(Message::text(frame.to_string())).await;
    }

    /// Closes the socket from the client's side at once (a close frame,
    /// then the end of the stream), without waiting for anything.
    pub async fn close_now(mut self) {
        let _ = self.stream.close(None).await;
    }

    /// Closes with the handshake: a close frame, then reads until the
    /// server's. The server lets go of the attach slot when it reads the
    /// close, so the next attach finds it free.
    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(Ok(_)) = self.stream.next().await {}
        })
        .await;
        assert!(ended.is_ok(), "the server did not answer the close in 10 s");
    }

    /// Sends, ignoring a socket the server already closed.
    pub async fn try_send(&mut self, frame: Value) {
        let _ = self.stream.send(Message::text(frame.to_string())).await;
    }

    pub async fn send_raw(&mut self, message: Message) {
        self.stream.send(message).await.expect("send a frame");
    }

    /// Sends without expecting success (the server may close mid-send).
    pub async fn try_send_raw(
        &mut self,
        message: Message,
    ) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        self.stream.send(message).await
    }

    /// Reads up to the close frame; its code and reason (`None`: the socket
    /// ended without one).
    pub async fn close_frame(&mut self) -> Option<(u16, String)> {
        loop {
            match self.next_message().await {
                Some(Message::Close(frame)) => {
                    self.closed = true;
                    return frame.map(|f| (u16::from(f.code), f.reason.as_str().to_owned()));
                }
                Some(_) => {}
                None => {
                    self.closed = true;
                    return None;
                }
            }
        }
    }

    /// The next frame as JSON; panics on a close or a timeout.
    pub async fn next_value(&mut self) -> Value {
        loop {
            match self.next_message().await {
                Some(Message::Text(text)) => {
                    return serde_json::from_str(text.as_str()).expect("server frames are JSON");
                }
                Some(Message::Close(frame)) => panic!("socket closed: {frame:?}"),
                Some(_) => {}
                None => panic!("socket ended"),
            }
        }
    }

    /// The next message of any kind (binary frames included); `None` when
    /// the socket ended.
    pub async fn next_raw(&mut self) -> Option<Message> {
        self.next_message().await
    }

    async fn next_message(&mut self) -> Option<Message> {
        match tokio::time::timeout(FRAME_TIMEOUT, self.stream.next()).await {
            Ok(Some(Ok(message))) => Some(message),
            Ok(Some(Err(_)) | None) => None,
            Err(_) => panic!("no frame within {FRAME_TIMEOUT:?}"),
        }
    }

    /// The next frame in short form (see the module docs).
    pub async fn next(&mut self) -> String {
        if self.closed {
            panic!("reading past the close");
        }
        loop {
            match self.next_message().await {
                Some(Message::Text(text)) => {
                    let frame: Value =
                        serde_json::from_str(text.as_str()).expect("server frames are JSON");
                    return short(&frame);
                }
                Some(Message::Close(frame)) => {
                    self.closed = true;
                    return format!("close:{}", frame.map_or(0, |f| u16::from(f.code)));
                }
                Some(_) => {}
                None => {
                    self.closed = true;
                    return "close:none".to_owned();
                }
            }
        }
    }

    /// Frames up to and including the first for which `stop` holds.
    pub async fn until(&mut self, stop: impl Fn(&str) -> bool) -> Vec<String> {
        let mut frames = Vec::new();
        loop {
            let frame = self.next().await;
            let done = stop(&frame) || frame.starts_with("close:");
            frames.push(frame);
            if done {
                return frames;
            }
        }
    }

    /// Frames up to and including `status`.
    pub async fn until_status(&mut self, status: &str) -> Vec<String> {
        self.until(|frame| frame == status).await
    }

    /// Frames up to and including the close.
    pub async fn until_close(&mut self) -> Vec<String> {
        self.until(|_| false).await
    }

    /// Runs `code` and returns its frames through `SANDBOX_EXECUTION_DONE`,
    /// with consecutive stdout (and stderr) chunks merged.
    pub async fn exec(&mut self, language: &str, code: &str) -> Vec<String> {
        self.send(serde_json::json!({"language": language, "code": code}))
            .await;
        merge_chunks(self.until_status("SANDBOX_EXECUTION_DONE").await)
    }

    /// Runs `code`, asserts it ended (`SANDBOX_EXECUTION_DONE`) and returns
    /// its stdout.
    pub async fn stdout_of(&mut self, language: &str, code: &str) -> String {
        let frames = self.exec(language, code).await;
        assert_eq!(
            frames.last().map(String::as_str),
            Some("SANDBOX_EXECUTION_DONE"),
            "{frames:?}"
        );
        frames
            .iter()
            .filter_map(|f| f.strip_prefix("stdout:"))
            .collect()
    }

    /// True when the next message is a pong.
    pub async fn next_pong(&mut self) -> bool {
        matches!(self.next_message().await, Some(Message::Pong(_)))
    }

    /// Nothing arrives for `quiet`.
    /// Runs `code` in the sandbox's persistent Python session: its stdout.
    pub async fn session_stdout(&mut self, code: &str) -> String {
        self.send(serde_json::json!({"language": "python", "code": code, "session": true}))
            .await;
        let frames = merge_chunks(self.until_status("SANDBOX_EXECUTION_DONE").await);
        frames
            .iter()
            .find_map(|f| f.strip_prefix("stdout:"))
            .unwrap_or_default()
            .to_owned()
    }

    pub async fn expect_silence(&mut self, quiet: Duration) {
        if let Ok(Some(Ok(message))) = tokio::time::timeout(quiet, self.stream.next()).await {
            panic!("expected silence, got {message:?}");
        }
    }
}

/// Merges consecutive `stdout:`/`stderr:` frames of the same stream.
pub fn merge_chunks(frames: Vec<String>) -> Vec<String> {
    let mut merged: Vec<String> = Vec::new();
    for frame in frames {
        let stream = ["stdout:", "stderr:"]
            .into_iter()
            .find(|prefix| frame.starts_with(prefix));
        if let (Some(prefix), Some(last)) = (stream, merged.last_mut())
            && last.starts_with(prefix)
        {
            last.push_str(&frame[prefix.len()..]);
            continue;
        }
        merged.push(frame);
    }
    merged
}

fn short(frame: &Value) -> String {
    let text = |key: &str| frame[key].as_str().unwrap_or_default().to_owned();
    match frame["event"].as_str() {
        Some("status_update") => text("status"),
        Some("stdout") => format!("stdout:{}", text("data")),
        Some("stderr") => format!("stderr:{}", text("data")),
        Some("error") => format!("error:{}", text("message")),
        Some("exit_code") => format!("exit_code:{}", frame["exit_code"]),
        Some("sandbox_id") => "sandbox_id".to_owned(),
        _ => panic!("a server frame without a known event: {frame}"),
    }
}

/// A WebSocket client whose TCP receive window is tiny (4 KiB), so that
/// whatever the test does not read backs up into the server.
pub async fn small_window_socket(url: &str) -> WebSocketStream<MaybeTlsStream<TcpStream>> {
    let request = url.into_client_request().expect("request");
    let host = request.uri().host().expect("host").to_owned();
    let port = request.uri().port_u16().expect("port");
    let addr = tokio::net::lookup_host((host.as_str(), port))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let stream = socket.connect(addr).await.expect("connect");
    let (stream, _response) =
        tokio_tungstenite::client_async(request, MaybeTlsStream::Plain(stream))
            .await
            .unwrap_or_else(|err| panic!("cannot connect to {url}: {err}"));
    stream
}
