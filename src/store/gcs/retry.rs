//! How the GCS store retries: exponential backoff with jitter on
//! throttling, server errors, connection failures and timeouts only; every
//! attempt within a timeout and every small-object call within a deadline
//! (the module docs of `super` say why), and how a client error maps to
//! what a caller can act on.

use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use controllers::store::{ObjectKey, PutMode, StoreError};

use super::{BLOB_FLOOR_BYTES_PER_S, GcsStore};

/// How often and how patiently a failed operation is retried.
#[derive(Debug, Clone)]
pub struct RetrySettings {
    /// Retries after the first attempt.
    pub max_retries: usize,
    pub min_delay: Duration,
    pub max_delay: Duration,
    /// One attempt at a small object (a read, a write, a list page, a
    /// delete, one rewrite call) is abandoned after this; a blob's attempt
    /// gets this plus its bytes at [`BLOB_FLOOR_BYTES_PER_S`].
    pub attempt_timeout: Duration,
    /// A small-object call, retries included, fails after this.
    pub deadline: Duration,
}

impl Default for RetrySettings {
    /// Attempts of 4 s (a small object's request takes tens of milliseconds,
    /// its slow tail a second or two) within 12 s, under the 13 s a default
    /// lease (15 s less 2 s of skew) lets a holder vouch for its holds.
    fn default() -> Self {
        Self {
            max_retries: 6,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            attempt_timeout: Duration::from_secs(4),
            deadline: Duration::from_secs(12),
        }
    }
}

impl RetrySettings {
    fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_max_times(self.max_retries)
            .with_jitter()
    }
}

impl GcsStore {
    /// Runs `attempt` (each one within the attempt timeout) until it
    /// succeeds, fails for good, retries run out, or the deadline passes.
    pub(super) async fn retrying<T, F, Fut>(
        &self,
        operation: &'static str,
        key: &str,
        attempt: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        self.retrying_after(operation, key, attempt, |delay| delay)
            .await
    }

    /// [`Self::retrying`], each retry's delay as `pace` makes it.
    pub(super) async fn retrying_after<T, F, Fut>(
        &self,
        operation: &'static str,
        key: &str,
        mut attempt: F,
        mut pace: impl FnMut(Duration) -> Duration,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let limit = self.retry.attempt_timeout;
        let retried = (|| within(limit, key, attempt()))
            .retry(self.retry.backoff())
            .when(StoreError::is_transient)
            .adjust(|_, delay| delay.map(&mut pace))
            .notify(|err, delay| {
                tracing::warn!(operation, key, %err, ?delay, "transient storage error, retrying");
            });
        match tokio::time::timeout(self.retry.deadline, retried).await {
            Ok(outcome) => outcome,
            Err(_) => Err(StoreError::transient(
                key,
                format!(
                    "{operation} got no answer within its {:?} deadline",
                    self.retry.deadline
                ),
            )),
        }
    }

    /// A blob's attempts: the attempt timeout plus `size` at the floor
    /// throughput each, retried as many times, no overall deadline.
    pub(super) async fn retrying_blob<T, F, Fut>(
        &self,
        operation: &'static str,
        key: &str,
        size: u64,
        mut attempt: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let limit =
            self.retry.attempt_timeout + Duration::from_secs(size.div_ceil(BLOB_FLOOR_BYTES_PER_S));
        (|| within(limit, key, attempt()))
            .retry(self.retry.backoff())
            .when(StoreError::is_transient)
            .notify(|err, delay| {
                tracing::warn!(operation, key, %err, ?delay, "transient storage error, retrying");
            })
            .await
    }
}

/// `attempt`, or a transient error when it takes longer than `limit`.
async fn within<T>(
    limit: Duration,
    key: &str,
    attempt: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, attempt)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::transient(
                key,
                format!("no answer within {limit:?}"),
            ))
        })
}

/// Maps a client error to what a caller can act on.
pub(super) fn classify(key: &ObjectKey, err: google_cloud_storage::Error) -> StoreError {
    match err.http_status_code() {
        Some(404) => StoreError::not_found(key),
        Some(412) => StoreError::precondition(key, "ifGenerationMatch did not match"),
        Some(408 | 429 | 500..=599) => StoreError::transient(key, err),
        Some(_) => StoreError::other(key, err),
        None if err.is_connect() || err.is_timeout() || err.is_io() || err.is_transport() => {
            StoreError::transient(key, err)
        }
        None => StoreError::other(key, err),
    }
}

/// A failed write's error: a compare-and-swap on a vanished object failed
/// its precondition.
pub(super) fn put_error(
    key: &ObjectKey,
    err: google_cloud_storage::Error,
    mode: PutMode,
) -> StoreError {
    match classify(key, err) {
        StoreError::NotFound { key } if matches!(mode, PutMode::Update(_)) => {
            StoreError::precondition(key, "the object no longer exists")
        }
        other => other,
    }
}
