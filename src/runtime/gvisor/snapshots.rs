//! Filesystem snapshots and the images sandboxes start on: a snapshot's
//! manifest and archive (downloaded, verified, streamed into a fresh
//! sandbox's agent to unpack), and which sandbox image a create uses (asked
//! for, the snapshot's, or the default; fetched by digest from the
//! checkpoint store when this host lacks it).

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use controllers::api::{SnapshotManifest, decode};
use controllers::layout::snapshot_manifest_key;
use controllers::runtime::RuntimeError;

use super::GvisorRuntime;
use crate::runtime::agent::protocol::Request;
use crate::runtime::agent::{AgentConnection, AgentError};
use crate::runtime::checkpoint::transfer::download_verified;
use crate::runtime::images::catalog::Image;

impl GvisorRuntime {
    /// The manifest of the filesystem snapshot `name`.
    pub(super) async fn snapshot_manifest(
        &self,
        name: &str,
    ) -> Result<SnapshotManifest, RuntimeError> {
        let invalid = || {
            RuntimeError::Invalid(format!(
                "invalid snapshot name {:?}",
                controllers::api::snapshot_name_of(name)
            ))
        };
        let manifest_key = snapshot_manifest_key(name).ok_or_else(invalid)?;
        match self.snapshots.get(&manifest_key).await {
            Ok(object) => {
                decode(&object.data).map_err(|err| RuntimeError::Invalid(err.to_string()))
            }
            // The name only, never the owner's scope: another owner's
            // snapshot and an unknown one are refused alike (docs/security.md).
            Err(controllers::store::StoreError::NotFound { .. }) => {
                Err(RuntimeError::Invalid(format!(
                    "no filesystem snapshot named {:?}",
                    controllers::api::snapshot_name_of(name)
                )))
            }
            Err(err) => Err(err.into()),
        }
    }

    /// The image a create asks for: `"image"` if given, else the image the
    /// snapshot it starts from was taken on (its files may need that image's
    /// programs), else the default.
    pub(super) async fn image_for_create(
        &self,
        requested: Option<&str>,
        snapshot: Option<&SnapshotManifest>,
    ) -> Result<Image, RuntimeError> {
        let images = &self.config.images;
        let invalid = |err: crate::runtime::images::catalog::ImageError| {
            RuntimeError::Invalid(err.to_string())
        };
        match (requested, snapshot.and_then(|s| s.sandbox_image.as_deref())) {
            (Some(name), _) => images.resolve(name).map_err(invalid),
            (None, Some(digest)) => self.image_by_digest(digest).await.map_err(|err| {
                RuntimeError::Invalid(format!(
                    "the filesystem snapshot was taken on sandbox image {digest}, which this \
                     server does not have ({err}); name an image with \"image\" to use another"
                ))
            }),
            (None, None) => images.default_image().map_err(invalid),
        }
    }

    /// The image `digest`: here, or fetched once from the checkpoint store.
    pub(super) async fn image_by_digest(&self, digest: &str) -> Result<Image, ImageUnavailable> {
        let images = &self.config.images;
        let missing = match images.resolve(digest) {
            Ok(image) => return Ok(image),
            Err(err) => err,
        };
        let _one_at_a_time = self.image_fetch.lock().await;
        crate::runtime::images::store::fetch(
            images,
            self.checkpoints.as_ref(),
            digest,
            &self.config.state_dir.join("image-transfer"),
        )
        .await
        .map_err(|fetch| ImageUnavailable { missing, fetch })
    }

    /// Downloads a snapshot archive into a file under the state directory.
    pub(super) async fn download_snapshot(
        &self,
        manifest: &SnapshotManifest,
    ) -> Result<PathBuf, RuntimeError> {
        let key = controllers::store::ObjectKey::new(manifest.archive.key.as_str())
            .map_err(|err| RuntimeError::Invalid(err.to_string()))?;
        let local = self
            .config
            .state_dir
            .join(self.owner.temporary("snapshot", "tar.gz"));
        let downloaded = download_verified(
            self.snapshots.as_ref(),
            &key,
            &local,
            &manifest.archive.sha256,
            manifest.archive.size,
        )
        .await;
        if let Err(err) = downloaded {
            let _ = tokio::fs::remove_file(&local).await;
            return Err(err);
        }
        Ok(local)
    }

    /// Streams a snapshot archive into a fresh sandbox's agent, which unpacks it.
    pub(super) async fn populate_from_snapshot(
        &self,
        agent: &AgentConnection,
        manifest: &SnapshotManifest,
    ) -> Result<(), RuntimeError> {
        let local = self.download_snapshot(manifest).await?;
        let result = self.send_archive(agent, &local).await;
        let _ = tokio::fs::remove_file(&local).await;
        result
    }

    pub(super) async fn send_archive(
        &self,
        agent: &AgentConnection,
        path: &Path,
    ) -> Result<(), RuntimeError> {
        use tokio::io::AsyncReadExt;
        let agent_error =
            |err: AgentError| RuntimeError::Failed(format!("restoring the snapshot: {err}"));
        let read_error =
            |err: std::io::Error| RuntimeError::Failed(format!("reading the snapshot: {err}"));
        let mut file = tokio::fs::File::open(path).await.map_err(read_error)?;
        let id = agent.new_id("x");
        let mut buffer = vec![0u8; 256 * 1024];
        loop {
            let n = file.read(&mut buffer).await.map_err(read_error)?;
            if n == 0 {
                break;
            }
            agent
                .send(
                    &Request::ExtractChunk {
                        data: BASE64.encode(&buffer[..n]),
                    }
                    .with_id(&id),
                )
                .await
                .map_err(agent_error)?;
        }
        agent
            .request_with_id(&id, Request::ExtractEnd, Duration::from_secs(300))
            .await
            .map_err(agent_error)?;
        Ok(())
    }
}

/// An image this server lacks and could not fetch from the checkpoint store.
#[derive(Debug, thiserror::Error)]
#[error("{missing}; {fetch}")]
pub(super) struct ImageUnavailable {
    missing: crate::runtime::images::catalog::ImageError,
    fetch: crate::runtime::images::store::ImageStoreError,
}
