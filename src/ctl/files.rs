//! `sandboxctl cp | ls | cat`: a sandbox's files through the client's
//! filesystem API.
//!
//! `cp` has `kubectl cp`'s shape: one side is `ID:PATH`, the other a local
//! path. A file copied onto an existing directory lands inside it under its
//! own name; a directory is copied as the destination (created if missing,
//! merged into if it exists), recursively. Permission bits go with every
//! file and directory (directories are created with theirs, under the
//! sandbox's umask, 022); symlinks and special files are skipped with a
//! note on stderr.

use std::path::{Path, PathBuf};

use crate::client::{AttachOptions, ClientError, FileKind, Sandbox};

/// One side of `cp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpSide {
    Local(PathBuf),
    Remote { id: String, path: String },
}

impl CpSide {
    /// `ID:PATH` (an id is 32 hex digits) is the sandbox's; anything else is local.
    pub fn parse(text: &str) -> Self {
        if let Some((id, path)) = text.split_once(':')
            && id.len() == 32
            && id.bytes().all(|b| b.is_ascii_hexdigit())
            && !path.is_empty()
        {
            return Self::Remote {
                id: id.to_owned(),
                path: path.to_owned(),
            };
        }
        Self::Local(PathBuf::from(text))
    }
}

/// A file verb, parsed.
#[derive(Debug, Clone)]
pub enum FilesCommand {
    Cp {
        url: String,
        token: String,
        from: CpSide,
        to: CpSide,
    },
    Ls {
        url: String,
        id: String,
        token: String,
        path: String,
        depth: u32,
    },
    Cat {
        url: String,
        id: String,
        token: String,
        path: String,
    },
}

fn invalid(message: impl Into<String>) -> ClientError {
    ClientError::Invalid(message.into())
}

fn local_error(path: &Path, err: std::io::Error) -> ClientError {
    invalid(format!("{}: {err}", path.display()))
}

async fn connect(url: &str, id: &str, token: &str) -> Result<Sandbox, ClientError> {
    Sandbox::attach(url, id, token, AttachOptions::default()).await
}

/// Runs the verb; what it prints goes to stdout. The connection is closed
/// with the handshake before it returns, so the next command finds the
/// sandbox free.
pub async fn run_files_command(command: FilesCommand) -> Result<u8, ClientError> {
    let (url, id, token, verb) = match command {
        FilesCommand::Cat {
            url,
            id,
            token,
            path,
        } => (url, id, token, Verb::Cat { path }),
        FilesCommand::Ls {
            url,
            id,
            token,
            path,
            depth,
        } => (url, id, token, Verb::Ls { path, depth }),
        FilesCommand::Cp {
            url,
            token,
            from,
            to,
        } => match (from, to) {
            (CpSide::Local(local), CpSide::Remote { id, path }) => {
                (url, id, token, Verb::Up { local, path })
            }
            (CpSide::Remote { id, path }, CpSide::Local(local)) => {
                (url, id, token, Verb::Down { path, local })
            }
            _ => {
                return Err(invalid(
                    "cp copies between this machine and a sandbox: one side must be ID:PATH, the other a local path",
                ));
            }
        },
    };
    let sandbox = connect(&url, &id, &token).await?;
    let result = match &verb {
        Verb::Cat { path } => cat(&sandbox, path).await,
        Verb::Ls { path, depth } => ls(&sandbox, path, *depth).await,
        Verb::Up { local, path } => upload(&sandbox, local, path).await,
        Verb::Down { path, local } => download(&sandbox, path, local).await,
    };
    sandbox.close().await;
    result.map(|()| 0)
}

/// What one command does on the sandbox it attached to.
enum Verb {
    Cat { path: String },
    Ls { path: String, depth: u32 },
    Up { local: PathBuf, path: String },
    Down { path: String, local: PathBuf },
}

/// `cat ID PATH`.
async fn cat(sandbox: &Sandbox, path: &str) -> Result<(), ClientError> {
    let data = sandbox.read_file(path).await?;
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&data)
        .and_then(|()| stdout.flush())
        .map_err(|err| invalid(format!("writing stdout: {err}")))
}

/// `ls ID PATH`.
async fn ls(sandbox: &Sandbox, path: &str, depth: u32) -> Result<(), ClientError> {
    let entry = sandbox.stat(path).await?;
    let entries = if entry.kind == FileKind::Directory {
        let listing = sandbox.list(path, depth).await?;
        if listing.truncated {
            eprintln!("(the listing was cut short: too many entries)");
        }
        listing.entries
    } else {
        vec![entry]
    };
    for entry in entries {
        let kind = match entry.kind {
            FileKind::Directory => 'd',
            FileKind::Symlink => 'l',
            FileKind::File => '-',
            FileKind::Other => '?',
        };
        let target = entry
            .target
            .map(|target| format!(" -> {target}"))
            .unwrap_or_default();
        println!(
            "{kind}{:04o} {:>12} {}{target}",
            entry.mode, entry.size, entry.name
        );
    }
    Ok(())
}

