//! One instance's way to the bucket: an HTTP/1.1 proxy on port 80 of its own
//! loopback address (the official GCS crate drops the port from `Host`, see
//! `lib.rs`), in front of fake-gcs-server. Each client connection gets its
//! own connection to the emulator, and each request is classified, delayed,
//! perhaps answered 429/503 by the model, forwarded, and recorded.
//!
//! The `Host` header is passed through unchanged, so the emulator builds a
//! resumable upload's session URL on the proxy's address: the upload's data
//! comes through the proxy too.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, LOCATION};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex as AsyncMutex, watch};

use super::record::RequestRecord;
use super::request::{Classified, classify, object_in_body, upload_id_of};
use super::{Partition, Shared};
use crate::FixtureError;

type Body = BoxBody<Bytes, hyper::Error>;

/// Upload bodies larger than this are streamed, their object unnamed.
const NAME_SCAN_LIMIT: u64 = 8 << 20;

/// The request's connection is cut (a partition, the emulator down).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Cut(String);

/// A running proxy; stops when dropped.
#[derive(Debug)]
pub struct InstanceProxy {
    pub instance: String,
    pub addr: SocketAddr,
    partition: watch::Sender<Partition>,
    task: tokio::task::JoinHandle<()>,
}

impl InstanceProxy {
    /// Binds the first free port 80 among 127.0.1.1–127.0.2.254 and serves.
    pub(super) async fn start(shared: Arc<Shared>, instance: &str) -> Result<Self, FixtureError> {
        let mut listener = None;
        'search: for third in 1..=2u8 {
            for fourth in 1..=254u8 {
                let ip = Ipv4Addr::new(127, 0, third, fourth);
                if let Ok(bound) = TcpListener::bind(SocketAddr::from((ip, 80))).await {
                    listener = Some(bound);
                    break 'search;
                }
            }
        }
        let listener =
            listener.ok_or_else(|| FixtureError::NoLoopback("1.1..=2.254 (proxies)".to_owned()))?;
        let addr = listener.local_addr()?;
        let (partition, watcher) = watch::channel(Partition::Connected);
        let context = Arc::new(Context {
            shared,
            instance: instance.to_owned(),
            partition: watcher,
        });
        let task = tokio::spawn(accept(listener, context));
        Ok(Self {
            instance: instance.to_owned(),
            addr,
            partition,
            task,
        })
    }

    /// `http://127.0.N.M`, for this instance's `STORAGE_EMULATOR_HOST`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr.ip())
    }

    /// Cuts this instance off the bucket, or reconnects it.
    pub fn set_partition(&self, partition: Partition) {
        self.partition.send_replace(partition);
    }

    pub fn partition(&self) -> Partition {
        *self.partition.borrow()
    }
}

impl Drop for InstanceProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Context {
    shared: Arc<Shared>,
    instance: String,
    partition: watch::Receiver<Partition>,
}

async fn accept(listener: TcpListener, context: Arc<Context>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if *context.partition.borrow() == Partition::Refuse {
            // Closed at once: the client's connect or first request fails.
            drop(stream);
            continue;
        }
        connections.spawn(serve(stream, Arc::clone(&context)));
        while connections.try_join_next().is_some() {}
    }
}

/// One client connection, with its own connection to the emulator; cut when
/// the instance is partitioned with [`Partition::Refuse`].
async fn serve(stream: TcpStream, context: Arc<Context>) {
    let upstream = Arc::new(AsyncMutex::new(None));
    let service_context = Arc::clone(&context);
    let service = hyper::service::service_fn(move |request| {
        let context = Arc::clone(&service_context);
        let upstream = Arc::clone(&upstream);
        async move { handle(request, &context, &upstream).await }
    });
    let connection =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut partition = context.partition.clone();
    tokio::select! {
        _ = connection => {}
        _ = partition.wait_for(|p| *p == Partition::Refuse) => {}
    }
}

type Upstream = AsyncMutex<Option<hyper::client::conn::http1::SendRequest<Body>>>;

