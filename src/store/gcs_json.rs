//! List, delete and server-side copy over the GCS JSON API.
//!
//! The official crate offers these only on its gRPC `StorageControl` client,
//! which fake-gcs-server does not speak; this small helper does them over HTTP
//! with the same credentials, so production and tests take the same path.
//!
//! Every request has a deadline ([`REQUEST_TIMEOUT`], connecting
//! [`CONNECT_TIMEOUT`]): a GCS front end that accepts and never answers is a
//! transient error the caller retries, not a reconcile pass stuck forever
//! (docs/security.md).

use std::fmt;
use std::time::Duration;

use controllers::store::{Generation, LIST_PAGE_SIZE, ListPage, ObjectInfo, ObjectKey, StoreError};
use google_cloud_auth::credentials::{CacheableResource, Credentials};
use http::{Extensions, HeaderMap};
use serde::Deserialize;

/// A JSON-API client for one endpoint.
#[derive(Clone)]
pub struct JsonApi {
    http: reqwest::Client,
    base: String,
    credentials: Credentials,
}

impl fmt::Debug for JsonApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonApi")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListResponse {
    #[serde(default)]
    items: Vec<ListItem>,
    next_page_token: Option<String>,
}

/// GCS encodes 64-bit numbers as strings in JSON.
#[derive(Deserialize)]
struct ListItem {
    name: String,
    size: String,
    generation: String,
}

/// Longest one JSON-API request may take (one page of a listing, a delete,
/// one step of a rewrite, which GCS answers within about 30 s).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a connection to the endpoint may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl JsonApi {
    /// `endpoint` is the service root (`https://storage.googleapis.com`).
    pub fn new(endpoint: &str, credentials: Credentials) -> Self {
        Self::with_timeout(endpoint, credentials, REQUEST_TIMEOUT)
    }

    /// [`Self::new`] with another request deadline.
    pub fn with_timeout(endpoint: &str, credentials: Credentials, timeout: Duration) -> Self {
        let http = crate::tls::http_client_builder()
            .connect_timeout(CONNECT_TIMEOUT.min(timeout))
            .timeout(timeout)
            .build()
            .unwrap_or_else(|err| {
                tracing::warn!(%err, "cannot configure the GCS JSON client's deadlines; using the defaults");
                crate::tls::http_client_builder()
                    .build()
                    .unwrap_or_else(|err| panic!("cannot build an HTTP client at all: {err}"))
            });
        Self {
            http,
            base: format!("{}/storage/v1", endpoint.trim_end_matches('/')),
            credentials,
        }
    }

    async fn auth_headers(&self, what: &str) -> Result<HeaderMap, StoreError> {
        match self.credentials.headers(Extensions::new()).await {
            Ok(CacheableResource::New { data, .. }) => Ok(data),
            Ok(CacheableResource::NotModified) => Ok(HeaderMap::new()),
            Err(err) if err.is_transient() => Err(StoreError::transient(what, err)),
            Err(err) => Err(StoreError::other(what, format!("credentials: {err}"))),
        }
    }

    /// One page of `GET /b/{bucket}/o?prefix=…&pageToken=…`.
    pub async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        page_token: Option<&str>,
    ) -> Result<ListPage, StoreError> {
        let what = format!("gs://{bucket}/{prefix}");
        let max_results = LIST_PAGE_SIZE.to_string();
        let mut query = vec![
            ("prefix", prefix),
            ("maxResults", max_results.as_str()),
            ("fields", "items(name,size,generation),nextPageToken"),
        ];
        if let Some(token) = page_token {
            query.push(("pageToken", token));
        }
        let response = self
            .http
            .get(format!("{}/b/{bucket}/o", self.base))
            .headers(self.auth_headers(&what).await?)
            .query(&query)
            .send()
            .await
            .map_err(|err| transport_error(&what, &err))?;
        let response = check_status(&what, response).await?;
        let body: ListResponse = response
            .json()
            .await
            .map_err(|err| StoreError::other(&what, format!("unreadable listing: {err}")))?;
        let mut objects = Vec::with_capacity(body.items.len());
        for item in body.items {
            let parse = |field: &str, value: &str| {
                value.parse::<i64>().map_err(|_| {
                    StoreError::other(
                        &item.name,
                        format!("listing has a non-numeric {field} {value:?}"),
                    )
                })
            };
            let size = parse("size", &item.size)?;
            let generation = parse("generation", &item.generation)?;
            // Objects written by other tools may have names we do not accept as keys.
            let Ok(key) = ObjectKey::new(item.name.as_str()) else {
                tracing::debug!(
                    name = item.name,
                    "listing skips an object whose name is not a valid key"
                );
                continue;
            };
            objects.push(ObjectInfo {
                key,
                size: u64::try_from(size).unwrap_or(0),
                generation: Generation(generation),
            });
        }
        Ok(ListPage {
            objects,
            next_page_token: body.next_page_token.filter(|token| !token.is_empty()),
        })
    }

    /// `DELETE /b/{bucket}/o/{object}`.
    pub async fn delete(&self, bucket: &str, key: &ObjectKey) -> Result<(), StoreError> {
        // Keys contain only [A-Za-z0-9._-/]; only '/' needs escaping in a path segment.
        let object = key.as_str().replace('/', "%2F");
        let response = self
            .http
            .delete(format!("{}/b/{bucket}/o/{object}", self.base))
            .headers(self.auth_headers(key.as_str()).await?)
            .send()
            .await
            .map_err(|err| transport_error(key.as_str(), &err))?;
        check_status(key.as_str(), response).await.map(drop)
    }

    /// `POST /b/{bucket}/o/{from}/rewriteTo/b/{bucket}/o/{to}`, repeated
    /// with the returned `rewriteToken` until GCS says `done` (a large object
    /// may take several calls; the bytes never leave the service).
    pub async fn rewrite(
        &self,
        bucket: &str,
        from: &ObjectKey,
        to: &ObjectKey,
    ) -> Result<ObjectInfo, StoreError> {
        let source = from.as_str().replace('/', "%2F");
        let destination = to.as_str().replace('/', "%2F");
        let url = format!(
            "{}/b/{bucket}/o/{source}/rewriteTo/b/{bucket}/o/{destination}",
            self.base
        );
        let mut token: Option<String> = None;
        loop {
            let mut request = self
                .http
                .post(&url)
                .headers(self.auth_headers(to.as_str()).await?)
                .query(&[("fields", "done,rewriteToken,resource(name,size,generation)")]);
            if let Some(token) = &token {
                request = request.query(&[("rewriteToken", token.as_str())]);
            }
            let response = request
                .send()
                .await
                .map_err(|err| transport_error(to.as_str(), &err))?;
            let response = match check_status(from.as_str(), response).await {
                Err(StoreError::NotFound { .. }) => return Err(StoreError::not_found(from)),
                other => other?,
            };
            let body: RewriteResponse = response.json().await.map_err(|err| {
                StoreError::other(to, format!("unreadable rewrite response: {err}"))
            })?;
            if body.done {
                let resource = body.resource.ok_or_else(|| {
                    StoreError::other(to, "rewrite finished without the new object")
                })?;
                let number = |field: &str, value: &str| {
                    value.parse::<i64>().map_err(|_| {
                        StoreError::other(
                            to,
                            format!("rewrite gave a non-numeric {field} {value:?}"),
                        )
                    })
                };
                return Ok(ObjectInfo {
                    key: to.clone(),
                    size: u64::try_from(number("size", &resource.size)?).unwrap_or(0),
                    generation: Generation(number("generation", &resource.generation)?),
                });
            }
            token = Some(
                body.rewrite_token
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| {
                        StoreError::other(to, "rewrite not done and no rewriteToken to continue")
                    })?,
            );
        }
    }
}

