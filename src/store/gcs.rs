//! The GCS Store, on Google's official `google-cloud-storage` crate.
//!
//! Which request carries which object matters, because only some requests honour
//! preconditions on fake-gcs-server (`docs/gcs.md`):
//! - small JSON objects: the multipart path (`send_buffered`) with
//!   `ifGenerationMatch`, honoured by GCS and the emulator alike;
//! - blobs: streaming resumable uploads (`send_unbuffered` from a file) and
//!   streaming reads, memory flat in the blob's size; no precondition (blob names
//!   are fresh, write-once);
//! - list, delete and copy (rewrite): the JSON API through [`JsonApi`], because
//!   the crate offers them only over gRPC, which the emulator does not speak.
//!
//! The crate's own retry loop is turned off; every operation is retried here with
//! exponential backoff and jitter, on throttling (429), server errors (5xx),
//! connection failures and timeouts only, and every operation has a deadline:
//! each attempt at a small object is abandoned after
//! [`RetrySettings::attempt_timeout`] and the whole call, retries included,
//! after [`RetrySettings::deadline`]; a blob's attempt gets time for its bytes
//! at a floor throughput, and a download whose stream stalls fails. A store
//! that cannot be reached so answers with a transient error in bounded time,
//! never hangs (an instance cut off from its bucket must learn that it can no
//! longer renew its lease).
//!
//! A conditional write is retried with its precondition, never without. When
//! a retry's precondition fails after an earlier attempt's answer was lost,
//! that attempt may have landed: the object is read back, and if it holds
//! exactly the bytes written the write is reported as done, at the object's
//! generation (`docs/decisions/0001-backon-for-retries.md`).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::pacing::{MutationPacer, generation_time};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use controllers::store::{
    BlobReader, BlobSource, Generation, ListPage, ObjectInfo, ObjectKey, PutMode, Store,
    StoreError, Versioned, validate_prefix,
};
use google_cloud_auth::credentials::{self, Credentials};
use google_cloud_gax::retry_policy::NeverRetry;
use google_cloud_storage::client::Storage;
use tokio_util::io::StreamReader;

use super::gcs_json::JsonApi;

mod retry;

pub use retry::RetrySettings;
use retry::{classify, put_error};

/// The public GCS endpoint.
pub const GCS_ENDPOINT: &str = "https://storage.googleapis.com";

/// The slowest throughput a blob transfer is given time for.
pub const BLOB_FLOOR_BYTES_PER_S: u64 = 4 << 20;

/// A blob up to this size goes up in one request (multipart, from memory),
/// not a resumable upload's two (start, then body): a small sandbox's
/// checkpoint image (about 2.5 MB) saves a write's round trip, 80 ms in
/// GCS's region, on the checkpoint's and the handoff's critical path.
const ONE_REQUEST_UPLOAD_MAX: u64 = 8 << 20;

/// Bytes all one-request uploads may hold in memory at once; an upload
/// that would go beyond streams from its file as a resumable upload (a
/// drain checkpointing dozens of sandboxes keeps the server's memory flat).
const ONE_REQUEST_UPLOAD_BUDGET: usize = 64 << 20;

/// A small read unanswered after this is sent a second time (costs a Class
/// B read, $0.0000004, in the tail only): GCS answers a read in the region
/// in tens of milliseconds, and its tail takes seconds.
const HEDGE_READ_AFTER: Duration = Duration::from_millis(250);

/// A small write unanswered after this is sent a second time (a Class A
/// write, $0.000005, in the tail only): a write's tail takes seconds, and
/// the handoff waits on several (the intent, the manifest, the transfer),
/// a start on an instance that held nothing on its lease's renewal.
const HEDGE_WRITE_AFTER: Duration = Duration::from_millis(400);