fn join_remote(base: &str, name: &str) -> String {
    format!("{}/{name}", base.trim_end_matches('/'))
}

fn base_name(path: &str) -> &str {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(path)
}

/// `cp LOCAL ID:PATH`.
pub async fn upload(sandbox: &Sandbox, local: &Path, remote: &str) -> Result<(), ClientError> {
    let metadata = tokio::fs::metadata(local)
        .await
        .map_err(|err| local_error(local, err))?;
    let remote_is_dir =
        matches!(sandbox.stat(remote).await, Ok(entry) if entry.kind == FileKind::Directory);
    if metadata.is_file() {
        let target = if remote_is_dir {
            let name = local
                .file_name()
                .map(|name| name.to_string_lossy().into_owned())
                .ok_or_else(|| invalid(format!("{} has no file name", local.display())))?;
            join_remote(remote, &name)
        } else {
            remote.to_owned()
        };
        sandbox.upload_file(local, &target, None).await?;
        return Ok(());
    }
    if !metadata.is_dir() {
        return Err(invalid(format!(
            "{} is neither a file nor a directory",
            local.display()
        )));
    }
    // Directories first (parents before children), files after.
    let mut stack = vec![(local.to_path_buf(), remote.to_owned())];
    while let Some((dir, target)) = stack.pop() {
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &tokio::fs::metadata(&dir)
                .await
                .map_err(|err| local_error(&dir, err))?
                .permissions(),
        ) & 0o7777;
        sandbox.mkdir_with_mode(&target, true, Some(mode)).await?;
        let mut entries = tokio::fs::read_dir(&dir)
            .await
            .map_err(|err| local_error(&dir, err))?;
        while let Some(entry) = entries
            .next_entry()
            .await
            .map_err(|err| local_error(&dir, err))?
        {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let kind = entry
                .file_type()
                .await
                .map_err(|err| local_error(&path, err))?;
            let child = join_remote(&target, &name);
            if kind.is_dir() {
                stack.push((path, child));
            } else if kind.is_file() {
                sandbox.upload_file(&path, &child, None).await?;
            } else {
                eprintln!("skipped {} (not a file or directory)", path.display());
            }
        }
    }
    Ok(())
}

/// `cp ID:PATH LOCAL`.
pub async fn download(sandbox: &Sandbox, remote: &str, local: &Path) -> Result<(), ClientError> {
    let entry = sandbox.stat(remote).await?;
    match entry.kind {
        FileKind::File => {
            let target = if local.is_dir() {
                local.join(base_name(remote))
            } else {
                local.to_path_buf()
            };
            sandbox.download_file(remote, &target).await?;
            Ok(())
        }
        FileKind::Directory => {
            let listing = sandbox.list(remote, 64).await?;
            if listing.truncated {
                return Err(invalid(format!(
                    "{remote} holds more entries than one listing returns; copy its subdirectories one by one"
                )));
            }
            make_dir(local).await?;
            let mut directories = vec![(local.to_path_buf(), entry.mode)];
            for child in &listing.entries {
                let target = local.join(&child.name);
                match child.kind {
                    FileKind::Directory => {
                        make_dir(&target).await?;
                        directories.push((target, child.mode));
                    }
                    FileKind::File => {
                        sandbox
                            .download_file(&join_remote(remote, &child.name), &target)
                            .await?;
                    }
                    FileKind::Symlink | FileKind::Other => {
                        eprintln!("skipped {} (not a file or directory)", child.name);
                    }
                }
            }
            // Modes last, deepest first: a read-only directory is filled first.
            for (dir, mode) in directories.iter().rev() {
                use std::os::unix::fs::PermissionsExt as _;
                tokio::fs::set_permissions(dir, std::fs::Permissions::from_mode(*mode))
                    .await
                    .map_err(|err| local_error(dir, err))?;
            }
            Ok(())
        }
        FileKind::Symlink | FileKind::Other => {
            Err(invalid(format!("{remote} is not a file or a directory")))
        }
    }
}

async fn make_dir(path: &Path) -> Result<(), ClientError> {
    tokio::fs::create_dir_all(path)
        .await
        .map_err(|err| local_error(path, err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_sides_are_an_id_a_colon_and_a_path() {
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            CpSide::parse(&format!("{id}:/tmp/x")),
            CpSide::Remote {
                id: id.into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(CpSide::parse("./a:b"), CpSide::Local("./a:b".into()));
        assert_eq!(
            CpSide::parse(&format!("{id}:")),
            CpSide::Local(format!("{id}:").into())
        );
    }
}
