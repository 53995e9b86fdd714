//! Ready templates: an image may name a start command, in its own root
//! filesystem at [`READY_FILE`], that every sandbox of the image should find
//! already done (modules imported, a model loaded, a service listening).
//!
//! ```json
//! {"language": "python", "code": "import json, sqlite3\nDB = sqlite3.connect(':memory:')", "timeout_s": 300}
//! ```
//!
//! `language` is `python` (the code runs as a cell of the sandbox's
//! persistent Python session, so its globals are there for the user's
//! cells) or `bash` (`bash -c`; a service started in the background keeps
//! running, so start it detached and with its output redirected, and wait in
//! the command until it answers). The command reports ready by exiting 0
//! within `timeout_s` (default 300).
//!
//! The file is part of the image, so the image's digest covers it: the
//! runtime keys what it prepared by digest (`gvisor/ready.rs`), and a
//! checkpoint of such a sandbox restores onto the very same template.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where an image names its start command (relative to its root).
pub const READY_FILE: &str = "etc/sandboxd/ready.json";
/// The most a ready file may hold.
const MAX_READY_FILE: u64 = 64 * 1024;
/// How long a start command may take when its file does not say.
const DEFAULT_TIMEOUT_S: u64 = 300;

/// The language a start command is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadyLanguage {
    /// A cell of the persistent Python session.
    Python,
    /// `bash -c`.
    Bash,
}

/// An image's start command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadyCommand {
    pub language: ReadyLanguage,
    pub code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

impl ReadyCommand {
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S).max(1))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReadyError {
    #[error("{path}: {detail}")]
    Invalid { path: String, detail: String },
}

/// The start command of the image whose root filesystem is `rootfs`, if it
/// names one. Only a regular file counts (never a link out of the image).
pub fn read_ready_command(rootfs: &Path) -> Result<Option<ReadyCommand>, ReadyError> {
    let path = rootfs.join(READY_FILE);
    let invalid = |detail: String| ReadyError::Invalid {
        path: path.display().to_string(),
        detail,
    };
    let metadata = match std::fs::symlink_metadata(&path) {
        Ok(metadata) => metadata,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(invalid(err.to_string())),
    };
    if !metadata.is_file() {
        return Err(invalid("not a regular file".to_owned()));
    }
    if metadata.len() > MAX_READY_FILE {
        return Err(invalid(format!(
            "{} bytes, more than {MAX_READY_FILE}",
            metadata.len()
        )));
    }
    let text = std::fs::read(&path).map_err(|err| invalid(err.to_string()))?;
    let command: ReadyCommand =
        serde_json::from_slice(&text).map_err(|err| invalid(err.to_string()))?;
    if command.code.trim().is_empty() {
        return Err(invalid("\"code\" is empty".to_owned()));
    }
    Ok(Some(command))
}

/// A gzipped tar holding only the ready file for `command` (root-owned,
/// mode 644): unpacked over a base image (`templates::build_from_archive`,
/// `scripts/build-image.sh --from-tar`), it makes a ready template.
pub async fn ready_archive(command: &ReadyCommand, archive: &Path) -> std::io::Result<()> {
    let staging = archive.with_extension("staging");
    let _ = tokio::fs::remove_dir_all(&staging).await;
    let file = staging.join(READY_FILE);
    if let Some(parent) = file.parent() {
        tokio::fs::create_dir_all(parent).await?;
    }
    tokio::fs::write(&file, serde_json::to_vec_pretty(command)?).await?;
    let output = tokio::process::Command::new("tar")
        .args([
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "--mode=u=rwX,go=rX",
            "-czf",
        ])
        .arg(archive)
        .arg("-C")
        .arg(&staging)
        .arg("etc/sandboxd")
        .stdin(std::process::Stdio::null())
        .output()
        .await;
    let _ = tokio::fs::remove_dir_all(&staging).await;
    let output = output?;
    if output.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "tar failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rootfs_with(text: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join(READY_FILE);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(file, text).expect("write");
        dir
    }

    #[test]
    fn an_image_without_the_file_has_no_start_command() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(read_ready_command(dir.path()).expect("read"), None);
    }

    #[test]
    fn a_start_command_is_read_with_its_timeout() {
        let dir = rootfs_with(r#"{"language": "python", "code": "x = 1", "timeout_s": 5}"#);
        let command = read_ready_command(dir.path()).expect("read").expect("some");
        assert_eq!(command.language, ReadyLanguage::Python);
        assert_eq!(command.code, "x = 1");
        assert_eq!(command.timeout(), Duration::from_secs(5));
        let dir = rootfs_with(r#"{"language": "bash", "code": "true"}"#);
        let command = read_ready_command(dir.path()).expect("read").expect("some");
        assert_eq!(command.timeout(), Duration::from_secs(DEFAULT_TIMEOUT_S));
    }

    #[test]
    fn a_bad_file_is_an_error_naming_it() {
        for text in [
            "not json",
            r#"{"language": "perl", "code": "1"}"#,
            r#"{"language": "bash", "code": "  "}"#,
            r#"{"language": "bash", "code": "true", "extra": 1}"#,
        ] {
            let dir = rootfs_with(text);
            let err = read_ready_command(dir.path()).expect_err(text);
            assert!(err.to_string().contains("ready.json"), "{err}");
        }
    }

    #[test]
    fn a_link_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join(READY_FILE);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::os::unix::fs::symlink("/etc/passwd", &file).expect("link");
        assert!(read_ready_command(dir.path()).is_err());
    }
}