/// A one-request upload unanswered after [`HEDGE_WRITE_AFTER`] plus its
/// bytes at this rate is sent a second time: a checkpoint's image (about
/// 2.5 MB for a small sandbox) is on every checkpoint's and handoff's
/// critical path, and one request in a thousand takes a second or two.
/// Conservative against GCS's in-region throughput, so a twin goes only in
/// the tail.
const HEDGE_UPLOAD_BYTES_PER_S: u64 = 25 << 20;

/// A download whose stream brings nothing for this long fails.
const DOWNLOAD_STALL: Duration = Duration::from_secs(30);

/// Where the store is and how to reach it.
#[derive(Debug, Clone)]
pub struct GcsConfig {
    pub bucket: String,
    /// An emulator's endpoint (`http://127.0.0.3`), from `STORAGE_EMULATOR_HOST`.
    /// `None` talks to GCS with Application Default Credentials.
    pub emulator_endpoint: Option<String>,
    pub retry: RetrySettings,
}

impl GcsConfig {
    pub fn new(bucket: impl Into<String>) -> Self {
        Self {
            bucket: bucket.into(),
            emulator_endpoint: None,
            retry: RetrySettings::default(),
        }
    }

    /// Points at the emulator named like `STORAGE_EMULATOR_HOST` does
    /// (`host:port` or a URL).
    pub fn with_emulator_host(mut self, host: &str) -> Self {
        self.emulator_endpoint = Some(emulator_endpoint(host));
        self
    }
}

/// Turns a `STORAGE_EMULATOR_HOST` value into an endpoint URL.
pub fn emulator_endpoint(host: &str) -> String {
    let host = host.trim().trim_end_matches('/');
    let url = if host.contains("://") {
        host.to_owned()
    } else {
        format!("http://{host}")
    };
    url.strip_suffix(":80").map(str::to_owned).unwrap_or(url)
}

/// A Store on one GCS bucket.
#[derive(Clone)]
pub struct GcsStore {
    client: Storage,
    json: JsonApi,
    bucket: String,
    bucket_path: String,
    retry: RetrySettings,
    /// When each object was last changed here: a rate-limited write is
    /// retried when its second is up, not on the network's backoff.
    pacer: MutationPacer,
    /// Memory for one-request uploads, in bytes ([`ONE_REQUEST_UPLOAD_BUDGET`]).
    upload_memory: std::sync::Arc<tokio::sync::Semaphore>,
}

impl fmt::Debug for GcsStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GcsStore")
            .field("bucket", &self.bucket)
            .field("json_api", &self.json)
            .finish_non_exhaustive()
    }
}

