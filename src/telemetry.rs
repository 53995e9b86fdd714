//! Logging setup: human-readable text locally; in production one JSON object
//! per line in Cloud Logging's structured format: `severity` (DEBUG, INFO,
//! WARNING, ERROR), `message`, `time`, the event's fields, and the fields of
//! every enclosing span, so a line logged inside a reconcile or a session
//! carries its `sandbox` id.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

use crate::config::{LogArgs, LogFormat};

/// Installs the global subscriber. Call once, at startup.
pub fn init(args: &LogArgs) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(&args.log_level)
        .map_err(|err| anyhow::anyhow!("invalid LOG_LEVEL {:?}: {err}", args.log_level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match args.log_format {
        // One event, one line: whatever a value holds (a file name user
        // code made, a client's bytes) cannot start a forged line.
        LogFormat::Text => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            builder
                .with_ansi(ansi)
                .with_writer(move || OneLine {
                    inner: std::io::stderr(),
                    keep_escape: ansi,
                })
                .try_init()
        }
        LogFormat::Json => builder
            .fmt_fields(JsonFields::new())
            .event_format(CloudLoggingJson)
            .try_init(),
    };
    installed.map_err(|err| anyhow::anyhow!("cannot install the log subscriber: {err}"))
}

/// A writer that keeps each formatted event on one line: control
/// characters inside it (a newline, a carriage return, and the escape
/// character unless colours are on) are written as `\n`, `\r`, `\x1b`;
/// only the event's final newline stays.
#[derive(Debug)]
pub struct OneLine<W> {
    pub inner: W,
    pub keep_escape: bool,
}

impl<W: std::io::Write> std::io::Write for OneLine<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let (body, end) = match buf.split_last() {
            Some((b'\n', body)) => (body, &b"\n"[..]),
            _ => (buf, &b""[..]),
        };
        let mut line = Vec::with_capacity(buf.len() + 8);
        for &byte in body {
            match byte {
                b'\n' => line.extend_from_slice(b"\\n"),
                b'\r' => line.extend_from_slice(b"\\r"),
                b'\t' => line.push(byte),
                0x1b if self.keep_escape => line.push(byte),
                0..=0x1f | 0x7f => line.extend_from_slice(format!("\\x{byte:02x}").as_bytes()),
                _ => line.push(byte),
            }
        }
        line.extend_from_slice(end);
        self.inner.write_all(&line)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Cloud Logging's severity names.
pub fn severity(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARNING",
        Level::INFO => "INFO",
        Level::DEBUG | Level::TRACE => "DEBUG",
    }
}

/// One JSON object per event, with `severity` and the spans' fields.
#[derive(Debug, Clone, Copy)]
pub struct CloudLoggingJson;

struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), Value::from(format!("{value:?}")));
    }
}

impl<S, N> FormatEvent<S, N> for CloudLoggingJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        let mut line = Map::new();
        line.insert("severity".into(), severity(metadata.level()).into());
        #[allow(
            clippy::disallowed_methods,
            reason = "a log line's timestamp is the host's time, which the log's readers line up with other hosts' logs"
        )]
        let time = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        line.insert("time".into(), time.into());
        line.insert("target".into(), metadata.target().into());
        // Span fields first (outermost to innermost), then the event's own.
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>()
                    && let Ok(Value::Object(fields)) =
                        serde_json::from_str::<Value>(fields.as_str())
                {
                    line.extend(fields);
                }
            }
        }
        event.record(&mut Fields(&mut line));
        writeln!(writer, "{}", Value::Object(line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_text_log_event_stays_on_one_line_whatever_its_values_hold() {
        use std::io::Write as _;
        let mut out = OneLine {
            inner: Vec::new(),
            keep_escape: false,
        };
        out.write_all(b"INFO fs path=/x\nERROR forged\r\x1b[31m\ttab\n")
            .unwrap();
        assert_eq!(
            String::from_utf8(out.inner).unwrap(),
            "INFO fs path=/x\\nERROR forged\\r\\x1b[31m\ttab\n"
        );
    }

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_are_json_with_severity_and_the_spans_sandbox_id() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(JsonFields::new())
            .event_format(CloudLoggingJson)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("reconcile", sandbox = "0123abcd");
            let _entered = span.enter();
            tracing::warn!(attempt = 2, "lease renewal failed");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let line: Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["severity"], "WARNING");
        assert_eq!(line["message"], "lease renewal failed");
        assert_eq!(line["sandbox"], "0123abcd");
        assert_eq!(line["attempt"], 2);
    }
}
