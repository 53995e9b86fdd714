//! Sandbox images in the checkpoint store, so an instance can fetch an image it
//! lacks (once, with a progress log) instead of refusing a restore.
//!
//! `sandbox_images/sha256-<hex>.tar` is the image's canonical tar: the very
//! bytes its digest is the SHA-256 of, so a download is verified against the
//! digest itself; `sandbox_images/sha256-<hex>.json` holds its size and recipe.
//! Images are pushed by an operator (`sandboxctl push-image NAME`), not by
//! every checkpoint: an image is about 325 MB and changes rarely. Fetching is
//! by digest only (what checkpoints and snapshots record); names stay local.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use controllers::store::{BlobSource, ObjectKey, PutMode, Store, StoreError};
use serde::{Deserialize, Serialize};
use tokio::process::Command;

use super::catalog::{Image, ImageCatalog, ImageError, is_digest};
use crate::runtime::checkpoint::transfer::{download_verified, sha256_file};

/// Where images live in the store.
pub const IMAGES_PREFIX: &str = "sandbox_images";

#[derive(Debug, thiserror::Error)]
pub enum ImageStoreError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(
        "the store has no copy of sandbox image {0} (push it from a host that has it: `sandboxctl push-image NAME`)"
    )]
    NotInStore(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("sandbox image {digest}: {detail}")]
    Transfer { digest: String, detail: String },
}

/// What `sandbox_images/<digest>.json` records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredImage {
    pub digest: String,
    /// Bytes of the canonical tar.
    pub size: u64,
    /// The image's `image.json` (packages, base, date), if it had one.
    #[serde(default)]
    pub recipe: serde_json::Value,
}

fn keys(digest: &str) -> Result<(ObjectKey, ObjectKey), ImageStoreError> {
    let transfer = |detail: String| ImageStoreError::Transfer {
        digest: digest.to_owned(),
        detail,
    };
    if !is_digest(digest) {
        return Err(ImageError::InvalidName(digest.to_owned()).into());
    }
    let tar = ObjectKey::new(format!("{IMAGES_PREFIX}/{digest}.tar"))
        .map_err(|err| transfer(err.to_string()))?;
    let manifest = ObjectKey::new(format!("{IMAGES_PREFIX}/{digest}.json"))
        .map_err(|err| transfer(err.to_string()))?;
    Ok((tar, manifest))
}

/// Uploads the image `name` unless the store has it; `true` if it uploaded.
/// `scratch` holds the tar on its way (as big as the image).
pub async fn push(
    catalog: &ImageCatalog,
    store: &dyn Store,
    name: &str,
    scratch: &Path,
) -> Result<(Image, bool), ImageStoreError> {
    let image = catalog.resolve(name)?;
    let (tar_key, manifest_key) = keys(&image.digest)?;
    match store.get(&manifest_key).await {
        Ok(_) => return Ok((image, false)),
        Err(StoreError::NotFound { .. }) => {}
        Err(err) => return Err(err.into()),
    }
    let transfer = |detail: String| ImageStoreError::Transfer {
        digest: image.digest.clone(),
        detail,
    };
    tokio::fs::create_dir_all(scratch)
        .await
        .map_err(|err| transfer(format!("{}: {err}", scratch.display())))?;
    let file = scratch.join(format!("push-{}.tar", uuid::Uuid::new_v4().simple()));
    let result = async {
        #[allow(
            clippy::disallowed_methods,
            reason = "times work on the host (runsc, processes, files) for a log line; not the instance's clock"
        )]
        let started = std::time::Instant::now();
        run(Command::new("tar")
            .args(["--sort=name", "--numeric-owner", "--format=gnu", "-C"])
            .arg(&image.rootfs)
            .arg("-cf")
            .arg(&file)
            .arg("."))
        .await
        .map_err(transfer)?;
        let (sha256, size) = sha256_file(&file)
            .await
            .map_err(|err| transfer(err.to_string()))?;
        if format!("sha256-{sha256}") != image.digest {
            return Err(transfer(format!(
                "its directory no longer matches its digest (now sha256-{sha256}): it was changed after it was built; rebuild it"
            )));
        }
        tracing::info!(digest = %image.digest, bytes = size, "uploading the sandbox image");
        store.upload_blob(&tar_key, BlobSource::File(file.clone())).await?;
        let recipe = read_recipe(&image.rootfs);
        let manifest = StoredImage {
            digest: image.digest.clone(),
            size,
            recipe,
        };
        let body = serde_json::to_vec_pretty(&manifest).map_err(|err| transfer(err.to_string()))?;
        match store.put(&manifest_key, body.into(), PutMode::Create).await {
            Ok(_) | Err(StoreError::PreconditionFailed { .. }) => {}
            Err(err) => return Err(err.into()),
        }
        tracing::info!(digest = %image.digest, bytes = size, elapsed_ms = started.elapsed().as_millis() as u64, "sandbox image uploaded");
        Ok(())
    }
    .await;
    let _ = tokio::fs::remove_file(&file).await;
    result.map(|()| (image, true))
}