impl GcsStore {
    /// Builds the clients. Does not contact the bucket.
    pub async fn connect(config: GcsConfig) -> Result<Self, StoreError> {
        let bucket = config.bucket.clone();
        let setup_error = |detail: String| StoreError::other(format!("gs://{bucket}"), detail);
        crate::tls::install_crypto_provider();
        let credentials: Credentials = match &config.emulator_endpoint {
            Some(_) => credentials::anonymous::Builder::new().build(),
            None => credentials::Builder::default()
                .build()
                .map_err(|err| setup_error(format!("no Google credentials: {err}")))?,
        };
        let endpoint = config
            .emulator_endpoint
            .clone()
            .unwrap_or_else(|| GCS_ENDPOINT.to_owned());
        let mut builder = Storage::builder()
            .with_credentials(credentials.clone())
            .with_retry_policy(NeverRetry);
        if config.emulator_endpoint.is_some() {
            builder = builder.with_endpoint(endpoint.clone());
        }
        let client = builder
            .build()
            .await
            .map_err(|err| setup_error(format!("cannot build the storage client: {err}")))?;
        Ok(Self {
            client,
            json: JsonApi::new(&endpoint, credentials),
            bucket_path: format!("projects/_/buckets/{}", config.bucket),
            bucket: config.bucket,
            retry: config.retry,
            pacer: MutationPacer::default(),
            upload_memory: std::sync::Arc::new(tokio::sync::Semaphore::new(
                ONE_REQUEST_UPLOAD_BUDGET,
            )),
        })
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// [`Self::get_once`], asked again if the first has no answer after
    /// [`HEDGE_READ_AFTER`]; the first answer wins. A read's slow tail (a
    /// second or two, one request in a thousand) would otherwise hold up
    /// whatever waits for it: a handoff's poll, a pass. Both reads start
    /// after the call, so either answer is at least as new as the call.
    async fn get_hedged(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        hedged(HEDGE_READ_AFTER, || self.get_once(key), |_| true).await
    }

    /// [`Self::put_once`], sent again if the first has no answer after
    /// [`HEDGE_WRITE_AFTER`] ([`hedged`]); the first success wins, and an
    /// error waits for the other attempt. Both carry the same bytes. Unconditional
    /// (`Overwrite`): whichever lands last leaves the object as written
    /// (its generation may be the other's: nobody makes a conditional write
    /// from an overwrite's generation). Conditional: both carry the same
    /// precondition, so at most one lands; the other fails its
    /// precondition against it, which is why an error waits for the other
    /// answer (and a precondition failure after a second request is checked
    /// against the object's bytes by [`Store::put`], as after a retry).
    /// `sent` counts the requests.
    async fn put_hedged(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
        throttled: &std::sync::atomic::AtomicBool,
        sent: &std::sync::atomic::AtomicUsize,
    ) -> Result<Generation, StoreError> {
        hedged(
            HEDGE_WRITE_AFTER,
            || {
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.put_once(key, data.clone(), mode, throttled)
            },
            Result::is_ok,
        )
        .await
    }

    async fn get_once(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        let mut response = self
            .client
            .read_object(&self.bucket_path, key.as_str())
            .send()
            .await
            .map_err(|err| classify(key, err))?;
        let generation = Generation(response.object().generation);
        let mut data = BytesMut::new();
        while let Some(chunk) = response.next().await {
            data.extend_from_slice(&chunk.map_err(|err| classify(key, err))?);
        }
        Ok(Versioned {
            data: data.freeze(),
            generation,
        })
    }

    async fn put_once(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
        throttled: &std::sync::atomic::AtomicBool,
    ) -> Result<Generation, StoreError> {
        let mut request = self
            .client
            .write_object(&self.bucket_path, key.as_str(), data)
            .set_content_type(content_type(key));
        match mode {
            PutMode::Overwrite => {}
            PutMode::Create => request = request.set_if_generation_match(0_i64),
            PutMode::Update(generation) => request = request.set_if_generation_match(generation.0),
        }
        match request.send_buffered().await {
            Ok(object) => Ok(Generation(object.generation)),
            Err(err) => {
                // GCS's per-object mutation rate (or a throttled bucket):
                // the retry waits for the object's second (`pacing`).
                throttled.store(
                    err.http_status_code() == Some(429),
                    std::sync::atomic::Ordering::Relaxed,
                );
                Err(put_error(key, err, mode))
            }
        }
    }

    async fn upload_file_once(
        &self,
        key: &ObjectKey,
        path: &PathBuf,
    ) -> Result<ObjectInfo, StoreError> {
        let file = tokio::fs::File::open(path).await.map_err(|err| {
            StoreError::other(key, format!("cannot open {}: {err}", path.display()))
        })?;
        let object = self
            .client
            .write_object(&self.bucket_path, key.as_str(), file)
            .set_content_type("application/octet-stream")
            // Always resumable: the single-shot path for small payloads stores a
            // trailing checksum part on the emulator and reports a mismatch.
            .with_resumable_upload_threshold(0_usize)
            .send_unbuffered()
            .await
            .map_err(|err| classify(key, err))?;
        Ok(ObjectInfo {
            key: key.clone(),
            size: u64::try_from(object.size).unwrap_or(0),
            generation: Generation(object.generation),
        })
    }

    /// One attempt at a blob held in memory, in one request: a media
    /// upload through the JSON API. Not the crate's single-shot upload: in
    /// a debug build its futures for a payload of megabytes overflowed a
    /// 2 MiB worker stack (every chaos server aborted at its first
    /// checkpoint), and on the emulator it stores a trailing checksum part.
    async fn upload_bytes_once(
        &self,
        key: &ObjectKey,
        data: Bytes,
    ) -> Result<ObjectInfo, StoreError> {
        self.json.upload_media(&self.bucket, key, data).await
    }

    /// [`Self::upload_bytes_once`], sent again if the first has no answer
    /// after [`HEDGE_WRITE_AFTER`] plus its bytes at
    /// [`HEDGE_UPLOAD_BYTES_PER_S`]; the first success wins, an error waits
    /// for the other attempt. Both carry the same bytes (shared, not
    /// copied) to a key written once (a checkpoint's image, an archive
    /// under its digest), unconditionally: if both land, the second
    /// leaves the object as the first did. Only the size and digest of an
    /// image are recorded, never its generation.
    async fn upload_bytes_hedged(
        &self,
        key: &ObjectKey,
        data: &Bytes,
        size: u64,
    ) -> Result<ObjectInfo, StoreError> {
        let after = HEDGE_WRITE_AFTER
            + Duration::from_secs_f64(size as f64 / HEDGE_UPLOAD_BYTES_PER_S as f64);
        hedged(
            after,
            || self.upload_bytes_once(key, data.clone()),
            Result::is_ok,
        )
        .await
    }

    /// Uploads a file, retrying whole uploads on transient failures: a
    /// small one from memory in one request each time (while the memory
    /// budget allows), else streamed from the file, resumable.
    async fn upload_file(&self, key: &ObjectKey, path: PathBuf) -> Result<ObjectInfo, StoreError> {
        let size = tokio::fs::metadata(&path).await.map_or(0, |m| m.len());
        let memory = (size <= ONE_REQUEST_UPLOAD_MAX)
            .then(|| u32::try_from(size).ok())
            .flatten()
            .and_then(|bytes| {
                std::sync::Arc::clone(&self.upload_memory)
                    .try_acquire_many_owned(bytes)
                    .ok()
            });
        if let Some(_memory) = memory {
            let data = Bytes::from(tokio::fs::read(&path).await.map_err(|err| {
                StoreError::other(key, format!("cannot read {}: {err}", path.display()))
            })?);
            return self
                .retrying_blob("upload", key.as_str(), size, || {
                    self.upload_bytes_hedged(key, &data, size)
                })
                .await;
        }
        self.retrying_blob("upload", key.as_str(), size, || {
            self.upload_file_once(key, &path)
        })
        .await
    }

    /// After a conditional write's retry failed its precondition: did an
    /// earlier attempt, whose answer was lost, land? Yes if the object holds
    /// exactly `data` (nobody else writes the same bytes: every JSON object
    /// a writer puts carries its own holder, epoch or time); then the write
    /// is done, at the object's generation.
    async fn landed_earlier(&self, key: &ObjectKey, data: &Bytes) -> Option<Generation> {
        let current = self.get(key).await.ok()?;
        (current.data == *data).then(|| {
            tracing::info!(
                key = key.as_str(),
                generation = current.generation.0,
                "a retried write found its own earlier attempt landed"
            );
            current.generation
        })
    }
}

#[async_trait]
impl Store for GcsStore {
    async fn get(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        self.retrying("get", key.as_str(), || self.get_hedged(key))
            .await
    }

