//! `sandboxd-bench files`: the filesystem API as a client meets it, on one
//! `sandboxd` (the binary beside this one) on the local store: the round
//! trip of writing and reading a 4 KiB file on an attached socket, and the
//! throughput of a 100 MB upload and download (digests checked). The
//! client hashes a file before it sends it (the server checks the digest
//! announced); that part is timed on its own too.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use sandboxd::client::{CreateOptions, Sandbox};
use testkit::Launch;

use crate::series::Series;

/// What to measure.
#[derive(Debug)]
pub struct FilesBench {
    pub runs: usize,
    pub upload_mb: u64,
    pub work_dir: PathBuf,
}

/// The figures: latency series, and (MB, seconds) of the upload and download.
#[derive(Debug)]
pub struct FilesFigures {
    pub series: Vec<Series>,
    pub upload: (u64, f64),
    /// Seconds of the upload's local hashing (the same work, timed alone).
    pub local_hash: f64,
    pub download: (u64, f64),
}

/// What the client does before an upload: read the file and hash it.
fn hash_local(path: &std::path::Path) -> anyhow::Result<()> {
    use sha2::Digest as _;
    use std::io::Read as _;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    std::hint::black_box(hasher.finalize());
    Ok(())
}

pub async fn run(bench: &FilesBench) -> anyhow::Result<FilesFigures> {
    std::fs::create_dir_all(&bench.work_dir)?;
    let binary = std::env::current_exe()?
        .parent()
        .context("the directory of sandboxd-bench")?
        .join("sandboxd");
    let server = Launch::new(binary, "files", &bench.work_dir)
        .on_local_store()
        .start()
        .await?;
    let url = format!("ws://{}", server.addr);
    let sandbox = Sandbox::create(
        &url,
        CreateOptions {
            idle_timeout_s: Some(600),
            ..CreateOptions::default()
        },
    )
    .await?;
    let data = vec![b'x'; 4096];
    let mut write = Series::named("write a 4 KiB file (fs_write round trip)");
    let mut read = Series::named("read a 4 KiB file (fs_download round trip)");
    for run in 0..bench.runs + 2 {
        let started = Instant::now();
        sandbox.write_file("bench.txt", &data, None).await?;
        let wrote = started.elapsed();
        let started = Instant::now();
        let back = sandbox.read_file("bench.txt").await?;
        let took = started.elapsed();
        anyhow::ensure!(back == data, "the 4 KiB file came back different");
        if run >= 2 {
            write.samples.push(wrote);
            read.samples.push(took);
        }
    }

    let local = bench.work_dir.join("upload.bin");
    let size = bench.upload_mb << 20;
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut content = Vec::with_capacity(size as usize);
    while (content.len() as u64) < size {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        content.extend_from_slice(&state.to_le_bytes());
    }
    content.truncate(size as usize);
    std::fs::write(&local, &content)?;
    drop(content);
    let started = Instant::now();
    hash_local(&local)?;
    let local_hash = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let up = sandbox.upload_file(&local, "/tmp/upload.bin", None).await?;
    let upload = started.elapsed().as_secs_f64();
    let back = bench.work_dir.join("download.bin");
    let started = Instant::now();
    let down = sandbox.download_file("/tmp/upload.bin", &back).await?;
    let download = started.elapsed().as_secs_f64();
    anyhow::ensure!(up.sha256 == down.sha256, "the download's digest differs");
    let _ = std::fs::remove_file(&local);
    let _ = std::fs::remove_file(&back);
    sandbox.kill().await?;
    drop(server);
    Ok(FilesFigures {
        series: vec![write, read],
        upload: (bench.upload_mb, upload),
        local_hash,
        download: (bench.upload_mb, download),
    })
}

pub fn render(figures: &FilesFigures) -> String {
    let rate = |(mb, seconds): (u64, f64)| {
        format!(
            "{mb} MB in {seconds:.2} s = {:.0} MB/s",
            mb as f64 / seconds
        )
    };
    let (mb, seconds) = figures.upload;
    format!(
        "{}upload   {} (of which the client hashing the file first: {:.2} s; \
         the transfer alone: {:.0} MB/s)\ndownload {}\n",
        crate::series::render(&figures.series),
        rate(figures.upload),
        figures.local_hash,
        mb as f64 / (seconds - figures.local_hash).max(f64::EPSILON),
        rate(figures.download)
    )
}

pub fn to_json(figures: &FilesFigures) -> serde_json::Value {
    serde_json::json!({
        "latencies": crate::series::to_json(&figures.series),
        "upload": {"mb": figures.upload.0, "seconds": figures.upload.1,
                   "local_hash_seconds": figures.local_hash},
        "download": {"mb": figures.download.0, "seconds": figures.download.1},
    })
}
