//! `sandboxd-bench execute-flood`: memory under a flood of output (docs/security.md).
//!
//! Starts one `sandboxd` (the binary beside `sandboxd-bench`, local store),
//! sends `concurrency` concurrent `POST /execute?format=json`, each a script
//! printing `megabytes` MB, and prints the server's peak RSS (VmHWM) before
//! and after, with what each answer held. The target: under 300 MB with 20
//! scripts of 400 MB each (before the output limit, one such script took the
//! server from 170 MB to 1.26 GB). Needs root and runsc.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use testkit::Launch;

/// What to run.
#[derive(Debug, Clone)]
pub struct FloodBench {
    pub concurrency: usize,
    pub megabytes: u64,
    pub work_dir: PathBuf,
}

/// The figures.
#[derive(Debug, Clone)]
pub struct FloodFigures {
    pub rss_before_mb: f64,
    pub peak_rss_mb: f64,
    pub seconds: f64,
    pub truncated: usize,
    pub largest_answer_bytes: usize,
}

/// VmHWM (peak resident set) of `pid`, in MB.
fn peak_rss_mb(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .context("no VmHWM")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb / 1024.0)
}

pub async fn run(bench: &FloodBench) -> anyhow::Result<FloodFigures> {
    std::fs::create_dir_all(&bench.work_dir)?;
    let binary = std::env::current_exe()?
        .parent()
        .context("the directory of sandboxd-bench")?
        .join("sandboxd");
    // Every request must be served at once: the cap on concurrent
    // `/execute` (16 by default) and admission's memory ledger (2 GiB a
    // sandbox by default) are raised to let the whole flood in.
    let concurrency = bench.concurrency.to_string();
    let server = Launch::new(binary, "flood", &bench.work_dir)
        .on_local_store()
        .with_args(&[
            "--max-concurrent-executes",
            &concurrency,
            "--sandbox-memory-mb",
            "512",
        ])
        .start()
        .await?;
    let pid = server.child.id();
    let base = format!("http://{}", server.addr);
    let http = testkit::http_client();
    // One small execution first: the server at work, not at boot.
    http.post(format!("{base}/execute?language=bash&format=json"))
        .body("echo warm")
        .send()
        .await?
        .error_for_status()?;
    let rss_before_mb = peak_rss_mb(pid)?;
    let script = format!(
        "head -c {} /dev/zero | tr '\\0' x",
        bench.megabytes.saturating_mul(1_000_000)
    );
    let started = Instant::now();
    let requests: Vec<_> = (0..bench.concurrency)
        .map(|_| {
            let http = http.clone();
            let url = format!("{base}/execute?language=bash&format=json");
            let script = script.clone();
            tokio::spawn(async move {
                let answer = http.post(url).body(script).send().await?.bytes().await?;
                let body: serde_json::Value = serde_json::from_slice(&answer)?;
                anyhow::Ok((answer.len(), body["truncated"] == true))
            })
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await?);
    }
    let seconds = started.elapsed().as_secs_f64();
    let peak_rss_mb = peak_rss_mb(pid)?;
    let mut truncated = 0;
    let mut largest_answer_bytes = 0;
    for answer in answers {
        let (size, cut) = answer?;
        truncated += usize::from(cut);
        largest_answer_bytes = largest_answer_bytes.max(size);
    }
    drop(server);
    Ok(FloodFigures {
        rss_before_mb,
        peak_rss_mb,
        seconds,
        truncated,
        largest_answer_bytes,
    })
}

pub fn render(bench: &FloodBench, figures: &FloodFigures) -> String {
    format!(
        "{} concurrent POST /execute?format=json printing {} MB each: {:.1} s; \
         server peak RSS {:.0} MB (before: {:.0} MB); {} answers truncated, largest {} bytes\n{}\n",
        bench.concurrency,
        bench.megabytes,
        figures.seconds,
        figures.peak_rss_mb,
        figures.rss_before_mb,
        figures.truncated,
        figures.largest_answer_bytes,
        serde_json::json!({
            "concurrency": bench.concurrency,
            "megabytes_each": bench.megabytes,
            "seconds": figures.seconds,
            "server_peak_rss_mb": figures.peak_rss_mb,
            "server_rss_before_mb": figures.rss_before_mb,
            "truncated": figures.truncated,
            "largest_answer_bytes": figures.largest_answer_bytes,
        })
    )
}