    async fn put(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        let attempts = std::sync::atomic::AtomicUsize::new(0);
        let throttled = std::sync::atomic::AtomicBool::new(false);
        let outcome = self
            .retrying_after(
                "put",
                key.as_str(),
                || self.put_hedged(key, data.clone(), mode, &throttled, &attempts),
                |delay| {
                    if !throttled.load(std::sync::atomic::Ordering::Relaxed) {
                        return delay;
                    }
                    let jitter = Duration::from_millis(rand::random_range(0..100));
                    let landed_at = match mode {
                        PutMode::Update(generation) => generation_time(generation.0),
                        PutMode::Overwrite | PutMode::Create => None,
                    };
                    self.pacer
                        .retry_after(key.as_str(), delay, jitter, landed_at)
                },
            )
            .await;
        if outcome.is_ok() {
            self.pacer.changed(key.as_str());
        }
        match outcome {
            Err(err @ StoreError::PreconditionFailed { .. })
                if attempts.load(std::sync::atomic::Ordering::Relaxed) > 1
                    && !matches!(mode, PutMode::Overwrite) =>
            {
                self.landed_earlier(key, &data).await.ok_or(err)
            }
            other => other,
        }
    }

    async fn list_page(
        &self,
        prefix: &str,
        page_token: Option<String>,
    ) -> Result<ListPage, StoreError> {
        validate_prefix(prefix)?;
        self.retrying("list", prefix, || {
            self.json.list(&self.bucket, prefix, page_token.as_deref())
        })
        .await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        self.retrying("delete", key.as_str(), || {
            self.json.delete(&self.bucket, key)
        })
        .await
    }