impl JsonApi {
    /// Uploads `data` as `key` in one request (`uploadType=media`): a small
    /// blob's upload without a resumable session's second round trip
    /// (decision 22). No precondition: blob names are fresh, written once.
    pub async fn upload_media(
        &self,
        bucket: &str,
        key: &ObjectKey,
        data: bytes::Bytes,
    ) -> Result<ObjectInfo, StoreError> {
        let url = format!(
            "{}/upload/storage/v1/b/{bucket}/o",
            self.base.trim_end_matches("/storage/v1")
        );
        let response = self
            .http
            .post(&url)
            .headers(self.auth_headers(key.as_str()).await?)
            .query(&[
                ("uploadType", "media"),
                ("name", key.as_str()),
                ("fields", "name,size,generation"),
            ])
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(data)
            .send()
            .await
            .map_err(|err| transport_error(key.as_str(), &err))?;
        let response = check_status(key.as_str(), response).await?;
        let item: ListItem = response
            .json()
            .await
            .map_err(|err| StoreError::other(key, format!("unreadable upload response: {err}")))?;
        let number = |field: &str, value: &str| {
            value.parse::<i64>().map_err(|_| {
                StoreError::other(key, format!("upload gave a non-numeric {field} {value:?}"))
            })
        };
        Ok(ObjectInfo {
            key: key.clone(),
            size: u64::try_from(number("size", &item.size)?).unwrap_or(0),
            generation: Generation(number("generation", &item.generation)?),
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RewriteResponse {
    #[serde(default)]
    done: bool,
    #[serde(default)]
    rewrite_token: Option<String>,
    #[serde(default)]
    resource: Option<ListItem>,
}

fn transport_error(what: &str, err: &reqwest::Error) -> StoreError {
    StoreError::transient(what, format!("request failed: {err}"))
}

async fn check_status(
    what: &str,
    response: reqwest::Response,
) -> Result<reqwest::Response, StoreError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let body = response.text().await.unwrap_or_default();
    let detail = format!(
        "HTTP {status}: {}",
        body.chars().take(300).collect::<String>()
    );
    Err(match status.as_u16() {
        404 => StoreError::not_found(what),
        412 => StoreError::precondition(what, detail),
        408 | 429 | 500..=599 => StoreError::transient(what, detail),
        _ => StoreError::other(what, detail),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An endpoint that accepts the connection and never answers
    /// used to hold a listing forever; it is a transient error at the deadline.
    #[tokio::test]
    async fn a_silent_endpoint_is_a_transient_error_at_the_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                open.push(socket);
            }
        });
        let credentials = google_cloud_auth::credentials::anonymous::Builder::new().build();
        let api = JsonApi::with_timeout(&endpoint, credentials, Duration::from_millis(500));
        let err = tokio::time::timeout(
            Duration::from_secs(10),
            api.list("bucket", "sandboxes/", None),
        )
        .await
        .expect("the listing has no deadline")
        .unwrap_err();
        assert!(err.is_transient(), "{err}");
        held.abort();
    }
}
