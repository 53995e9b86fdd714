"""`sandbox.terminal(cols, rows)`: a process on a pseudo-terminal, raw bytes
both ways."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Union

from .errors import SandboxTimeoutError
from .process import SandboxProcess


class Terminal:
    """An interactive program (default `bash -il`) on a terminal in the
    sandbox. `read()` returns the terminal's output bytes as they come
    (escape sequences included), `write()` sends keystrokes (`b"\\x03"` is
    Ctrl-C), `resize(cols, rows)` follows a window (the program gets
    SIGWINCH)."""

    def __init__(self, process: SandboxProcess) -> None:
        self.process = process
        self._buffer = b""

    async def read(self, timeout: Optional[float] = None) -> bytes:
        """The next output, or b"" once the program has ended; raises
        `SandboxTimeoutError` (a `TimeoutError`) when nothing came within
        `timeout` seconds."""
        if self._buffer:
            data, self._buffer = self._buffer, b""
            return data
        try:
            chunk = await self.process.stdout._get(timeout)
        except asyncio.TimeoutError:
            # On Python 3.10 asyncio's TimeoutError is not the builtin one.
            raise SandboxTimeoutError(f"no terminal output within {timeout} s") from None
        return b"" if chunk is None else chunk.encode("utf-8")

    async def read_until(self, marker: Union[bytes, str], timeout: float = 30.0) -> bytes:
        """Output up to and including `marker` (what follows stays for the
        next read). On a timeout (`SandboxTimeoutError`, its message ends
        with the output seen) that output also stays for the next read."""
        if isinstance(marker, str):
            marker = marker.encode("utf-8")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = b""
        while marker not in seen:
            left = deadline - loop.time()
            if left <= 0:
                self._buffer = seen + self._buffer
                raise SandboxTimeoutError(f"{marker!r} did not appear within {timeout} s; got {seen[-500:]!r}")
            try:
                chunk = await self.read(timeout=left)
            except SandboxTimeoutError:
                # What came stays for the next read: a timeout loses no output.
                self._buffer = seen + self._buffer
                raise SandboxTimeoutError(
                    f"{marker!r} did not appear within {timeout} s; got {seen[-500:]!r}"
                ) from None
            if not chunk:
                raise EOFError(f"the terminal ended before {marker!r}; got {seen[-500:]!r}")
            seen += chunk
        end = seen.index(marker) + len(marker)
        self._buffer = seen[end:] + self._buffer
        return seen[:end]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def write(self, data: Union[bytes, str]) -> None:
        """Sends keystrokes. Bytes must be UTF-8 (the protocol carries text)."""
        if isinstance(data, (bytes, bytearray)):
            try:
                text = bytes(data).decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"terminal input must be UTF-8: {err}") from err
        elif isinstance(data, str):
            text = data
        else:
            raise TypeError(f"terminal input must be bytes or str, not {type(data).__name__}")
        await self.process.write_to_stdin(text)

    async def interrupt(self) -> None:
        """Ctrl-C: the terminal's line discipline turns the byte `\\x03` into
        SIGINT for the foreground process group (the program on the
        terminal, or the job a shell runs in it), as a keyboard does; the
        terminal itself stays open."""
        await self.write(b"\x03")

    async def resize(self, cols: int, rows: int) -> None:
        await self.process.resize(cols, rows)

    async def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        return await self.process.wait(timeout)

    async def kill(self) -> None:
        await self.process.kill()