    /// A server-side rewrite: one Class A request, no bytes through here.
    async fn copy_blob(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectInfo, StoreError> {
        self.retrying("copy", to.as_str(), || {
            self.json.rewrite(&self.bucket, from, to)
        })
        .await
    }

    async fn upload_blob(
        &self,
        key: &ObjectKey,
        source: BlobSource,
    ) -> Result<ObjectInfo, StoreError> {
        match source {
            BlobSource::File(path) => self.upload_file(key, path).await,
            BlobSource::Reader(mut reader) => {
                // A stream cannot be rewound for a retry or a resumed chunk, so
                // spool it to disk first: memory stays flat, retries stay possible.
                let spool = std::env::temp_dir()
                    .join(format!("sandboxd-upload-{}", uuid::Uuid::new_v4().simple()));
                let spooled = async {
                    // Owner-only: the bytes may be a sandbox's memory.
                    let mut file = tokio::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&spool)
                        .await?;
                    tokio::io::copy(&mut reader, &mut file).await?;
                    // No fsync: a crash discards this scratch copy anyway.
                    tokio::io::AsyncWriteExt::flush(&mut file).await
                }
                .await;
                let result = match spooled {
                    Ok(()) => self.upload_file(key, spool.clone()).await,
                    Err(err) => Err(StoreError::other(
                        key,
                        format!("cannot spool the upload: {err}"),
                    )),
                };
                let _ = tokio::fs::remove_file(&spool).await;
                result
            }
        }
    }

    async fn download_blob(&self, key: &ObjectKey) -> Result<BlobReader, StoreError> {
        let response = self
            .retrying("download", key.as_str(), || async {
                self.client
                    .read_object(&self.bucket_path, key.as_str())
                    .send()
                    .await
                    .map_err(|err| classify(key, err))
            })
            .await?;
        let chunks = futures::stream::unfold(response, |mut response| async move {
            let item = match tokio::time::timeout(DOWNLOAD_STALL, response.next()).await {
                Ok(item) => item?.map_err(std::io::Error::other),
                Err(_) => Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the download brought nothing for {DOWNLOAD_STALL:?}"),
                )),
            };
            Some((item, response))
        });
        Ok(Box::pin(StreamReader::new(Box::pin(chunks))))
    }
}

/// The first answer of `attempt()`, and of a second `attempt()` started if
/// the first has none after `after` (a request's slow tail, hedged), that
/// `settles`; an answer that does not waits for the other attempt's, which
/// is returned whatever it is (reads: every answer settles; writes: only a
/// success, since a conditional write's twin fails its precondition
/// against the first's landing and may answer before it). On the heap: a
/// write's future is large, and two of them on the stack of a deep call (a
/// checkpoint's) overflow a worker's stack.
async fn hedged<T, Attempt>(
    after: Duration,
    mut attempt: impl FnMut() -> Attempt,
    settles: impl Fn(&T) -> bool,
) -> T
where
    Attempt: std::future::Future<Output = T>,
{
    let mut first = Box::pin(attempt());
    tokio::select! {
        answer = &mut first => return answer,
        () = tokio::time::sleep(after) => {}
    }
    let mut second = Box::pin(attempt());
    tokio::select! {
        answer = &mut first => if settles(&answer) { answer } else { second.await },
        answer = &mut second => if settles(&answer) { answer } else { first.await },
    }
}

