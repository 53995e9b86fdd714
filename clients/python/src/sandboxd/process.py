"""An execution in a sandbox: its output streams, stdin, exit code, and the
rich results of `Sandbox.run_code`."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from ._channel import ProcessHost
from .errors import SandboxConnectionError, SandboxError, SandboxTimeoutError, error_for


#: How long `kill()` waits for the execution's end (the official client's 5 s).
KILL_WAIT_S = 5.0


class SandboxStream:
    """One output stream (stdout or stderr) of a process: iterate over its
    chunks as they arrive (`async for chunk in process.stdout`), or
    `await read_all()` for everything until the process ends. Chunks are
    text (the server decodes UTF-8 whole); there is no line framing."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Optional[str]] = asyncio.Queue()
        self._chunks: list[str] = []
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            item = await self._queue.get()
            if item is None:
                # Leave the end for any other reader.
                self._queue.put_nowait(None)
                return
            yield item

    async def _get(self, timeout: Optional[float] = None) -> Optional[str]:
        """The next chunk (None at the end), waiting at most `timeout`."""
        item = await asyncio.wait_for(self._queue.get(), timeout)
        if item is None:
            self._queue.put_nowait(None)
        return item

    async def read_all(self) -> str:
        """Every chunk not yet read, up to the end of the process."""
        return "".join([chunk async for chunk in self])

    @property
    def text(self) -> str:
        """Everything the stream carried so far (read or not)."""
        return "".join(self._chunks)

    def _put(self, chunk: str) -> None:
        if not self._closed:
            self._chunks.append(chunk)
            self._queue.put_nowait(chunk)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(None)


@dataclass
class Result:
    """One rich result of `run_code`: a MIME bundle, as Jupyter's
    `execute_result` / `display_data` carry (`text/plain` of the last
    expression's value, `image/png` (base64) of each matplotlib figure)."""

    data: dict[str, Any]
    #: `"execute_result"` (the last expression's value) or `"display_data"` (a figure).
    kind: str = "display_data"

    @property
    def text(self) -> Optional[str]:
        value = self.data.get("text/plain")
        return value if isinstance(value, str) else None

    @property
    def png(self) -> Optional[bytes]:
        """The figure's PNG bytes, if this result is an image."""
        value = self.data.get("image/png")
        return base64.b64decode(value) if isinstance(value, str) else None

    @property
    def mime_types(self) -> list[str]:
        return sorted(self.data)


@dataclass
class Execution:
    """What `Sandbox.run_code` returns once the code has finished."""

    stdout: str
    stderr: str
    exit_code: Optional[int]
    results: list[Result] = field(default_factory=list)

    @property
    def text(self) -> Optional[str]:
        """`text/plain` of the last expression's value (as a REPL shows it)."""
        for result in reversed(self.results):
            if result.kind == "execute_result":
                return result.text
        return None

    @property
    def pngs(self) -> list[bytes]:
        """The PNG bytes of every figure, in the order they were shown."""
        return [png for result in self.results if (png := result.png) is not None]

    @property
    def error(self) -> bool:
        """True when the code raised (a traceback is on `stderr`)."""
        return self.exit_code not in (0, None)


