"""A blocking facade over the async client, for scripts and notebooks
without an event loop:

    from sandboxd.sync import Sandbox
    with Sandbox.create("ws://127.0.0.1:8080") as sandbox:
        print(sandbox.run_code("1 + 1").text)

Every object runs on one private event loop in a daemon thread; each method
blocks until its coroutine is done and raises what it raised."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Iterator, Optional, TypeVar, Union

from . import sandbox as _async
from .files import FileEntry, Listing, Source, Transfer
from .files import Files as _AsyncFiles
from .process import Execution, SandboxProcess, SandboxStream
from .terminal import Terminal as _AsyncTerminal

T = TypeVar("T")

_loop: Optional[asyncio.AbstractEventLoop] = None
_lock = threading.Lock()


def _run(coroutine: Awaitable[T], timeout: Optional[float] = None) -> T:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="sandboxd-sync", daemon=True).start()
    future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coroutine, _loop)  # type: ignore[arg-type]
    return future.result(timeout)


async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await fn(*args, **kwargs)


class Stream:
    """A process's stdout or stderr: iterate over chunks, or `read_all()`."""

    def __init__(self, stream: SandboxStream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        iterator = self._stream.__aiter__()
        while True:
            try:
                yield _run(iterator.__anext__())
            except StopAsyncIteration:
                return

    def read_all(self) -> str:
        return _run(self._stream.read_all())

    @property
    def text(self) -> str:
        return self._stream.text


class Process:
    """A running execution (see `sandboxd.SandboxProcess`)."""

    def __init__(self, process: SandboxProcess) -> None:
        self._process = process
        self.stdout = Stream(process.stdout)
        self.stderr = Stream(process.stderr)

    @property
    def exit_code(self) -> Optional[int]:
        return self._process.exit_code

    @property
    def results(self) -> list[Any]:
        return self._process.results

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        return _run(self._process.wait(timeout))

    def write_to_stdin(self, data: str) -> None:
        _run(self._process.write_to_stdin(data))

    def kill(self) -> None:
        _run(self._process.kill())


class Terminal:
    """A terminal (see `sandboxd.Terminal`)."""

    def __init__(self, terminal: _AsyncTerminal) -> None:
        self._terminal = terminal

    def read(self, timeout: Optional[float] = None) -> bytes:
        return _run(self._terminal.read(timeout))

    def read_until(self, marker: Union[bytes, str], timeout: float = 30.0) -> bytes:
        return _run(self._terminal.read_until(marker, timeout))

    def write(self, data: Union[bytes, str]) -> None:
        _run(self._terminal.write(data))

    def interrupt(self) -> None:
        """Ctrl-C (see the async `Terminal.interrupt`)."""
        _run(self._terminal.interrupt())

    def resize(self, cols: int, rows: int) -> None:
        _run(self._terminal.resize(cols, rows))

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        return _run(self._terminal.wait(timeout))

    def kill(self) -> None:
        _run(self._terminal.kill())


class Files:
    """`sandbox.files`, blocking (see `sandboxd.Files`)."""

    def __init__(self, files: _AsyncFiles) -> None:
        self._files = files

    def stat(self, path: str) -> FileEntry:
        return _run(self._files.stat(path))

    def exists(self, path: str) -> bool:
        return _run(self._files.exists(path))

    def list(self, path: str = ".", depth: int = 1, max_entries: Optional[int] = None) -> Listing:
        return _run(self._files.list(path, depth, max_entries))

    def read(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        return _run(self._files.read(path, offset, length))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return _run(self._files.read_text(path, encoding))

    def write(self, path: str, data: Union[bytes, str], mode: Optional[int] = None, parents: bool = True) -> FileEntry:
        return _run(self._files.write(path, data, mode, parents))

    def mkdir(self, path: str, parents: bool = False, mode: Optional[int] = None) -> FileEntry:
        return _run(self._files.mkdir(path, parents, mode))

    def remove(self, path: str, recursive: bool = False) -> None:
        _run(self._files.remove(path, recursive))

    def rename(self, path: str, to: str, overwrite: bool = True) -> FileEntry:
        return _run(self._files.rename(path, to, overwrite))

    def upload(self, source: Source, path: str, mode: Optional[int] = None, parents: bool = True) -> Transfer:
        return _run(self._files.upload(source, path, mode, parents))

    def download(self, path: str, destination: Any = None) -> Transfer:
        return _run(self._files.download(path, destination))


class Sandbox:
    """The blocking `Sandbox`: the same calls as `sandboxd.Sandbox`, each
    returning when done. Make one with `Sandbox.create(...)` or
    `Sandbox.attach(...)` (the same arguments as the async ones)."""

    def __init__(self, inner: _async.Sandbox) -> None:
        self._inner = inner
        self.files = Files(inner.files)

    @classmethod
    def create(cls, url: str, **options: Any) -> "Sandbox":
        return cls(_run(_call(_async.Sandbox.create, url, **options)))

    @classmethod
    def attach(cls, url: str, sandbox_id: str, sandbox_token: str, **options: Any) -> "Sandbox":
        return cls(_run(_call(_async.Sandbox.attach, url, sandbox_id, sandbox_token, **options)))

    @property
    def sandbox_id(self) -> Optional[str]:
        return self._inner.sandbox_id

    @property
    def sandbox_token(self) -> Optional[str]:
        return self._inner.sandbox_token

    @property
    def labels(self) -> dict[str, str]:
        return self._inner.labels

    @property
    def state(self) -> str:
        return self._inner.state

    @property
    def inner(self) -> _async.Sandbox:
        """The async sandbox underneath."""
        return self._inner

    def exec(self, language: str, code: str, **options: Any) -> Process:
        return Process(_run(self._inner.exec(language, code, **options)))

    def run_code(self, code: str, timeout: Optional[float] = None) -> Execution:
        return _run(self._inner.run_code(code, timeout=timeout))

    def terminal(self, cols: int = 80, rows: int = 24, command: str = "exec bash -il") -> Terminal:
        return Terminal(_run(self._inner.terminal(cols, rows, command)))

    def checkpoint(self, name: Optional[str] = None, *, keep_running: bool = False) -> None:
        _run(self._inner.checkpoint(name, keep_running=keep_running))

    def checkpoints(self) -> list[_async.CheckpointInfo]:
        return _run(self._inner.checkpoints())

    def reattach(self, url: Optional[str] = None, *, checkpoint: Optional[str] = None) -> None:
        _run(self._inner.reattach(url, checkpoint=checkpoint))

    def snapshot_filesystem(self, name: str, *, token: Optional[str] = None) -> _async.Snapshot:
        return _run(self._inner.snapshot_filesystem(name, token=token))

    def fork(self, checkpoint: Optional[str] = None, **options: Any) -> "Sandbox":
        return Sandbox(_run(self._inner.fork(checkpoint, **options)))

    def kill(self, timeout: float = 5.0) -> None:
        _run(self._inner.kill(timeout))

    def close(self) -> None:
        _run(self._inner.close())

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()
