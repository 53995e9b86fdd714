//! Lines from the sandbox agent, each at most [`MAX_AGENT_LINE_BYTES`], and
//! the raw bytes a line may announce (protocol version 2), at most
//! [`MAX_AGENT_PAYLOAD_BYTES`].
//!
//! The agent runs inside the sandbox, as the uid user code runs as. It makes
//! itself undumpable, so user code cannot open its host pipe
//! (`/proc/1/fd/1`: EACCES on runsc), but the host does not rely on that:
//! an agent user code subverted, or one with a bug, writes what it likes,
//! so its lines are untrusted input. `BufReader::lines` would keep
//! growing one `String` for a line that never ends; this reader keeps at most
//! the limit and skips the rest of a longer line (up to its newline), so the
//! host's memory per sandbox stays bounded whatever the sandbox writes. Raw
//! bytes announced beyond their limit are read and dropped, never kept.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// Most raw bytes one agent message may carry: a file read answers at most
/// `controllers::files::MAX_READ_BYTES` (4 MiB).
pub const MAX_AGENT_PAYLOAD_BYTES: usize = 8 << 20;

/// Longest agent line read: the largest legitimate one is a workspace scan's
/// reply (up to `--workspace-max-files` entries), far above an output or
/// archive chunk's (64 KiB of data, base64-encoded).
pub const MAX_AGENT_LINE_BYTES: usize = 64 << 20;

/// Most JSON values (and keys) one agent line may hold. Parsing a line
/// costs the host far more than its bytes when they are many small values:
/// a 64 MiB line of `0,` held 2.1 GB while it was parsed as an event (one
/// tree of serde's buffered content, then one of `serde_json::Value`, some
/// 66 bytes a value). At this bound a line cost at most 230 MB (measured:
/// 130 MB for `0,`, 190 MB for an object of empty arrays, 230 MB for
/// `[[]],`); a workspace scan's reply holds about 9 a file (so up to some
/// 220,000 files, about 900,000 values at the default limit of 100,000).
pub const MAX_AGENT_LINE_VALUES: usize = 2_000_000;

/// An upper bound on how many values and keys the JSON `line` holds: its
/// `[`, `{`, `,` and `:` outside strings (each value or key follows one,
/// but for the outermost). One pass, nothing allocated.
pub fn json_values(line: &str) -> usize {
    let (mut count, mut in_string, mut escaped) = (0_usize, false, false);
    for byte in line.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match byte {
                b'"' => in_string = true,
                b'[' | b'{' | b',' | b':' => count += 1,
                _ => {}
            }
        }
    }
    count
}

/// The `id` a line names, read without building the rest of it (unknown
/// fields are skipped, not kept): what a line that cannot be parsed
/// answered, if anything.
pub fn named_id(line: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Named {
        #[serde(default)]
        id: Option<String>,
    }
    serde_json::from_str::<Named>(line).ok()?.id
}

/// One read of [`next_line`].
#[derive(Debug, PartialEq, Eq)]
pub enum AgentLine {
    /// A whole line (without its newline).
    Line(String),
    /// A line longer than the limit, skipped: how many bytes it had (at
    /// least; counted up to its newline or the end of the stream).
    TooLong(usize),
    /// Not UTF-8: skipped, its length.
    NotUtf8(usize),
    /// The stream ended.
    End,
}

/// Reads the next line of at most `limit` bytes from `reader`.
pub async fn next_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<AgentLine> {
    line.clear();
    let mut skipped: usize = 0;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (skipped, line.is_empty()) {
                (0, true) => AgentLine::End,
                (0, false) => whole(std::mem::take(line)),
                (n, _) => AgentLine::TooLong(n),
            });
        }
        let (taken, ended) = match available.iter().position(|&b| b == b'\n') {
            Some(newline) => (newline, true),
            None => (available.len(), false),
        };
        if skipped == 0 && line.len().saturating_add(taken) <= limit {
            line.extend_from_slice(&available[..taken]);
        } else {
            // Over the limit: drop what was kept and count the rest.
            skipped = skipped
                .saturating_add(std::mem::take(line).len())
                .saturating_add(taken);
        }
        let consumed = if ended {
            taken.saturating_add(1)
        } else {
            taken
        };
        reader.consume(consumed);
        if ended {
            return Ok(if skipped > 0 {
                AgentLine::TooLong(skipped)
            } else {
                whole(std::mem::take(line))
            });
        }
    }
}

/// How many raw bytes follow `line`: its object's top-level `bytes`, if it
/// has one (only messages that carry raw bytes do; parsed only when the
/// line names it at all, so other lines cost a substring search).
pub fn payload_length(line: &str) -> Option<u64> {
    #[derive(Deserialize)]
    struct Framing {
        #[serde(default)]
        bytes: Option<u64>,
    }
    if !line.contains("\"bytes\"") {
        return None;
    }
    serde_json::from_str::<Framing>(line).ok()?.bytes
}

