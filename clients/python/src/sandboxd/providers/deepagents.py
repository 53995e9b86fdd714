"""sandboxd as a LangChain Deep Agents sandbox backend (`pip install
'sandboxd[deepagents]'`), as `langchain-daytona` is for Daytona:

    from deepagents import create_deep_agent
    from sandboxd.providers.deepagents import SandboxdSandbox

    backend = SandboxdSandbox.create("ws://127.0.0.1:8080")
    agent = create_deep_agent(model=..., backend=backend)
    ...
    backend.kill()

`execute` runs a shell command (stdout and stderr merged, as Deep Agents
expects, with the exit code); `upload_files` and `download_files` use the
filesystem API (no shell involved); every other file tool of Deep Agents
(`ls`, `read`, `write`, `edit`, `grep`, `glob`) comes from `BaseSandbox` on
top of them. Deep Agents calls backends synchronously: this backend drives
the blocking facade (`sandboxd.sync`).
"""

from __future__ import annotations

from typing import Any, Optional

from deepagents.backends.protocol import (
    ExecuteResponse,
    FileDownloadResponse,
    FileOperationError,
    FileUploadResponse,
)
from deepagents.backends.sandbox import BaseSandbox

from ..errors import (
    SandboxError,
    SandboxFileError,
    SandboxTimeoutError,
)
from ..sync import Sandbox as SyncSandbox

#: Deep Agents' default command timeout (seconds).
DEFAULT_TIMEOUT_S = 30 * 60

_FILE_ERRORS: dict[str, FileOperationError] = {
    "ENOENT": "file_not_found",
    "EACCES": "permission_denied",
    "EPERM": "permission_denied",
    "EISDIR": "is_directory",
    "ENOTDIR": "invalid_path",
    "EINVAL": "invalid_path",
}


def _file_error(err: SandboxFileError) -> FileOperationError:
    return _FILE_ERRORS.get(err.code, "invalid_path")


class SandboxdSandbox(BaseSandbox):
    """A Deep Agents backend on one sandboxd sandbox."""

    def __init__(self, *, sandbox: SyncSandbox, timeout: int = DEFAULT_TIMEOUT_S) -> None:
        """Wraps an existing sandbox (`sandboxd.sync.Sandbox`); `timeout` is
        the default for `execute` without one."""
        if not isinstance(sandbox, SyncSandbox):
            raise TypeError("sandbox must be a sandboxd.sync.Sandbox (use SandboxdSandbox.create or .attach)")
        self._sandbox = sandbox
        self._default_timeout = timeout

    @classmethod
    def create(cls, url: str, *, timeout: int = DEFAULT_TIMEOUT_S, **options: Any) -> "SandboxdSandbox":
        """A new sandbox (`options` are `sandboxd.Sandbox.create`'s)."""
        options.setdefault("enable_auto_reconnect", True)
        return cls(sandbox=SyncSandbox.create(url, **options), timeout=timeout)

    @classmethod
    def attach(cls, url: str, sandbox_id: str, sandbox_token: str, **options: Any) -> "SandboxdSandbox":
        options.setdefault("enable_auto_reconnect", True)
        return cls(sandbox=SyncSandbox.attach(url, sandbox_id, sandbox_token, **options))

    @property
    def id(self) -> str:
        assert self._sandbox.sandbox_id is not None
        return self._sandbox.sandbox_id

    @property
    def sandbox(self) -> SyncSandbox:
        return self._sandbox

    def execute(self, command: str, *, timeout: Optional[int] = None) -> ExecuteResponse:
        """Runs `command` with bash; output is stdout then stderr."""
        effective = timeout if timeout is not None else self._default_timeout
        try:
            process = self._sandbox.exec("bash", command)
        except SandboxError as err:
            return ExecuteResponse(output=f"sandboxd refused the command: {err}", exit_code=None)
        try:
            exit_code = process.wait(effective if effective > 0 else None)
        except SandboxTimeoutError:
            process.kill()
            output = process.stdout.text + process.stderr.text
            return ExecuteResponse(
                output=f"{output}\n[command timed out after {effective} s and was killed]", exit_code=124
            )
        return ExecuteResponse(output=process.stdout.text + process.stderr.text, exit_code=exit_code)

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        responses = []
        for path, content in files:
            if not path.startswith("/"):
                responses.append(FileUploadResponse(path=path, error="invalid_path"))
                continue
            try:
                self._sandbox.files.write(path, content)
                responses.append(FileUploadResponse(path=path, error=None))
            except SandboxFileError as err:
                responses.append(FileUploadResponse(path=path, error=_file_error(err)))
        return responses

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        responses = []
        for path in paths:
            if not path.startswith("/"):
                responses.append(FileDownloadResponse(path=path, content=None, error="invalid_path"))
                continue
            try:
                responses.append(FileDownloadResponse(path=path, content=self._sandbox.files.read(path), error=None))
            except SandboxFileError as err:
                responses.append(FileDownloadResponse(path=path, content=None, error=_file_error(err)))
        return responses

    def kill(self) -> None:
        """Deletes the sandbox."""
        self._sandbox.kill()


__all__ = ["SandboxdSandbox"]
