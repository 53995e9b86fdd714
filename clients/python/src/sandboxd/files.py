"""`sandbox.files`: the sandbox's files without running a command (the
filesystem API of the WebSocket: stat, list, read, write, mkdir, remove,
rename, and streamed uploads and downloads checked by SHA-256)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import os
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator, Optional, Union

from ._channel import Channel
from .errors import SandboxConnectionError, SandboxDigestError, SandboxError, file_error


#: Binary frames of an upload (the server takes at most 1 MiB each).
CHUNK = 1 << 20
#: Above this, `read` and `write` stream (a JSON frame is at most 1 MiB).
STREAM_ABOVE = 512 << 10
#: The most `fs_read` returns at once.
MAX_READ = 4 << 20

Source = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", BinaryIO]


@dataclass(frozen=True)
class FileEntry:
    """A file, directory or link in the sandbox."""

    path: str
    name: str
    type: str  # "file", "directory", "symlink" or "other"
    size: int
    mode: int  # permission bits (0o644 = 420)
    mtime: float
    target: Optional[str] = None

    @property
    def is_file(self) -> bool:
        return self.type == "file"

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "FileEntry":
        return cls(
            path=str(entry.get("path", "")),
            name=str(entry.get("name", "")),
            type=str(entry.get("type", "other")),
            size=int(entry.get("size", 0)),
            mode=int(entry.get("mode", 0)),
            mtime=float(entry.get("mtime", 0)),
            target=entry.get("target"),
        )


class Listing(list[FileEntry]):
    """`files.list`'s entries; `truncated` when `max_entries` cut it short."""

    truncated: bool = False


@dataclass(frozen=True)
class Transfer:
    """The end of an upload or download: the bytes' size and SHA-256 (hex),
    checked on both sides; `data` holds a download's bytes when it was not
    written to a file."""

    path: str
    size: int
    sha256: str
    entry: Optional[FileEntry] = None
    data: Optional[bytes] = None


def _check_path(path: Any, name: str = "path") -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name} must be a non-empty string, not {path!r}")
    if "\0" in path:
        raise ValueError(f"{name} must not contain NUL")
    return path


def _check_mode(mode: Optional[int]) -> None:
    if mode is not None and (not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777):
        raise ValueError(f"mode must be permission bits from 0 to 0o7777, not {mode!r}")


class _Call:
    def __init__(self) -> None:
        self.events: asyncio.Queue[Union[dict[str, Any], bytes, str]] = asyncio.Queue()


