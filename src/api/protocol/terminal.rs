//! The size of an execution's terminal as clients send it (`pty` of an
//! execution, the `resize` action).

use controllers::runtime::TerminalSize;
use serde_json::Value;

use super::FrameError;

/// `{"cols": N, "rows": N}`, each 1 to 1000.
pub(super) fn terminal_size(value: &Value) -> Result<TerminalSize, FrameError> {
    let wrong = FrameError::WrongType {
        field: "pty",
        expected: "an object {\"cols\": N, \"rows\": N}, each 1 to 1000",
    };
    let get = |name: &str| {
        value
            .get(name)
            .and_then(Value::as_u64)
            .filter(|n| (1..=1000).contains(n))
            .and_then(|n| u16::try_from(n).ok())
    };
    match (get("cols"), get("rows")) {
        (Some(cols), Some(rows)) => Ok(TerminalSize { cols, rows }),
        _ => Err(wrong),
    }
}