class SandboxProcess:
    """A running execution. `stdout` and `stderr` stream its output;
    `wait()` returns its exit code (128 + signal when killed)."""

    def __init__(self, sandbox: ProcessHost, *, terminal: bool = False) -> None:
        self._sandbox = sandbox
        self.stdout = SandboxStream()
        self.stderr = SandboxStream()
        self.results: list[Result] = []
        self.exit_code: Optional[int] = None
        #: True when `kill()` (or a forced move of the sandbox) ended it.
        self.killed = False
        self.terminal = terminal
        loop = asyncio.get_running_loop()
        self._started: asyncio.Future[None] = loop.create_future()
        self._done = asyncio.Event()
        self._error: Optional[SandboxError] = None

    # -- frames from the sandbox's connection --------------------------------

    def _on_frame(self, frame: dict[str, Any]) -> None:
        if self._done.is_set():
            return
        event = frame.get("event")
        if event == "stdout":
            self.stdout._put(str(frame.get("data", "")))
        elif event == "stderr":
            self.stderr._put(str(frame.get("data", "")))
        elif event == "exit_code":
            code = frame.get("exit_code")
            self.exit_code = code if isinstance(code, int) else None
        elif event == "result":
            data = frame.get("data")
            if isinstance(data, dict):
                kind = str(frame.get("kind") or "display_data")
                self.results.append(Result(data=data, kind=kind))
        elif event == "status_update":
            status = str(frame.get("status", ""))
            message = frame.get("message")
            if status == "SANDBOX_EXECUTION_RUNNING":
                if not self._started.done():
                    self._started.set_result(None)
            elif status in (
                "SANDBOX_EXECUTION_ERROR",
                "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR",
            ):
                error = error_for(status, message)
                if not self._started.done():
                    # Refused: the execution never started.
                    self._started.set_exception(error)
                    self._finish()
                else:
                    # Failed after it started (e.g. a workspace upload): the
                    # exit code and DONE follow.
                    self._error = error
            elif status == "SANDBOX_EXECUTION_FORCE_KILLED":
                self.killed = True
            elif status == "SANDBOX_EXECUTION_FORCE_KILL_ERROR":
                self._error = error_for(status, message)
            elif status == "SANDBOX_EXECUTION_DONE":
                self._finish()

    def _refused(self, error: SandboxError) -> None:
        if not self._started.done():
            self._started.set_exception(error)
            self._finish()

    def _on_closed(self, why: str) -> None:
        """The connection ended for good while this process ran."""
        if self._done.is_set():
            return
        error = SandboxConnectionError(f"the connection to the sandbox ended: {why}")
        if not self._started.done():
            self._started.set_exception(error)
        self._error = self._error or error
        self._finish()

    def _finish(self) -> None:
        if self._done.is_set():
            return
        self.stdout._close()
        self.stderr._close()
        self._done.set()
        self._sandbox._process_ended(self)
        if self._started.done() and not self._started.cancelled():
            self._started.exception()  # retrieved: no "never retrieved" warning

    # -- the API -------------------------------------------------------------

    async def _wait_started(self) -> None:
        await self._started

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Waits for the end; returns the exit code (None if the server sent none)."""
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            raise SandboxTimeoutError(f"the execution did not end within {timeout} s") from None
        return self.exit_code

    async def write_to_stdin(self, data: str) -> None:
        """Sends `data` to the process's stdin (keystrokes, for a terminal)."""
        if not isinstance(data, str):
            raise TypeError(f"stdin data must be str, not {type(data).__name__}")
        if self._done.is_set():
            raise SandboxError("the process has ended")
        await self._sandbox._send({"event": "stdin", "data": data})

    async def kill(self, timeout: float = KILL_WAIT_S) -> None:
        """Kills the process's whole tree and waits (up to `timeout`) for its end."""
        if self._done.is_set():
            return
        await self._sandbox._send({"action": "kill_process"})
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            self._finish()
        if self._error is not None and self._error.status == "SANDBOX_EXECUTION_FORCE_KILL_ERROR":
            raise self._error

    async def terminate(self) -> None:
        """The official client's name for `kill()`."""
        await self.kill()

    async def resize(self, cols: int, rows: int) -> None:
        """Resizes the process's terminal (an execution started with a `pty`)."""
        if not self.terminal:
            raise SandboxError("resize needs an execution on a terminal (Sandbox.terminal)")
        for name, value in (("cols", cols), ("rows", rows)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
                raise ValueError(f"{name} must be an integer from 1 to 1000, not {value!r}")
        await self._sandbox._send({"action": "resize", "cols": cols, "rows": rows})

    @property
    def error(self) -> Optional[SandboxError]:
        """An error the server reported after the execution started."""
        return self._error
