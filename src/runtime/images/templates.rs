//! Templates from filesystem snapshots: a new image that is a base image plus
//! a snapshot's files (a new sandbox created from an existing artifact); and
//! ready templates, a base image plus a start command (`runtime::images::ready`).
//!
//! Sandboxes created on the template start with the snapshot's files already
//! in their root filesystem: nothing is unpacked at create. The build is the
//! same as `scripts/build-image.sh --from-tar`: copy the base image, unpack
//! the archive over it, hash the tree as a canonical tar (so the digest is the
//! script's for the same content), move it to `sha256-<hex>/`, point the name
//! at it. Only the owner of the image directory (root) can do this: the
//! archive's files keep their owners (uid 1000).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use controllers::api::{SnapshotManifest, decode};
use controllers::layout::snapshot_manifest_key;
use controllers::store::{ObjectKey, Store, StoreError};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use tokio::process::Command;

use super::catalog::{Image, ImageCatalog, ImageError, is_image_name};
use super::ready::{ReadyCommand, ready_archive};
use crate::runtime::checkpoint::transfer::download_verified;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("no filesystem snapshot named {0:?}")]
    NoSnapshot(String),
    #[error("the filesystem snapshot {name:?} is unreadable: {detail}")]
    BadSnapshot { name: String, detail: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("building the template failed: {0}")]
    Build(String),
}

/// Builds the image `name` from the filesystem snapshot `snapshot`: its base is
/// the image the snapshot was taken on (`base` overrides it; snapshots taken
/// before images use the default). `scratch` holds the download.
pub async fn template_from_snapshot(
    catalog: &ImageCatalog,
    snapshots: &dyn Store,
    snapshot: &str,
    name: &str,
    base: Option<&str>,
    scratch: &Path,
) -> Result<Image, TemplateError> {
    if !is_image_name(name) {
        return Err(ImageError::InvalidName(name.to_owned()).into());
    }
    let bad = |detail: String| TemplateError::BadSnapshot {
        name: snapshot.to_owned(),
        detail,
    };
    let key = snapshot_manifest_key(snapshot).ok_or_else(|| bad("invalid name".to_owned()))?;
    let manifest: SnapshotManifest = match snapshots.get(&key).await {
        Ok(object) => decode(&object.data).map_err(|err| bad(err.to_string()))?,
        Err(StoreError::NotFound { .. }) => {
            return Err(TemplateError::NoSnapshot(snapshot.to_owned()));
        }
        Err(err) => return Err(err.into()),
    };
    let base = match (base, manifest.sandbox_image.as_deref()) {
        (Some(base), _) => catalog.resolve(base)?,
        (None, Some(digest)) => catalog.resolve(digest)?,
        (None, None) => catalog.default_image()?,
    };
    tokio::fs::create_dir_all(scratch)
        .await
        .map_err(|err| TemplateError::Build(format!("{}: {err}", scratch.display())))?;
    let archive = scratch.join(format!("template-{}.tar.gz", uuid::Uuid::new_v4().simple()));
    let archive_key =
        ObjectKey::new(manifest.archive.key.as_str()).map_err(|err| bad(err.to_string()))?;
    tracing::info!(
        snapshot,
        bytes = manifest.archive.size,
        "downloading the snapshot for a template"
    );
    let downloaded = download_verified(
        snapshots,
        &archive_key,
        &archive,
        &manifest.archive.sha256,
        manifest.archive.size,
    )
    .await
    .map_err(|err| bad(err.to_string()));
    let built = match downloaded {
        Ok(()) => build_from_archive(catalog, name, &base, &archive).await,
        Err(err) => Err(err),
    };
    let _ = tokio::fs::remove_file(&archive).await;
    built
}

/// Builds the ready template `name`: `base` (the default image without
/// one) plus `/etc/sandboxd/ready.json` naming `command`, which every
/// instance runs once and then restores (`runtime::images::ready`). `scratch` holds
/// the archive while it is built.
pub async fn ready_template(
    catalog: &ImageCatalog,
    name: &str,
    base: Option<&str>,
    command: &ReadyCommand,
    scratch: &Path,
) -> Result<Image, TemplateError> {
    let base = match base {
        Some(base) => catalog.resolve(base)?,
        None => catalog.default_image()?,
    };
    let io = |err: std::io::Error| TemplateError::Build(format!("the ready file's archive: {err}"));
    tokio::fs::create_dir_all(scratch).await.map_err(io)?;
    let archive = scratch.join(format!("ready-{}.tar.gz", uuid::Uuid::new_v4().simple()));
    let built = match ready_archive(command, &archive).await {
        Ok(()) => build_from_archive(catalog, name, &base, &archive).await,
        Err(err) => Err(io(err)),
    };
    let _ = tokio::fs::remove_file(&archive).await;
    built
}

