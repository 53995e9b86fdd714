//! The client's errors: one variant per failure a caller may want to handle,
//! each with the server's own message when it sent one.

/// What went wrong talking to a sandbox server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {url}: {detail}")]
    Connect { url: String, detail: String },
    #[error("the sandbox does not exist")]
    NotFound,
    #[error("another client is attached to the sandbox")]
    InUse,
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("the sandbox could not be created: {0}")]
    Creation(String),
    #[error("the sandbox could not be restored: {0}")]
    Restore(String),
    #[error("the checkpoint failed: {0}")]
    Checkpoint(String),
    #[error("an execution is in progress: {0}")]
    ExecutionInProgress(String),
    #[error("the filesystem snapshot failed: {0}")]
    Snapshot(String),
    #[error("the execution failed: {0}")]
    Execution(String),
    #[error("the sandbox could not be killed: {0}")]
    Kill(String),
    /// Any other error status (`SANDBOX_ERROR`, lock renewal, ...).
    #[error("{status}: {message}")]
    Server { status: String, message: String },
    #[error("the connection closed ({0})")]
    Closed(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A filesystem call refused: `code` is the POSIX error's name (`ENOENT`).
    #[error("{code}: {message}")]
    Fs { code: String, message: String },
}

/// What stands in for a redacted query value.
pub const REDACTED: &str = "REDACTED";

/// `url` with every query parameter's value replaced by [`REDACTED`]: a
/// URL in an error, a log line or a tool result never carries the sandbox
/// token (`/attach/{id}?sandbox_token=...`) or anything else secret.
pub fn redact_url(url: &str) -> String {
    let (without_fragment, fragment) = match url.split_once('#') {
        Some((head, _)) => (head, "#"),
        None => (url, ""),
    };
    let Some((base, query)) = without_fragment.split_once('?') else {
        return url.to_owned();
    };
    let redacted: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) => format!("{key}={REDACTED}"),
            None => pair.to_owned(),
        })
        .collect();
    format!("{base}?{}{fragment}", redacted.join("&"))
}

/// `text` with every query value of `url` that appears in it replaced by
/// [`REDACTED`] (an error's detail that quotes the URL or a part of it).
pub fn redact_values_of(url: &str, text: &str) -> String {
    let Some((_, query)) = url.split('#').next().unwrap_or(url).split_once('?') else {
        return text.to_owned();
    };
    let mut text = text.to_owned();
    for value in query
        .split('&')
        .filter_map(|pair| pair.split_once('=').map(|(_, v)| v))
    {
        if !value.is_empty() {
            text = text.replace(value, REDACTED);
        }
    }
    text
}

impl ClientError {
    /// A connection to `url` failed: the error names the URL without its
    /// query values, and `detail` loses them too.
    pub fn connect(url: &str, detail: &str) -> Self {
        Self::Connect {
            url: redact_url(url),
            detail: redact_values_of(url, detail),
        }
    }

    /// The typed error for an error status, with the server's message (or
    /// the status itself when it sent none).
    pub fn from_status(status: &str, message: Option<&str>) -> Self {
        let message = message.unwrap_or(status).to_owned();
        match status {
            "SANDBOX_NOT_FOUND" => Self::NotFound,
            "SANDBOX_IN_USE" => Self::InUse,
            "SANDBOX_PERMISSION_DENIAL_ERROR" => Self::PermissionDenied(message),
            "SANDBOX_CREATION_ERROR" => Self::Creation(message),
            "SANDBOX_RESTORE_ERROR" => Self::Restore(message),
            "SANDBOX_CHECKPOINT_ERROR" => Self::Checkpoint(message),
            "SANDBOX_EXECUTION_IN_PROGRESS_ERROR" => Self::ExecutionInProgress(message),
            "SANDBOX_FILESYSTEM_SNAPSHOT_ERROR" => Self::Snapshot(message),
            "SANDBOX_KILL_ERROR" => Self::Kill(message),
            "SANDBOX_EXECUTION_ERROR"
            | "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR"
            | "SANDBOX_EXECUTION_FORCE_KILL_ERROR"
            | "SANDBOX_STDIN_ERROR" => Self::Execution(message),
            _ => Self::Server {
                status: status.to_owned(),
                message,
            },
        }
    }

    /// Errors after which reconnecting cannot help (the upstream clients'
    /// "fatal" list).
    pub fn is_fatal(status: &str) -> bool {
        matches!(
            status,
            "SANDBOX_ERROR"
                | "SANDBOX_NOT_FOUND"
                | "SANDBOX_CREATION_ERROR"
                | "SANDBOX_CHECKPOINT_ERROR"
                | "SANDBOX_RESTORE_ERROR"
                | "SANDBOX_DELETED"
                | "SANDBOX_LOCK_RENEWAL_ERROR"
                | "SANDBOX_PERMISSION_DENIAL_ERROR"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_errors_never_carry_query_values() {
        let token = "s3cr3t-token_AbC";
        let url = format!("ws://host:8080/attach/sb-1?sandbox_token={token}&checkpoint=named");
        let err = ClientError::connect(&url, &format!("refused: {url}"));
        let text = err.to_string();
        assert!(!text.contains(token), "{text}");
        assert!(!text.contains("named"), "{text}");
        assert!(
            text.starts_with(
                "cannot connect to ws://host:8080/attach/sb-1?sandbox_token=REDACTED&checkpoint=REDACTED:"
            ),
            "{text}"
        );
        assert_eq!(redact_url("ws://host/create"), "ws://host/create");
        assert_eq!(redact_url("ws://h/a?flag#frag"), "ws://h/a?flag#");
    }

    #[test]
    fn statuses_map_to_typed_errors_with_the_servers_message() {
        assert_eq!(
            ClientError::from_status(
                "SANDBOX_PERMISSION_DENIAL_ERROR",
                Some("Invalid sandbox token.")
            ),
            ClientError::PermissionDenied("Invalid sandbox token.".into())
        );
        assert_eq!(
            ClientError::from_status("SANDBOX_NOT_FOUND", None),
            ClientError::NotFound
        );
        assert_eq!(
            ClientError::from_status("SANDBOX_RESTORE_ERROR", None),
            ClientError::Restore("SANDBOX_RESTORE_ERROR".into())
        );
        assert!(matches!(
            ClientError::from_status("SANDBOX_SOMETHING_NEW", Some("x")),
            ClientError::Server { .. }
        ));
    }
}