/// Downloads the image `digest` into `catalog` (verified against the digest),
/// unless it is there already.
pub async fn fetch(
    catalog: &ImageCatalog,
    store: &dyn Store,
    digest: &str,
    scratch: &Path,
) -> Result<Image, ImageStoreError> {
    if let Ok(image) = catalog.resolve(digest) {
        return Ok(image);
    }
    let (tar_key, manifest_key) = keys(digest)?;
    let transfer = |detail: String| ImageStoreError::Transfer {
        digest: digest.to_owned(),
        detail,
    };
    let manifest: StoredImage = match store.get(&manifest_key).await {
        Ok(object) => serde_json::from_slice(&object.data)
            .map_err(|err| transfer(format!("unreadable {manifest_key}: {err}")))?,
        Err(StoreError::NotFound { .. }) => {
            return Err(ImageStoreError::NotInStore(digest.to_owned()));
        }
        Err(err) => return Err(err.into()),
    };
    tokio::fs::create_dir_all(scratch)
        .await
        .map_err(|err| transfer(format!("{}: {err}", scratch.display())))?;
    #[allow(
        clippy::disallowed_methods,
        reason = "times work on the host (runsc, processes, files) for a log line; not the instance's clock"
    )]
    let started = std::time::Instant::now();
    tracing::info!(
        digest,
        bytes = manifest.size,
        "fetching a sandbox image this host lacks"
    );
    let file = scratch.join(format!("fetch-{}.tar", uuid::Uuid::new_v4().simple()));
    let work = catalog
        .dir
        .join(format!(".fetch-{}", uuid::Uuid::new_v4().simple()));
    let result = async {
        download_verified(
            store,
            &tar_key,
            &file,
            digest.trim_start_matches("sha256-"),
            manifest.size,
        )
        .await
        .map_err(|err| transfer(err.to_string()))?;
        let rootfs = work.join("rootfs");
        tokio::fs::create_dir_all(&rootfs)
            .await
            .map_err(|err| transfer(err.to_string()))?;
        run(Command::new("tar")
            .args(["--numeric-owner", "-xpf"])
            .arg(&file)
            .arg("-C")
            .arg(&rootfs))
        .await
        .map_err(transfer)?;
        let recipe =
            serde_json::to_vec_pretty(&manifest.recipe).map_err(|err| transfer(err.to_string()))?;
        tokio::fs::write(work.join("image.json"), recipe)
            .await
            .map_err(|err| transfer(err.to_string()))?;
        set_mode_755(&work).map_err(|err| transfer(err.to_string()))?;
        let target = catalog.dir.join(digest);
        if !target.join("rootfs").is_dir() {
            tokio::fs::rename(&work, &target)
                .await
                .map_err(|err| transfer(format!("moving it into place: {err}")))?;
        }
        Ok::<(), ImageStoreError>(())
    }
    .await;
    let _ = tokio::fs::remove_file(&file).await;
    let _ = tokio::fs::remove_dir_all(&work).await;
    result?;
    tracing::info!(
        digest,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "sandbox image fetched"
    );
    Ok(catalog.resolve(digest)?)
}

/// Where pushes and fetches keep their tar when no other place is given.
pub fn default_scratch(catalog: &ImageCatalog) -> PathBuf {
    catalog.dir.join(".scratch")
}

fn read_recipe(rootfs: &Path) -> serde_json::Value {
    rootfs
        .parent()
        .and_then(|dir| std::fs::read(dir.join("image.json")).ok())
        .and_then(|text| serde_json::from_slice(&text).ok())
        .unwrap_or(serde_json::Value::Null)
}

fn set_mode_755(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

async fn run(command: &mut Command) -> Result<(), String> {
    let text = format!("{:?}", command.as_std());
    let output = command
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|err| format!("cannot run {text}: {err}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{text} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}