/// The image `name`: `base` with the gzipped tar `archive` unpacked over it.
pub async fn build_from_archive(
    catalog: &ImageCatalog,
    name: &str,
    base: &Image,
    archive: &Path,
) -> Result<Image, TemplateError> {
    if !is_image_name(name) {
        return Err(ImageError::InvalidName(name.to_owned()).into());
    }
    let work = catalog
        .dir
        .join(format!(".build-{}", uuid::Uuid::new_v4().simple()));
    let result = build_in(catalog, name, base, archive, &work).await;
    let _ = tokio::fs::remove_dir_all(&work).await;
    result
}

async fn build_in(
    catalog: &ImageCatalog,
    name: &str,
    base: &Image,
    archive: &Path,
    work: &Path,
) -> Result<Image, TemplateError> {
    let io = |what: &str, err: std::io::Error| TemplateError::Build(format!("{what}: {err}"));
    let rootfs = work.join("rootfs");
    tokio::fs::create_dir_all(&rootfs)
        .await
        .map_err(|err| io("creating the build directory", err))?;
    #[allow(
        clippy::disallowed_methods,
        reason = "times work on the host (runsc, processes, files) for a log line; not the instance's clock"
    )]
    let started = std::time::Instant::now();
    let mut copy_source = base.rootfs.clone().into_os_string();
    copy_source.push("/.");
    run(Command::new("cp")
        .args(["-a", "--reflink=auto"])
        .arg(&copy_source)
        .arg(&rootfs))
    .await?;
    run(Command::new("tar")
        .args(["--numeric-owner", "-xzf"])
        .arg(archive)
        .arg("-C")
        .arg(&rootfs))
    .await?;
    let digest = format!("sha256-{}", tree_digest(&rootfs).await?);
    #[allow(
        clippy::disallowed_methods,
        reason = "a template's build date in its image.json, a file on the host; not the instance's clock"
    )]
    let created_at = chrono::Utc::now().to_rfc3339();
    let recipe = serde_json::json!({
        "built_as": name,
        "digest": digest,
        "packages": base_packages(&base.rootfs),
        "base": base.digest,
        "created_at": created_at,
    });
    tokio::fs::write(
        work.join("image.json"),
        serde_json::to_vec_pretty(&recipe).map_err(|err| TemplateError::Build(err.to_string()))?,
    )
    .await
    .map_err(|err| io("writing image.json", err))?;
    let target = catalog.dir.join(&digest);
    if !target.join("rootfs").is_dir() {
        set_mode_755(work).map_err(|err| io("chmod", err))?;
        tokio::fs::rename(work, &target)
            .await
            .map_err(|err| io("moving the image into place", err))?;
    }
    let link = catalog.dir.join(format!(".{name}.new"));
    let _ = tokio::fs::remove_file(&link).await;
    tokio::fs::symlink(&digest, &link)
        .await
        .map_err(|err| io("naming the image", err))?;
    tokio::fs::rename(&link, catalog.dir.join(name))
        .await
        .map_err(|err| io("naming the image", err))?;
    tracing::info!(name, %digest, base = %base.digest, elapsed_ms = started.elapsed().as_millis() as u64, "template built");
    Ok(catalog.resolve(name)?)
}

fn set_mode_755(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

/// The packages of the base image, from its `image.json` (for the listing).
fn base_packages(base_rootfs: &Path) -> serde_json::Value {
    let recipe = base_rootfs
        .parent()
        .map(|dir| dir.join("image.json"))
        .and_then(|path| std::fs::read(path).ok())
        .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok());
    recipe.map_or(serde_json::Value::Null, |r| r["packages"].clone())
}

async fn run(command: &mut Command) -> Result<(), TemplateError> {
    let text = format!("{:?}", command.as_std());
    let output = command
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|err| TemplateError::Build(format!("cannot run {text}: {err}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(TemplateError::Build(format!(
            "{text} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

/// SHA-256 (hex) of `rootfs` as a canonical tar: the image digest, the same
/// as `scripts/build-image.sh` computes.
pub async fn tree_digest(rootfs: &Path) -> Result<String, TemplateError> {
    let mut child = Command::new("tar")
        .args(["--sort=name", "--numeric-owner", "--format=gnu", "-C"])
        .arg(rootfs)
        .args(["-cf", "-", "."])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| TemplateError::Build(format!("cannot run tar: {err}")))?;
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| TemplateError::Build("tar has no stdout".to_owned()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = stdout
            .read(&mut buffer)
            .await
            .map_err(|err| TemplateError::Build(format!("reading tar: {err}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    let output = child
        .wait_with_output()
        .await
        .map_err(|err| TemplateError::Build(format!("tar: {err}")))?;
    if !output.status.success() {
        return Err(TemplateError::Build(format!(
            "hashing {} failed ({}): {}",
            rootfs.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Where a template build keeps its download when no other place is given.
pub fn default_scratch(catalog: &ImageCatalog) -> PathBuf {
    catalog.dir.join(".scratch")
}