class Files:
    """The files of one sandbox (`sandbox.files`). Paths are the sandbox's:
    absolute, or relative to `/home/sandbox`. Refusals raise
    `SandboxFileError` subclasses named after the errno (`ENOENT` is
    `SandboxFileNotFoundError`, also a `FileNotFoundError`)."""

    def __init__(self, sandbox: Channel) -> None:
        self._sandbox = sandbox
        self._calls: dict[str, _Call] = {}
        self._ids = itertools.count(1)
        self._download: Optional[str] = None

    # -- routing ----------------------------------------------------------------

    def _on_frame(self, frame: dict[str, Any]) -> None:
        request_id = str(frame.get("request_id", ""))
        if frame.get("event") == "fs_download":
            self._download = request_id
        elif self._download == request_id:
            self._download = None
        call = self._calls.get(request_id)
        if call is not None:
            call.events.put_nowait(frame)

    def _on_binary(self, data: bytes) -> None:
        if self._download is not None and (call := self._calls.get(self._download)) is not None:
            call.events.put_nowait(data)

    def _on_closed(self, why: str) -> None:
        for call in self._calls.values():
            call.events.put_nowait(why)

    def _open_call(self) -> tuple[str, _Call]:
        request_id = f"py-{next(self._ids)}"
        call = _Call()
        self._calls[request_id] = call
        return request_id, call

    async def _next(self, call: _Call, path: str) -> Union[dict[str, Any], bytes]:
        event = await call.events.get()
        if isinstance(event, str):
            raise SandboxConnectionError(f"the connection closed during a file call on {path}: {event}")
        if isinstance(event, dict) and event.get("event") == "fs_error":
            raise file_error(str(event.get("code", "EIO")), str(event.get("message", "")), path)
        return event

    async def _call(self, op: str, path: str, **fields: Any) -> dict[str, Any]:
        request_id, call = self._open_call()
        try:
            await self._sandbox._send({"action": f"fs_{op}", "request_id": request_id, "path": path, **fields})
            event = await self._next(call, path)
            if not isinstance(event, dict) or event.get("event") != "fs_result":
                raise SandboxError(f"unexpected answer to fs_{op}: {event!r:.200}")
            result = event.get("result")
            return result if isinstance(result, dict) else {}
        finally:
            self._calls.pop(request_id, None)

    # -- calls -------------------------------------------------------------------

    async def stat(self, path: str) -> FileEntry:
        """The entry of `path` (a symlink itself, not its target)."""
        result = await self._call("stat", _check_path(path))
        return FileEntry.from_json(result["entry"])

    async def exists(self, path: str) -> bool:
        from .errors import SandboxFileNotFoundError

        try:
            await self.stat(path)
            return True
        except SandboxFileNotFoundError:
            return False

    async def list(self, path: str = ".", depth: int = 1, max_entries: Optional[int] = None) -> Listing:
        """The entries under directory `path`, `depth` levels deep (1: its
        children), sorted breadth first; `name` is relative to `path`."""
        _check_path(path)
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 64:
            raise ValueError(f"depth must be an integer from 1 to 64, not {depth!r}")
        fields: dict[str, Any] = {"depth": depth}
        if max_entries is not None:
            if not isinstance(max_entries, int) or not 1 <= max_entries <= 10_000:
                raise ValueError(f"max_entries must be an integer from 1 to 10000, not {max_entries!r}")
            fields["max_entries"] = max_entries
        result = await self._call("list", path, **fields)
        listing = Listing(FileEntry.from_json(entry) for entry in result.get("entries", []))
        listing.truncated = bool(result.get("truncated"))
        return listing

    async def read(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """The bytes of file `path` (from `offset`, at most `length`);
        whole files of any size are streamed."""
        _check_path(path)
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative integer, not {offset!r}")
        if length is None and offset == 0:
            transfer = await self.download(path)
            assert transfer.data is not None
            return transfer.data
        if length is not None and (not isinstance(length, int) or length < 0):
            raise ValueError(f"length must be a non-negative integer, not {length!r}")
        out = bytearray()
        want = length
        while want is None or want > 0:
            take = MAX_READ if want is None else min(want, MAX_READ)
            result = await self._call("read", path, offset=offset + len(out), length=take)
            data = base64.b64decode(result.get("data", ""))
            out += data
            if want is not None:
                want -= len(data)
            if result.get("eof") or not data:
                break
        return bytes(out)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(
        self,
        path: str,
        data: Union[bytes, bytearray, str],
        mode: Optional[int] = None,
        parents: bool = True,
    ) -> FileEntry:
        """Creates or replaces file `path` with `data` (str is written as
        UTF-8); large data is streamed as an upload."""
        _check_path(path)
        _check_mode(mode)
        if isinstance(data, str):
            raw = data.encode("utf-8")
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            raise TypeError(f"data must be bytes or str, not {type(data).__name__}")
        if len(raw) > STREAM_ABOVE:
            transfer = await self.upload(raw, path, mode=mode, parents=parents)
            assert transfer.entry is not None
            return transfer.entry
        fields: dict[str, Any] = {"data": base64.b64encode(raw).decode(), "parents": parents}
        if mode is not None:
            fields["mode"] = mode
        result = await self._call("write", path, **fields)
        return FileEntry.from_json(result["entry"])

    async def mkdir(self, path: str, parents: bool = False, mode: Optional[int] = None) -> FileEntry:
        """Creates directory `path` (`parents`: also missing parents, and no
        error if it exists)."""
        _check_path(path)
        _check_mode(mode)
        fields: dict[str, Any] = {"parents": parents}
        if mode is not None:
            fields["mode"] = mode
        return FileEntry.from_json((await self._call("mkdir", path, **fields))["entry"])

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Removes a file, link or (empty, or with `recursive`) directory."""
        await self._call("remove", _check_path(path), recursive=recursive)

    async def rename(self, path: str, to: str, overwrite: bool = True) -> FileEntry:
        """Renames `path` to `to`; returns the entry of `to`."""
        result = await self._call("rename", _check_path(path), to=_check_path(to, "to"), overwrite=overwrite)
        return FileEntry.from_json(result["entry"])

    async def upload(
        self,
        source: Source,
        path: str,
        mode: Optional[int] = None,
        parents: bool = True,
    ) -> Transfer:
        """Streams `source` (bytes, a local file's path, or a binary file
        object) to file `path`. Its SHA-256 is announced first: the server
        renames the file into place only if what arrived matches."""
        _check_path(path)
        _check_mode(mode)
        digest = hashlib.sha256()
        chunks: Iterator[Union[bytes, memoryview]]
        if isinstance(source, (bytes, bytearray, memoryview)):
            view = memoryview(source).cast("B")
            size = len(view)
            digest.update(view)
            chunks = (view[i : i + CHUNK] for i in range(0, size, CHUNK))
            stream: Optional[BinaryIO] = None
        else:
            if isinstance(source, (str, os.PathLike)):
                stream = open(source, "rb")
            elif hasattr(source, "read") and hasattr(source, "seek"):
                stream = source
            else:
                raise TypeError(f"source must be bytes, a path or a seekable binary file, not {type(source).__name__}")
            start = stream.tell()
            size = 0
            while block := stream.read(CHUNK):
                digest.update(block)
                size += len(block)
            stream.seek(start)
            reader = stream
            chunks = iter(lambda: reader.read(CHUNK), b"")
        sha256 = digest.hexdigest()
        request_id, call = self._open_call()
        frame: dict[str, Any] = {
            "action": "fs_upload",
            "request_id": request_id,
            "path": path,
            "size": size,
            "sha256": sha256,
            "parents": parents,
        }
        if mode is not None:
            frame["mode"] = mode
        sandbox = self._sandbox
        try:
            # The bytes must follow their fs_upload directly: nothing else
            # is sent meanwhile.
            async with sandbox._send_lock:
                await sandbox._send_text_unlocked(_dumps(frame))
                for chunk in chunks:
                    await sandbox._send_bytes(chunk)
            event = await self._next(call, path)
            if not isinstance(event, dict):
                raise SandboxError("unexpected binary frame answering an upload")
            result = event.get("result") or {}
            if result.get("sha256") != sha256 or result.get("size") != size:
                raise SandboxDigestError(
                    "EIO", f"upload of {path}: the server stored {result.get('size')} bytes "
                    f"with SHA-256 {result.get('sha256')}, sent {size} with {sha256}", path
                )
            return Transfer(path=path, size=size, sha256=sha256, entry=FileEntry.from_json(result["entry"]))
        finally:
            self._calls.pop(request_id, None)
            if stream is not None and isinstance(source, (str, os.PathLike)):
                stream.close()

    async def download(self, path: str, destination: Union[str, "os.PathLike[str]", None] = None) -> Transfer:
        """Streams file `path` to local file `destination` (written beside it
        and renamed into place once its SHA-256 matches the server's), or
        into `Transfer.data` without one."""
        _check_path(path)
        request_id, call = self._open_call()
        digest = hashlib.sha256()
        parts: list[bytes] = []
        temp: Optional[Any] = None
        received = 0
        try:
            if destination is not None:
                folder = os.path.dirname(os.path.abspath(destination))
                temp = tempfile.NamedTemporaryFile(dir=folder, prefix=".sandboxd-", delete=False)
            await self._sandbox._send({"action": "fs_download", "request_id": request_id, "path": path})
            header = await self._next(call, path)
            if not isinstance(header, dict) or header.get("event") != "fs_download":
                raise SandboxError(f"unexpected answer to fs_download: {header!r:.200}")
            mode = int(header.get("mode", 0o644))
            while True:
                event = await self._next(call, path)
                if isinstance(event, bytes):
                    digest.update(event)
                    received += len(event)
                    if temp is not None:
                        temp.write(event)
                    else:
                        parts.append(event)
                    continue
                result = event.get("result") or {}
                break
            sha256 = digest.hexdigest()
            if result.get("sha256") != sha256 or result.get("size") != received:
                raise SandboxDigestError(
                    "EIO", f"download of {path}: got {received} bytes with SHA-256 {sha256}, "
                    f"the server sent {result.get('size')} with {result.get('sha256')}", path
                )
            if temp is not None:
                temp.close()
                os.chmod(temp.name, mode & 0o7777)
                os.replace(temp.name, destination)  # type: ignore[arg-type]
                temp = None
                return Transfer(path=path, size=received, sha256=sha256)
            return Transfer(path=path, size=received, sha256=sha256, data=b"".join(parts))
        finally:
            self._calls.pop(request_id, None)
            if self._download == request_id:
                self._download = None
            if temp is not None:
                temp.close()
                os.unlink(temp.name)


def _dumps(frame: dict[str, Any]) -> str:
    import json

    return json.dumps(frame)
