"""Exceptions: one per server status, each carrying the server's message.

The names of the official Cloud Run sandbox client (`SandboxConnectionError`,
`SandboxCreationError`, `SandboxStateError`, `SandboxCheckpointError`,
`SandboxFilesystemSnapshotError`, `SandboxExecutionError`) are kept, and the
finer classes derive from them, so code catching the official names keeps
working.
"""

from __future__ import annotations

from typing import Optional


class SandboxError(Exception):
    """Base of every error of this package.

    `status` is the server's status string when the server reported it
    (`SANDBOX_RESTORE_ERROR`, ...), `message` its message (or the status).
    """

    status: Optional[str]
    message: str

    def __init__(self, message: str, status: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class SandboxConnectionError(SandboxError):
    """The WebSocket could not be opened, or closed under a call."""


class SandboxStateError(SandboxError, RuntimeError):
    """The call does not fit the sandbox's state (closed, checkpointed, ...)."""


class SandboxCreationError(SandboxError):
    """`SANDBOX_CREATION_ERROR`: the server could not create the sandbox."""


class SandboxNotFoundError(SandboxCreationError):
    """`SANDBOX_NOT_FOUND`: no such sandbox (or it was deleted)."""


class SandboxInUseError(SandboxCreationError):
    """`SANDBOX_IN_USE`: another client is attached."""


class SandboxPermissionError(SandboxCreationError):
    """`SANDBOX_PERMISSION_DENIAL_ERROR`: a missing or wrong sandbox token."""


class SandboxRestoreError(SandboxCreationError):
    """`SANDBOX_RESTORE_ERROR`: the checkpoint could not be restored."""


class SandboxServerError(SandboxError):
    """`SANDBOX_ERROR`: an unexpected failure on the server."""


class SandboxCheckpointError(SandboxError):
    """`SANDBOX_CHECKPOINT_ERROR`: the checkpoint failed."""


class SandboxExecutionInProgressError(SandboxCheckpointError):
    """`SANDBOX_EXECUTION_IN_PROGRESS_ERROR`: a checkpoint while code runs."""


class SandboxFilesystemSnapshotError(SandboxError):
    """`SANDBOX_FILESYSTEM_SNAPSHOT_ERROR`."""


class SandboxExecutionError(SandboxError):
    """`SANDBOX_EXECUTION_ERROR`: the execution was refused or failed."""


class SandboxUnsupportedLanguageError(SandboxExecutionError):
    """`SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR`."""


class SandboxStdinError(SandboxExecutionError):
    """`SANDBOX_STDIN_ERROR`: a malformed stdin frame."""


class SandboxKillError(SandboxError):
    """`SANDBOX_KILL_ERROR` (the sandbox) or `SANDBOX_EXECUTION_FORCE_KILL_ERROR`."""


class SandboxLockError(SandboxError):
    """`SANDBOX_LOCK_RENEWAL_ERROR`: the sandbox's hold was lost."""


class SandboxDeletedError(SandboxError):
    """`SANDBOX_DELETED` without the client asking (idle timeout)."""


class SandboxProtocolError(SandboxError):
    """An `error` event without a status, or a frame this client cannot read."""


class SandboxTimeoutError(SandboxError, TimeoutError):
    """A call's deadline passed."""


#: Each error status and its exception class.
STATUS_ERRORS: dict[str, type[SandboxError]] = {
    "SANDBOX_CREATION_ERROR": SandboxCreationError,
    "SANDBOX_NOT_FOUND": SandboxNotFoundError,
    "SANDBOX_IN_USE": SandboxInUseError,
    "SANDBOX_PERMISSION_DENIAL_ERROR": SandboxPermissionError,
    "SANDBOX_RESTORE_ERROR": SandboxRestoreError,
    "SANDBOX_ERROR": SandboxServerError,
    "SANDBOX_CHECKPOINT_ERROR": SandboxCheckpointError,
    "SANDBOX_EXECUTION_IN_PROGRESS_ERROR": SandboxExecutionInProgressError,
    "SANDBOX_FILESYSTEM_SNAPSHOT_ERROR": SandboxFilesystemSnapshotError,
    "SANDBOX_EXECUTION_ERROR": SandboxExecutionError,
    "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR": SandboxUnsupportedLanguageError,
    "SANDBOX_STDIN_ERROR": SandboxStdinError,
    "SANDBOX_KILL_ERROR": SandboxKillError,
    "SANDBOX_EXECUTION_FORCE_KILL_ERROR": SandboxKillError,
    "SANDBOX_LOCK_RENEWAL_ERROR": SandboxLockError,
    "SANDBOX_DELETED": SandboxDeletedError,
}


def error_for(status: str, message: Optional[str]) -> SandboxError:
    """The exception for an error status, with the server's message."""
    cls = STATUS_ERRORS.get(status, SandboxError)
    return cls(message or status, status)


class SandboxFileError(SandboxError, OSError):
    """A filesystem call the sandbox refused: `code` is the POSIX errno name
    (`ENOENT`, `EACCES`, ...) as the sandbox's kernel gave it, `path` the path."""

    code: str
    path: Optional[str]

    def __init__(self, code: str, message: str, path: Optional[str] = None) -> None:
        SandboxError.__init__(self, f"{code}: {message}")
        self.code = code
        self.path = path
        self.filename = path

    def __str__(self) -> str:
        return self.message


class SandboxFileNotFoundError(SandboxFileError, FileNotFoundError):
    """`ENOENT`."""


class SandboxFileExistsError(SandboxFileError, FileExistsError):
    """`EEXIST`."""


class SandboxFilePermissionError(SandboxFileError, PermissionError):
    """`EACCES` / `EPERM`."""


class SandboxIsADirectoryError(SandboxFileError, IsADirectoryError):
    """`EISDIR`."""


class SandboxNotADirectoryError(SandboxFileError, NotADirectoryError):
    """`ENOTDIR`."""


class SandboxDirectoryNotEmptyError(SandboxFileError):
    """`ENOTEMPTY`."""


class SandboxFileChangedError(SandboxFileError):
    """`ESTALE`: the file changed during a download."""


class SandboxDigestError(SandboxFileError):
    """The bytes of a transfer do not hash to the digest announced."""


FILE_ERRORS: dict[str, type[SandboxFileError]] = {
    "ENOENT": SandboxFileNotFoundError,
    "EEXIST": SandboxFileExistsError,
    "EACCES": SandboxFilePermissionError,
    "EPERM": SandboxFilePermissionError,
    "EISDIR": SandboxIsADirectoryError,
    "ENOTDIR": SandboxNotADirectoryError,
    "ENOTEMPTY": SandboxDirectoryNotEmptyError,
    "ESTALE": SandboxFileChangedError,
}


def file_error(code: str, message: str, path: Optional[str] = None) -> SandboxFileError:
    """The exception for a filesystem error code."""
    return FILE_ERRORS.get(code, SandboxFileError)(code, message, path)
