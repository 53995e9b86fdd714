//! Checkpoint images and snapshot archives on their way to and from the store:
//! hashing, verified streaming downloads, and the host's CPU features.
//!
//! runsc restores some corrupted images without complaint (flipped bytes give a
//! running sandbox with silently different memory), so every image is hashed
//! when taken and verified, size and SHA-256, before anyone uses the restored
//! sandbox. Each image is read once per move: hashed while it is downloaded,
//! or, on a directory store, hashed in place while runsc reads it (no copy).

use std::path::Path;

use controllers::runtime::RuntimeError;
use controllers::store::{BlobReader, ObjectKey, Store};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BUFFER: usize = 1 << 20;

/// SHA-256 (hex) and size of a local file.
pub async fn sha256_file(path: &Path) -> std::io::Result<(String, u64)> {
    let file = std::fs::File::open(path)?;
    sha256_of(file).await
}

/// SHA-256 (hex) and size of an open file, read on a blocking thread (the
/// hash of a 200 MB image is CPU work a runtime worker must not do).
pub async fn sha256_of(mut file: std::fs::File) -> std::io::Result<(String, u64)> {
    tokio::task::spawn_blocking(move || {
        use std::io::Read as _;
        let mut hasher = Sha256::new();
        let mut buffer = vec![0u8; BUFFER];
        let mut size = 0u64;
        loop {
            let n = file.read(&mut buffer)?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
            size += n as u64;
        }
        Ok((hex::encode(hasher.finalize()), size))
    })
    .await
    .map_err(std::io::Error::other)?
}

/// The refusal of an image whose size or digest is not what the manifest
/// promised; `None` when both match.
pub fn mismatch(
    key: &str,
    (actual_sha256, actual_size): (&str, u64),
    expected_sha256: &str,
    expected_size: u64,
) -> Option<RuntimeError> {
    let detail = if actual_size != expected_size {
        format!(
            "size mismatch: expected {expected_size} bytes, got {actual_size} (truncated or replaced)"
        )
    } else if actual_sha256 != expected_sha256 {
        format!("checksum mismatch: expected sha256 {expected_sha256}, got {actual_sha256}")
    } else {
        return None;
    };
    Some(RuntimeError::CorruptImage {
        key: key.to_owned(),
        detail,
    })
}

/// Streams `key` into `dest`, then checks its size and SHA-256 against what the
/// manifest promised. A mismatch removes the file and names both digests.
pub async fn download_verified(
    store: &dyn Store,
    key: &ObjectKey,
    dest: &Path,
    expected_sha256: &str,
    expected_size: u64,
) -> Result<(), RuntimeError> {
    let reader = store.download_blob(key).await?;
    let (actual, size) = write_hashed(reader, key, dest).await?;
    match mismatch(
        key.as_str(),
        (&actual, size),
        expected_sha256,
        expected_size,
    ) {
        Some(err) => {
            let _ = tokio::fs::remove_file(dest).await;
            Err(err)
        }
        None => Ok(()),
    }
}

/// Writes what `reader` (the object `key`) yields into `dest` and returns
/// its SHA-256 (hex) and size.
pub async fn write_hashed(
    mut reader: BlobReader,
    key: &ObjectKey,
    dest: &Path,
) -> Result<(String, u64), RuntimeError> {
    let io =
        |err: std::io::Error| RuntimeError::Failed(format!("writing {}: {err}", dest.display()));
    let mut file = tokio::fs::File::create(dest).await.map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; BUFFER];
    let mut size = 0u64;
    loop {
        let n = reader
            .read(&mut buffer)
            .await
            .map_err(|err| RuntimeError::Failed(format!("downloading {key}: {err}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        file.write_all(&buffer[..n]).await.map_err(io)?;
        size += n as u64;
    }
    // No fsync: a crash discards this scratch copy anyway.
    file.flush().await.map_err(io)?;
    Ok((hex::encode(hasher.finalize()), size))
}

/// The CPU feature flags of this host (`flags` in /proc/cpuinfo), sorted.
pub fn host_cpu_features() -> Vec<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mut flags: Vec<String> = cpuinfo
        .lines()
        .find_map(|line| {
            line.strip_prefix("flags")
                .and_then(|rest| rest.split_once(':'))
        })
        .map(|(_, flags)| flags.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    flags.sort();
    flags.dedup();
    flags
}

/// Refuses a restore whose image needs CPU features this host lacks, naming them.
pub fn check_cpu_features(required: &[String], host: &[String]) -> Result<(), RuntimeError> {
    let missing: Vec<&str> = required
        .iter()
        .filter(|flag| host.binary_search(flag).is_err())
        .map(String::as_str)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(RuntimeError::Incompatible(format!(
            "this host lacks CPU features the checkpoint was taken with: {}",
            missing.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_cpu_features_are_named() {
        let host = vec!["avx2".to_owned(), "sse4_2".to_owned()];
        assert!(check_cpu_features(&["avx2".to_owned()], &host).is_ok());
        let err =
            check_cpu_features(&["avx512f".to_owned(), "avx2".to_owned()], &host).unwrap_err();
        assert!(
            err.to_string().contains("avx512f") && !err.to_string().contains("avx2,"),
            "{err}"
        );
    }
}
