//! Logging setup: human-readable text locally, JSON with Cloud Logging's
//! `severity` field in production.

use tracing_subscriber::EnvFilter;

use crate::config::{LogArgs, LogFormat};

/// Installs the global subscriber. Call once, at startup.
pub fn init(args: &LogArgs) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(&args.log_level)
        .map_err(|err| anyhow::anyhow!("invalid LOG_LEVEL {:?}: {err}", args.log_level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match args.log_format {
        LogFormat::Text => builder.try_init(),
        // Cloud Logging reads `severity`; the JSON formatter's `level` is mapped
        // by the logging agent's structured-log parser on Cloud Run.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
    };
    installed.map_err(|err| anyhow::anyhow!("cannot install the log subscriber: {err}"))
}