/// The raw bytes after a line.
#[derive(Debug, PartialEq, Eq)]
pub enum Payload {
    Bytes(Bytes),
    /// More than the limit were announced: they were read and dropped.
    TooLong(u64),
}

/// Reads the `length` raw bytes that follow a line; more than `limit` are
/// skipped unkept. The stream ending before them is an error.
pub async fn read_payload<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    length: u64,
    limit: usize,
) -> std::io::Result<Payload> {
    match usize::try_from(length) {
        Ok(wanted) if wanted <= limit => {
            let mut data = BytesMut::zeroed(wanted);
            reader.read_exact(&mut data).await?;
            Ok(Payload::Bytes(data.freeze()))
        }
        _ => {
            let mut remaining = length;
            while remaining > 0 {
                let available = reader.fill_buf().await?.len();
                if available == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                let taken = usize::try_from(remaining).map_or(available, |r| r.min(available));
                reader.consume(taken);
                remaining -= taken as u64;
            }
            Ok(Payload::TooLong(length))
        }
    }
}

fn whole(bytes: Vec<u8>) -> AgentLine {
    match String::from_utf8(bytes) {
        Ok(text) => AgentLine::Line(text),
        Err(err) => AgentLine::NotUtf8(err.into_bytes().len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_counted_outside_strings_only() {
        assert_eq!(json_values(r#"{"ev":"out","id":"e1"}"#), 4);
        assert_eq!(json_values("[0,0,0]"), 3);
        // Brackets, commas and colons inside strings, escaped quotes too.
        assert_eq!(json_values(r#"{"a":"[,:{\"}]"}"#), 2);
        let flood = format!(
            "{{\"ev\":\"done\",\"id\":\"r1\",\"a\":[{}0]}}",
            "0,".repeat(10)
        );
        assert_eq!(json_values(&flood), 7 + 10);
        assert_eq!(named_id(&flood).as_deref(), Some("r1"));
        assert_eq!(named_id(r#"{"id":7}"#), None);
    }

    async fn read_all(input: &[u8], limit: usize) -> Vec<AgentLine> {
        let mut reader = tokio::io::BufReader::with_capacity(7, input);
        let mut line = Vec::new();
        let mut out = Vec::new();
        loop {
            match next_line(&mut reader, &mut line, limit).await.unwrap() {
                AgentLine::End => return out,
                other => out.push(other),
            }
        }
    }

    #[tokio::test]
    async fn lines_within_the_limit_are_read_and_longer_ones_skipped_whole() {
        let input = b"{\"a\":1}\n0123456789abcdef0123\nshort\n\xff\nlast";
        assert_eq!(
            read_all(input, 10).await,
            vec![
                AgentLine::Line("{\"a\":1}".into()),
                AgentLine::TooLong(20),
                AgentLine::Line("short".into()),
                AgentLine::NotUtf8(1),
                AgentLine::Line("last".into()),
            ]
        );
    }

    async fn whole_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> String {
        let mut line = Vec::new();
        match next_line(reader, &mut line, 1000).await.unwrap() {
            AgentLine::Line(line) => line,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn raw_bytes_after_a_line_are_read_and_too_many_skipped_unkept() {
        let mut input = b"{\"ev\":\"done\",\"id\":\"r1\",\"bytes\":5}\nab\ncd".to_vec();
        input.extend_from_slice(b"{\"ev\":\"done\",\"id\":\"r2\",\"bytes\":20}\n");
        input.extend_from_slice(&[b'z'; 20]);
        input.extend_from_slice(b"{\"ev\":\"pong\",\"version\":2}\n");
        let mut reader = tokio::io::BufReader::with_capacity(7, &input[..]);
        assert_eq!(payload_length(&whole_line(&mut reader).await), Some(5));
        assert_eq!(
            read_payload(&mut reader, 5, 10).await.unwrap(),
            Payload::Bytes(Bytes::from_static(b"ab\ncd"))
        );
        assert_eq!(payload_length(&whole_line(&mut reader).await), Some(20));
        assert_eq!(
            read_payload(&mut reader, 20, 10).await.unwrap(),
            Payload::TooLong(20)
        );
        assert_eq!(payload_length(&whole_line(&mut reader).await), None);
        assert_eq!(
            payload_length(r#"{"ev":"out","data":"\"bytes\":3"}"#),
            None,
            "a string that names bytes is not the count"
        );
        let err = read_payload(&mut reader, 1, 10).await.expect_err("the end");
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// An endless line (no newline, ever) costs the limit, not
    /// its length: the reader never holds more than `limit` bytes of it.
    #[tokio::test]
    async fn an_endless_line_is_not_kept() {
        let endless = vec![b'x'; 1 << 20];
        let mut reader = tokio::io::BufReader::with_capacity(4096, &endless[..]);
        let mut line = Vec::new();
        let read = next_line(&mut reader, &mut line, 1000).await.unwrap();
        assert_eq!(read, AgentLine::TooLong(1 << 20));
        assert!(line.capacity() <= 1000 + 4096, "{}", line.capacity());
    }
}
