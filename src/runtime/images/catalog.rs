//! Sandbox images on this host: root filesystems of their own, named and
//! versioned by content digest (`docs/runtime.md`, "Images").
//!
//! `scripts/build-image.sh` builds them into the image directory:
//! `sha256-<hex>/rootfs` is an image (read-only, shared by every sandbox on it,
//! each writing into its own in-memory layer), `sha256-<hex>/image.json` what
//! it was built from, and `<name>` a symlink to the digest directory it names
//! now. A sandbox is created on a name and records the digest; a checkpoint
//! restores only onto that digest, so renaming an image never changes what a
//! checkpoint runs on. This module only reads the directory: it resolves names
//! and lists what is there.

use std::path::{Path, PathBuf};

use serde::Serialize;

pub use controllers::api::{IMAGE_NAME_RULE, is_digest, is_image_name};

/// The image a sandbox gets when its creator names none.
pub const DEFAULT_IMAGE: &str = "default";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "invalid image name {0:?}: {rule}",
        rule = IMAGE_NAME_RULE
    )]
    InvalidName(String),
    #[error(
        "no sandbox image {name:?} in {dir}: build it with `scripts/build-image.sh --name {name}` (or point SANDBOXD_IMAGES at the directory that has it)"
    )]
    Missing { name: String, dir: PathBuf },
    #[error("the sandbox image directory {dir} is unreadable: {source}")]
    Unreadable {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// An image resolved on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// What it was asked for by (a name or a digest).
    pub name: String,
    /// `sha256-<hex>`.
    pub digest: String,
    pub rootfs: PathBuf,
}

/// One image as `GET /images` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ImageInfo {
    /// `sha256-<hex>`.
    pub digest: String,
    /// The names pointing at it now (sorted; may be empty).
    pub names: Vec<String>,
    /// Whether a sandbox created without `"image"` gets it.
    pub default: bool,
    /// From its `image.json`: the Debian packages it was built from, the
    /// image it extends (for templates), when it was built.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packages: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
}

/// The image directory of this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageCatalog {
    pub dir: PathBuf,
    /// The name sandboxes get without `"image"`.
    pub default: String,
}

impl ImageCatalog {
    pub fn new(dir: impl Into<PathBuf>, default: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            default: default.into(),
        }
    }

    /// The default image; an error naming the build command when it is missing.
    pub fn default_image(&self) -> Result<Image, ImageError> {
        self.resolve(&self.default)
    }

    /// The image `name` (a name or a digest) stands for on this host.
    pub fn resolve(&self, name: &str) -> Result<Image, ImageError> {
        let missing = || ImageError::Missing {
            name: name.to_owned(),
            dir: self.dir.clone(),
        };
        let digest = if is_digest(name) {
            name.to_owned()
        } else if is_image_name(name) {
            let target = std::fs::read_link(self.dir.join(name)).map_err(|_| missing())?;
            match target.file_name().and_then(|f| f.to_str()) {
                Some(digest) if is_digest(digest) => digest.to_owned(),
                _ => return Err(missing()),
            }
        } else {
            return Err(ImageError::InvalidName(name.to_owned()));
        };
        let rootfs = self.dir.join(&digest).join("rootfs");
        if !rootfs.is_dir() {
            return Err(missing());
        }
        Ok(Image {
            name: name.to_owned(),
            digest,
            rootfs,
        })
    }

    /// Every image here with its names, sorted by digest.
    pub fn list(&self) -> Result<Vec<ImageInfo>, ImageError> {
        let unreadable = |source| ImageError::Unreadable {
            dir: self.dir.clone(),
            source,
        };
        let mut digests = Vec::new();
        let mut names: Vec<(String, String)> = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(unreadable)? {
            let entry = entry.map_err(unreadable)?;
            let Some(file) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if is_digest(&file) && entry.path().join("rootfs").is_dir() {
                digests.push(file);
            } else if is_image_name(&file)
                && let Ok(target) = std::fs::read_link(entry.path())
                && let Some(digest) = target.file_name().and_then(|f| f.to_str())
            {
                names.push((file, digest.to_owned()));
            }
        }
        digests.sort();
        let default_digest = self.resolve(&self.default).ok().map(|image| image.digest);
        Ok(digests
            .into_iter()
            .map(|digest| {
                let mut image_names: Vec<String> = names
                    .iter()
                    .filter(|(_, target)| *target == digest)
                    .map(|(name, _)| name.clone())
                    .collect();
                image_names.sort();
                let recipe = read_recipe(&self.dir.join(&digest));
                ImageInfo {
                    default: default_digest.as_deref() == Some(digest.as_str()),
                    names: image_names,
                    packages: recipe.as_ref().and_then(|r| {
                        r["packages"].as_array().map(|list| {
                            list.iter()
                                .filter_map(|p| p.as_str().map(str::to_owned))
                                .collect()
                        })
                    }),
                    base: recipe
                        .as_ref()
                        .and_then(|r| r["base"].as_str().map(str::to_owned)),
                    created_at: recipe
                        .as_ref()
                        .and_then(|r| r["created_at"].as_str().map(str::to_owned)),
                    digest,
                }
            })
            .collect())
    }
}

/// An image's `image.json`, if readable.
fn read_recipe(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read(dir.join("image.json")).ok()?;
    serde_json::from_slice(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn catalog() -> (tempfile::TempDir, ImageCatalog) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join(DIGEST).join("rootfs")).expect("mkdir");
        std::fs::write(
            dir.path().join(DIGEST).join("image.json"),
            r#"{"packages": ["bash", "python3"], "base": null, "created_at": "2026-11-22T20:00:00Z"}"#,
        )
        .expect("write");
        std::os::unix::fs::symlink(DIGEST, dir.path().join("default")).expect("symlink");
        std::os::unix::fs::symlink(DIGEST, dir.path().join("py")).expect("symlink");
        let catalog = ImageCatalog::new(dir.path(), DEFAULT_IMAGE);
        (dir, catalog)
    }

    #[test]
    fn names_and_digests_resolve_to_the_digest_directory() {
        let (dir, catalog) = catalog();
        let image = catalog.resolve("py").expect("py");
        assert_eq!(image.digest, DIGEST);
        assert_eq!(image.rootfs, dir.path().join(DIGEST).join("rootfs"));
        assert_eq!(catalog.resolve(DIGEST).expect("digest").digest, DIGEST);
        assert_eq!(catalog.default_image().expect("default").digest, DIGEST);
    }

    #[test]
    fn a_missing_image_names_the_build_command_and_bad_names_are_refused() {
        let (_dir, catalog) = catalog();
        let err = catalog.resolve("python-data").expect_err("missing");
        assert!(
            err.to_string()
                .contains("scripts/build-image.sh --name python-data"),
            "{err}"
        );
        for bad in ["", "../etc", "Big", "a/b", ".hidden", &"x".repeat(64)] {
            assert!(
                matches!(catalog.resolve(bad), Err(ImageError::InvalidName(_))),
                "{bad:?}"
            );
        }
        let other = format!("sha256-{}", "f".repeat(64));
        assert!(matches!(
            catalog.resolve(&other),
            Err(ImageError::Missing { .. })
        ));
    }

    #[test]
    fn the_list_groups_names_by_digest_and_marks_the_default() {
        let (_dir, catalog) = catalog();
        let list = catalog.list().expect("list");
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].names, vec!["default".to_owned(), "py".to_owned()]);
        assert!(list[0].default);
        assert_eq!(
            list[0].packages.as_deref(),
            Some(&["bash".to_owned(), "python3".to_owned()][..])
        );
    }
}