async fn handle(
    request: Request<Incoming>,
    context: &Context,
    upstream: &Upstream,
) -> Result<Response<Body>, Cut> {
    let start = Instant::now();
    wait_out_black_hole(context).await?;
    let (mut parts, body) = request.into_parts();
    let method = parts.method.as_str().to_owned();
    let mut class = classify(&method, parts.uri.path(), parts.uri.query());
    let request_length = content_length(&parts.headers);
    let body: Body = if class.name_in_body && request_length.is_some_and(|n| n <= NAME_SCAN_LIMIT) {
        let bytes = body
            .collect()
            .await
            .map_err(|err| Cut(format!("request body: {err}")))?
            .to_bytes();
        if let Some(name) = object_in_body(&bytes) {
            class.object = name;
        }
        Full::new(bytes)
            .map_err(|never: Infallible| match never {})
            .boxed()
    } else {
        body.boxed()
    };
    if let Some(id) = &class.upload_id
        && let Some(name) = context.shared.upload_object(id)
    {
        class.object = name;
    }
    let shared = &context.shared;
    let delay = shared.delay(class.kind) + shared.profile.body_time(request_length.unwrap_or(0));
    tokio::time::sleep(delay).await;
    if let Some(status) = shared.injected_fault() {
        return Ok(finish(
            context,
            &class,
            &method,
            start,
            true,
            refusal(status),
        ));
    }
    if class.mutation && !shared.admit_mutation(&class.object) {
        return Ok(finish(
            context,
            &class,
            &method,
            start,
            false,
            refusal(StatusCode::TOO_MANY_REQUESTS),
        ));
    }
    parts.headers.remove("proxy-connection");
    let response = forward(upstream, shared.upstream, Request::from_parts(parts, body)).await?;
    if shared.lose_response() {
        record(context, &class, &method, start, 0, true, None);
        return Err(Cut("the answer was lost (storage model)".to_owned()));
    }
    if class.name_in_body
        && let Some(id) = response
            .headers()
            .get(LOCATION)
            .and_then(|value| value.to_str().ok())
            .and_then(upload_id_of)
    {
        shared.remember_upload(id, class.object.clone());
    }
    let response_length = content_length(response.headers()).unwrap_or(0);
    tokio::time::sleep(shared.profile.body_time(response_length)).await;
    // A partition that began meanwhile holds or cuts the answer too.
    wait_out_black_hole(context).await?;
    Ok(finish(
        context,
        &class,
        &method,
        start,
        false,
        response.map(|body| body.boxed()),
    ))
}

/// Holds the request while the instance is black-holed; a refusal cuts it.
async fn wait_out_black_hole(context: &Context) -> Result<(), Cut> {
    let mut partition = context.partition.clone();
    let now = *partition
        .wait_for(|p| *p != Partition::BlackHole)
        .await
        .map_err(|_| Cut("the proxy stopped".to_owned()))?;
    if now == Partition::Refuse {
        return Err(Cut("partitioned".to_owned()));
    }
    Ok(())
}

async fn forward(
    upstream: &Upstream,
    to: SocketAddr,
    request: Request<Body>,
) -> Result<Response<Incoming>, Cut> {
    let mut sender = upstream.lock().await;
    let open = match sender.as_mut() {
        Some(existing) => existing.ready().await.is_ok(),
        None => false,
    };
    if !open {
        let stream = TcpStream::connect(to)
            .await
            .map_err(|err| Cut(format!("the emulator at {to}: {err}")))?;
        let _ = stream.set_nodelay(true);
        let (new, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| Cut(format!("the emulator at {to}: {err}")))?;
        tokio::spawn(connection);
        *sender = Some(new);
    }
    let Some(sender) = sender.as_mut() else {
        return Err(Cut("no connection to the emulator".to_owned()));
    };
    sender
        .send_request(request)
        .await
        .map_err(|err| Cut(format!("the emulator at {to}: {err}")))
}

fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// A GCS-shaped error answer.
fn refusal(status: StatusCode) -> Response<Body> {
    let (reason, message) = if status == StatusCode::TOO_MANY_REQUESTS {
        (
            "rateLimitExceeded",
            "The object exceeded the rate limit for object mutation operations (storage model).",
        )
    } else {
        ("backendError", "Backend Error (storage model)")
    };
    let body = serde_json::json!({
        "error": {"code": status.as_u16(), "message": message, "errors": [{"reason": reason, "message": message}]}
    })
    .to_string();
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn finish(
    context: &Context,
    class: &Classified,
    method: &str,
    start: Instant,
    injected: bool,
    response: Response<Body>,
) -> Response<Body> {
    let status = response.status().as_u16();
    let generation = response
        .headers()
        .get("x-goog-generation")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok());
    record(context, class, method, start, status, injected, generation);
    response
}

/// Records a request that ends now (`status` 0: its connection was cut).
fn record(
    context: &Context,
    class: &Classified,
    method: &str,
    start: Instant,
    status: u16,
    injected: bool,
    generation: Option<i64>,
) {
    context.shared.record(RequestRecord {
        instance: context.instance.clone(),
        method: method.to_owned(),
        object: class.object.clone(),
        kind: class.kind,
        status,
        injected,
        generation,
        start,
        end: Instant::now(),
    });
}