fn content_type(key: &ObjectKey) -> &'static str {
    if key.as_str().ends_with(".json") {
        "application/json"
    } else {
        "application/octet-stream"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answer = Result<u32, &'static str>;

    /// A hedged write whose first attempt answers `late`, only once its
    /// twin (sent after 50 ms) has answered `early`: what it returns, and
    /// how many attempts it sent. The order is made, not timed, so a loaded
    /// machine cannot let the first answer before the twin is sent.
    async fn hedged_write(late: Answer, early: Answer) -> (Answer, usize) {
        let (twin_answered, first_released) = tokio::sync::oneshot::channel::<()>();
        let (mut twin_answered, mut first_released) = (Some(twin_answered), Some(first_released));
        let mut sent = 0;
        let outcome = hedged(
            Duration::from_millis(50),
            || {
                sent += 1;
                let first = first_released.take();
                let twin = if first.is_none() {
                    twin_answered.take()
                } else {
                    None
                };
                async move {
                    if let Some(released) = first {
                        // Bounded: never hedged, it answers (alone) after 10 s.
                        let _ = tokio::time::timeout(Duration::from_secs(10), released).await;
                        return late;
                    }
                    if let Some(answered) = twin {
                        let _ = answered.send(());
                    }
                    early
                }
            },
            Result::is_ok,
        )
        .await;
        (outcome, sent)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hedged_write_waits_past_its_twins_refusal_for_its_own_success() {
        // The first lands but answers late; its twin is refused at once
        // (its precondition fails against the first).
        assert_eq!(
            hedged_write(Ok(7), Err("precondition failed")).await,
            (Ok(7), 2)
        );
        // Both fail: the later error.
        assert_eq!(
            hedged_write(Err("late"), Err("early")).await,
            (Err("late"), 2)
        );
        // The twin lands first: it serves.
        assert_eq!(hedged_write(Err("late"), Ok(8)).await, (Ok(8), 2));
    }

    /// A call whose attempt answers after `answers_after` (virtual time),
    /// hedged after 250 ms: how many attempts it sent.
    async fn attempts_answering_after(answers_after: Duration) -> usize {
        let mut sent = 0;
        let answer: Answer = hedged(
            Duration::from_millis(250),
            || {
                sent += 1;
                async move {
                    tokio::time::sleep(answers_after).await;
                    Ok(1)
                }
            },
            Result::is_ok,
        )
        .await;
        assert_eq!(answer, Ok(1));
        sent
    }

    /// Only a call still unanswered at the hedge's delay gets a twin. The
    /// clock is tokio's paused one: a loaded machine cannot make a prompt
    /// answer look slow (the store tests against the emulator measure the
    /// slow side only, for that reason).
    #[tokio::test(start_paused = true)]
    async fn a_call_answered_in_time_is_sent_once_a_slow_one_twice() {
        assert_eq!(attempts_answering_after(Duration::from_millis(20)).await, 1);
        assert_eq!(
            attempts_answering_after(Duration::from_millis(249)).await,
            1
        );
        assert_eq!(attempts_answering_after(Duration::from_secs(3)).await, 2);
    }

    #[test]
    fn emulator_hosts_become_endpoints() {
        assert_eq!(emulator_endpoint("127.0.0.3:80"), "http://127.0.0.3");
        assert_eq!(emulator_endpoint("http://127.0.0.3/"), "http://127.0.0.3");
        assert_eq!(emulator_endpoint("localhost:4443"), "http://localhost:4443");
    }
}
