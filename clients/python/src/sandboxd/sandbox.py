"""`Sandbox`: one sandbox over one WebSocket (`/create` or `/attach/{id}`),
with transparent reconnect and handoff. A superset of the official Cloud
Run sandbox client's `Sandbox` (same calls, same arguments, same exception
names), plus exit codes, files, terminals, named checkpoints, forks, rich
results and the create options sandboxd added."""

from __future__ import annotations

import asyncio
import json
import re
import time
import ssl as ssl_module
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional
from urllib.parse import quote

import websockets
from websockets.asyncio.client import ClientConnection

from . import auth
from .connection import CookieJar, Frame, decode, open_socket, redact
from .errors import (
    SandboxConnectionError,
    SandboxError,
    SandboxInUseError,
    SandboxNotFoundError,
    SandboxPermissionError,
    SandboxProtocolError,
    SandboxServerError,
    SandboxStateError,
    SandboxTimeoutError,
    error_for,
)
from .process import Execution, SandboxProcess

if TYPE_CHECKING:
    from .terminal import Terminal

#: Statuses after which the sandbox is gone for this client: no reconnect.
FATAL_STATUSES = frozenset(
    {
        "SANDBOX_ERROR",
        "SANDBOX_NOT_FOUND",
        "SANDBOX_CREATION_ERROR",
        "SANDBOX_CHECKPOINT_ERROR",
        "SANDBOX_RESTORE_ERROR",
        "SANDBOX_DELETED",
        "SANDBOX_LOCK_RENEWAL_ERROR",
        "SANDBOX_PERMISSION_DENIAL_ERROR",
        "SANDBOX_KILLED",
    }
)
#: Statuses that fail a create or attach.
READY_ERRORS = frozenset(
    {
        "SANDBOX_CREATION_ERROR",
        "SANDBOX_NOT_FOUND",
        "SANDBOX_IN_USE",
        "SANDBOX_RESTORE_ERROR",
        "SANDBOX_PERMISSION_DENIAL_ERROR",
        "SANDBOX_ERROR",
    }
)
#: How long a reconnect is tried before the sandbox is given up.
RECONNECT_FOR_S = 120.0
CHECKPOINT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
NETWORK_MODES = ("none", "egress")
#: Most labels a sandbox may carry (the server refuses more).
MAX_LABELS = 32
LABEL_KEY = re.compile(r"^[A-Za-z0-9._-]{1,63}$")

#: Filesystem snapshots this process took, by name: their owner tokens, so
#: `create(filesystem_snapshot_name=NAME)` works as with the earlier server
#: (sandboxd gives a snapshot to the sandbox that took it).
_SNAPSHOT_TOKENS: dict[str, str] = {}


@dataclass(frozen=True)
class Snapshot:
    """A filesystem snapshot: create a sandbox from it with
    `Sandbox.create(url, filesystem_snapshot_name=name, filesystem_snapshot_token=token)`."""

    name: str
    token: Optional[str]


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a sandbox: `role` is `latest`, `previous` or
    `named`; `name` its name (if any); `created_at` ISO 8601; `size` bytes."""

    role: str
    name: Optional[str]
    checkpoint_id: Optional[str]
    created_at: str
    size: int

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "CheckpointInfo":
        return cls(
            role=str(row.get("role", "")),
            name=row.get("name"),
            checkpoint_id=row.get("checkpoint_id"),
            created_at=str(row.get("created_at", "")),
            size=int(row.get("size", 0)),
        )


def _get_json(url: str, bearer: Optional[str], ssl: Optional[ssl_module.SSLContext]) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url)
    if bearer:
        request.add_header("Authorization", f"Bearer {bearer}")
    try:
        with urllib.request.urlopen(request, timeout=30, context=ssl) as response:
            payload = json.load(response)
    except urllib.error.HTTPError as err:
        try:
            message = json.load(err).get("error", "")
        except Exception:
            message = ""
        if err.code == 404:
            raise SandboxNotFoundError(message or "no such sandbox", "SANDBOX_NOT_FOUND") from None
        if err.code in (401, 403):
            raise SandboxPermissionError(message or f"HTTP {err.code}", "SANDBOX_PERMISSION_DENIAL_ERROR") from None
        raise SandboxServerError(f"HTTP {err.code}: {message}", None) from None
    except OSError as err:
        raise SandboxConnectionError(f"Failed to reach {redact(url)}: {err}") from err
    if not isinstance(payload, dict):
        raise SandboxProtocolError(f"unexpected answer from {redact(url)}")
    return payload


def _is_execution_status(status: str) -> bool:
    return (
        status.startswith("SANDBOX_EXECUTION_") and status != "SANDBOX_EXECUTION_IN_PROGRESS_ERROR"
    ) or status == "SANDBOX_STDIN_ERROR"


def _ws_url(url: str) -> str:
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a non-empty string, not {url!r}")
    url = url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            url = ws + url[len(http) :]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"url must start with ws://, wss://, http:// or https://, not {url!r}")
    return url


def _is_label_key(key: Any) -> bool:
    return isinstance(key, str) and LABEL_KEY.match(key) is not None


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


def _check_checkpoint_name(name: Optional[str]) -> None:
    if name is None:
        return
    if not isinstance(name, str) or not CHECKPOINT_NAME.match(name):
        raise ValueError(
            f"invalid checkpoint name {name!r}: 1-63 of a-z, 0-9, '-', '_', "
            "starting with a letter or digit"
        )


class Sandbox:
    """A sandbox: Python and Bash in gVisor, with its files, terminals and
    checkpoints. Make one with `await Sandbox.create(url, ...)` or
    `await Sandbox.attach(url, sandbox_id, sandbox_token)`."""

    def __init__(
        self,
        url: str,
        initial_state: str,
        *,
        ssl: Optional[ssl_module.SSLContext] = None,
        enable_debug: bool = False,
        debug_label: str = "",
        enable_auto_reconnect: bool = False,
        use_google_auth: bool = False,
        id_token: Optional[Callable[[str], str]] = None,
    ) -> None:
        from .files import Files

        self._url = _ws_url(url)
        self._ssl = ssl
        self._state = initial_state
        self._enable_debug = enable_debug
        self._debug_label = debug_label
        self._enable_auto_reconnect = enable_auto_reconnect
        self._use_google_auth = use_google_auth
        self._id_token = id_token
        self._jar = CookieJar()
        self._socket: Optional[ClientConnection] = None
        self._reader: Optional[asyncio.Task[None]] = None
        self._sandbox_id: Optional[str] = None
        self._sandbox_token: Optional[str] = None
        self._process: Optional[SandboxProcess] = None
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._reconnect_allowed = False
        self._closing = False
        self._user_checkpoint = False
        self._killing = False
        self._reconnecting: Optional[asyncio.Event] = None
        self._outbox: list[str] = []
        self._send_lock = asyncio.Lock()
        self._closed_why: Optional[str] = None
        self.files = Files(self)
        #: The options the sandbox was created with (what this client sent).
        self.options: dict[str, Any] = {}
        #: The message of the last status update, until an `error` event
        #: repeating it arrives (the server sends both for one refusal).
        self._last_status_message: Optional[str] = None

    # -- identity --------------------------------------------------------------

    @property
    def labels(self) -> dict[str, str]:
        """The labels this sandbox was created with here (`{}` otherwise)."""
        return dict(self.options.get("labels", {}))

    @property
    def sandbox_id(self) -> Optional[str]:
        """The sandbox's id (32 hex digits)."""
        return self._sandbox_id

    @property
    def sandbox_token(self) -> Optional[str]:
        """The sandbox's secret token: needed to attach to it again."""
        return self._sandbox_token

    @property
    def url(self) -> str:
        return self._url

    @property
    def state(self) -> str:
        """`creating`, `attaching`, `restoring`, `running`, `checkpointing`,
        `checkpointed`, `closed` or `failed`."""
        return self._state

    # -- opening ---------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        url: str,
        idle_timeout: Optional[int] = 60,
        ssl: Optional[ssl_module.SSLContext] = None,
        enable_debug: bool = False,
        debug_label: str = "",
        filesystem_snapshot_name: Optional[str] = None,
        enable_sandbox_checkpoint: bool = False,
        enable_idle_timeout_auto_checkpoint: bool = False,
        enable_auto_reconnect: bool = False,
        enable_sandbox_handoff: bool = False,
        use_google_auth: bool = False,
        *,
        filesystem_snapshot_token: Optional[str] = None,
        keep_executions: bool = False,
        image: Optional[str] = None,
        network: Optional[str] = None,
        workspace_id: Optional[str] = None,
        workspace_token: Optional[str] = None,
        enable_workspace_sync: bool = False,
        workspace_template: Optional[str] = None,
        from_checkpoint: Optional[dict[str, str]] = None,
        labels: Optional[dict[str, str]] = None,
        id_token: Optional[Callable[[str], str]] = None,
        timeout: Optional[float] = None,
    ) -> "Sandbox":
        """Creates a sandbox (`WS /create`) and returns once it runs.

        The official client's arguments come first, in its order. sandboxd's:
        `keep_executions` (a running execution survives a handoff, eviction or
        drain; needs `enable_sandbox_checkpoint`), `image` (a name of `GET
        /images`), `network` (`"none"` or `"egress"`), `workspace_id` +
        `workspace_token` or `enable_workspace_sync` (a `/workspace` synced to
        the store), `from_checkpoint` (a fork: `{"sandbox_id", "sandbox_token",
        "name"?}`; see `fork()`), `labels` (your own string tags, up to 32,
        kept in the sandbox's `metadata.json` for operators and tools, and in
        `sandbox.labels`), `filesystem_snapshot_token` (the owner token
        of `filesystem_snapshot_name`; snapshots this process took are found
        by name), `id_token` (a callable url -> Google ID token, replacing the
        ADC fetch of `use_google_auth`), `timeout` (seconds for the create).
        """
        if idle_timeout is not None and (
            not isinstance(idle_timeout, int) or isinstance(idle_timeout, bool) or idle_timeout < 0
        ):
            raise ValueError(f"idle_timeout must be a non-negative integer or None, not {idle_timeout!r}")
        for name, flag in (
            ("enable_sandbox_checkpoint", enable_sandbox_checkpoint),
            ("enable_idle_timeout_auto_checkpoint", enable_idle_timeout_auto_checkpoint),
            ("enable_auto_reconnect", enable_auto_reconnect),
            ("enable_sandbox_handoff", enable_sandbox_handoff),
            ("use_google_auth", use_google_auth),
            ("keep_executions", keep_executions),
            ("enable_workspace_sync", enable_workspace_sync),
        ):
            _check_bool(name, flag)
        if network is not None and network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {NETWORK_MODES}, not {network!r}")
        for name, text in (
            ("filesystem_snapshot_name", filesystem_snapshot_name),
            ("filesystem_snapshot_token", filesystem_snapshot_token),
            ("image", image),
            ("workspace_id", workspace_id),
            ("workspace_token", workspace_token),
            ("workspace_template", workspace_template),
        ):
            if text is not None and (not isinstance(text, str) or not text):
                raise ValueError(f"{name} must be a non-empty string, not {text!r}")
        if from_checkpoint is not None:
            if not isinstance(from_checkpoint, dict) or not {"sandbox_id", "sandbox_token"} <= set(
                from_checkpoint
            ):
                raise ValueError("from_checkpoint must be a dict with sandbox_id and sandbox_token (and optionally name)")
        if labels is not None and not (
            isinstance(labels, dict)
            and len(labels) <= MAX_LABELS
            and all(_is_label_key(k) and isinstance(v, str) and len(v.encode()) <= 256 for k, v in labels.items())
        ):
            raise ValueError(
                f"labels must be a dict of at most {MAX_LABELS} str values (up to 256 bytes) under keys of "
                f"1-63 letters, digits, '-', '_' and '.', not {labels!r}"
            )
        init: dict[str, Any] = {"idle_timeout": idle_timeout}
        if filesystem_snapshot_name:
            init["filesystem_snapshot_name"] = filesystem_snapshot_name
            token = filesystem_snapshot_token or _SNAPSHOT_TOKENS.get(filesystem_snapshot_name)
            if token and "@" not in filesystem_snapshot_name:
                init["filesystem_snapshot_token"] = token
        if enable_sandbox_checkpoint:
            init["enable_checkpoint"] = True
        if enable_idle_timeout_auto_checkpoint:
            init["enable_idle_timeout_auto_checkpoint"] = True
        if enable_sandbox_handoff:
            init["enable_sandbox_handoff"] = True
        if keep_executions:
            init["keep_executions"] = True
        if image is not None:
            init["image"] = image
        if network is not None:
            init["network"] = network
        if workspace_id is not None:
            init["workspace_id"] = workspace_id
        if workspace_token is not None:
            init["workspace_token"] = workspace_token
        if enable_workspace_sync:
            init["enable_workspace_sync"] = True
        if workspace_template is not None:
            init["workspace_template"] = workspace_template
        if from_checkpoint is not None:
            init["from_checkpoint"] = dict(from_checkpoint)
        if labels:
            init["labels"] = dict(labels)
        instance = cls(
            url,
            "creating",
            ssl=ssl,
            enable_debug=enable_debug,
            debug_label=debug_label,
            enable_auto_reconnect=enable_auto_reconnect,
            use_google_auth=use_google_auth,
            id_token=id_token,
        )
        instance.options = init
        await instance._open(f"{instance._url}/create", init, timeout)
        return instance

    @classmethod
    async def attach(
        cls,
        url: str,
        sandbox_id: str,
        sandbox_token: str,
        ssl: Optional[ssl_module.SSLContext] = None,
        enable_debug: bool = False,
        debug_label: str = "",
        enable_auto_reconnect: bool = False,
        use_google_auth: bool = False,
        *,
        checkpoint: Optional[str] = None,
        id_token: Optional[Callable[[str], str]] = None,
        timeout: Optional[float] = None,
    ) -> "Sandbox":
        """Attaches to a sandbox (`WS /attach/{id}`), restoring its latest
        checkpoint (or the one named `checkpoint`) when it is not running
        here: on another instance, a handoff."""
        for name, value in (("sandbox_id", sandbox_id), ("sandbox_token", sandbox_token)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, not {value!r}")
        _check_checkpoint_name(checkpoint)
        instance = cls(
            url,
            "attaching",
            ssl=ssl,
            enable_debug=enable_debug,
            debug_label=debug_label,
            enable_auto_reconnect=enable_auto_reconnect,
            use_google_auth=use_google_auth,
            id_token=id_token,
        )
        instance._sandbox_id = sandbox_id
        instance._sandbox_token = sandbox_token
        attach_url = instance._attach_url()
        if checkpoint is not None:
            attach_url += f"&checkpoint={quote(checkpoint)}"
        await instance._open(attach_url, None, timeout)
        return instance

    def _attach_url(self) -> str:
        assert self._sandbox_id is not None and self._sandbox_token is not None
        return (
            f"{self._url}/attach/{quote(self._sandbox_id, safe='')}"
            f"?sandbox_token={quote(self._sandbox_token, safe='')}"
        )

    async def _bearer(self) -> Optional[str]:
        if self._id_token is not None:
            return self._id_token(self._url)
        if self._use_google_auth:
            return await asyncio.to_thread(auth.fetch_id_token, self._url)
        return None

    async def _open(self, url: str, init: Optional[dict[str, Any]], timeout: Optional[float]) -> None:
        ready = self._future("ready")
        self._closing = False
        self._closed_why = None
        try:
            self._socket = await open_socket(url, self._jar, bearer=await self._bearer(), ssl=self._ssl)
        except SandboxConnectionError:
            self._state = "failed"
            self._pending.pop("ready", None)
            raise
        self._log(f"connected to {redact(url)}")
        self._reader = asyncio.create_task(self._read_loop())
        if init is not None:
            await self._send(init)
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except asyncio.TimeoutError:
            await self._close_socket()
            self._state = "failed"
            raise SandboxTimeoutError(f"the sandbox was not running within {timeout} s") from None
        except BaseException:
            self._state = "failed"
            await self._close_socket()
            raise

    # -- frames ------------------------------------------------------------------

    def _log(self, message: str) -> None:
        if self._enable_debug:
            label = f"[{self._debug_label}] " if self._debug_label else ""
            print(f"{label}{message}", flush=True)

    def _future(self, kind: str) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[kind] = future
        return future

    def _resolve(self, kind: str, value: Any = None) -> None:
        future = self._pending.pop(kind, None)
        if future is not None and not future.done():
            future.set_result(value)

    def _fail(self, kind: str, error: BaseException) -> bool:
        future = self._pending.pop(kind, None)
        if future is not None and not future.done():
            future.set_exception(error)
            return True
        return False

    async def _read_loop(self) -> None:
        while True:
            socket = self._socket
            assert socket is not None
            why = "closed"
            try:
                while True:
                    message = await socket.recv()
                    try:
                        frame = decode(message)
                    except ValueError as err:
                        self._log(f"unreadable frame: {err}")
                        continue
                    self._dispatch(frame)
            except websockets.exceptions.ConnectionClosed as closed:
                if closed.rcvd is not None:
                    why = f"closed by the server with {closed.rcvd.code} {closed.rcvd.reason}".strip()
                else:
                    why = "connection lost"
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a transport error
                why = f"connection lost: {err}"
            self._log(f"connection ended: {why}")
            if not self._closing and self._reconnect_allowed and self._enable_auto_reconnect:
                try:
                    await self._reconnect()
                    continue
                except SandboxError as err:
                    why = f"reconnecting failed: {err}"
                    self._log(why)
            self._finish(why)
            return

    def _dispatch(self, frame: Frame) -> None:
        if isinstance(frame, bytes):
            self.files._on_binary(frame)
            return
        event = frame.get("event")
        if event in ("stdout", "stderr", "exit_code", "result"):
            if self._process is not None:
                self._process._on_frame(frame)
            return
        if event in ("fs_result", "fs_error", "fs_download"):
            self.files._on_frame(frame)
            return
        self._log(f"received {json.dumps(frame)[:300]}")
        if event == "sandbox_id":
            self._sandbox_id = frame.get("sandbox_id")
            self._sandbox_token = frame.get("sandbox_token")
        elif event == "status_update":
            self._last_status_message = frame.get("message")
            self._on_status(str(frame.get("status", "")), frame.get("message"), frame)
        elif event == "error":
            # Always right after its status, which carries the message too;
            # alone, it answers a frame the server could not read.
            message = str(frame.get("message", ""))
            echoed, self._last_status_message = self._last_status_message, None
            if message == echoed:
                # The status just handled said it (an execution refused for
                # its language, say): the next execution, which may already
                # wait for its start, must not take it for its own refusal.
                return
            process = self._process
            if process is not None and not process._started.done():
                # An execution request the server could not read (a field of
                # the wrong type): it never starts.
                process._refused(SandboxProtocolError(message))

    def _on_status(self, status: str, message: Optional[str], frame: dict[str, Any]) -> None:
        if _is_execution_status(status):
            if self._process is not None:
                self._process._on_frame(frame)
            return
        if status in FATAL_STATUSES:
            self._reconnect_allowed = False
        if status == "SANDBOX_RUNNING":
            self._state = "running"
            self._reconnect_allowed = True
            self._resolve("ready")
        elif status == "SANDBOX_RESTORING":
            self._state = "restoring"
        elif status in READY_ERRORS and "ready" in self._pending:
            self._state = "failed"
            self._fail("ready", error_for(status, message))
        elif status == "SANDBOX_CHECKPOINTING":
            self._state = "checkpointing"
        elif status == "SANDBOX_CHECKPOINTED":
            self._state = "checkpointed"
            if self._user_checkpoint:
                self._reconnect_allowed = False
                self._resolve("checkpoint")
            else:
                # Not asked for: the sandbox was moved (a handoff, an
                # eviction, a drained instance). Follow it if allowed.
                self._reconnect_allowed = True
        elif status in ("SANDBOX_CHECKPOINT_ERROR", "SANDBOX_EXECUTION_IN_PROGRESS_ERROR"):
            self._state = "running"
            self._user_checkpoint = False
            self._fail("checkpoint", error_for(status, message))
        elif status == "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED":
            name = frame.get("filesystem_snapshot_name")
            token = frame.get("filesystem_snapshot_token")
            self._resolve("snapshot", (name, token))
        elif status == "SANDBOX_FILESYSTEM_SNAPSHOT_ERROR":
            self._fail("snapshot", error_for(status, message))
        elif status in ("SANDBOX_KILLED", "SANDBOX_KILL_ERROR"):
            self._resolve("kill", error_for(status, message) if status == "SANDBOX_KILL_ERROR" else None)
        elif status == "SANDBOX_DELETED" and not self._killing and not self._user_checkpoint:
            # Deleted by the server (idle timeout), unless a move follows
            # (CHECKPOINTED re-allows the reconnect).
            pass
        elif status in ("SANDBOX_ERROR", "SANDBOX_LOCK_RENEWAL_ERROR"):
            error = error_for(status, message)
            for kind in list(self._pending):
                self._fail(kind, error)

    def _finish(self, why: str) -> None:
        """The connection is over for good."""
        self._closed_why = why
        if self._state not in ("checkpointed", "failed"):
            self._state = "closed"
        error = SandboxConnectionError(f"Connection closed: {why}")
        for kind in list(self._pending):
            self._fail(kind, error)
        if self._process is not None:
            self._process._on_closed(why)
        self.files._on_closed(why)
        if self._reconnecting is not None:
            self._reconnecting.set()

    async def _reconnect(self) -> None:
        """Re-attaches (with back-off, the affinity cookie and a fresh ID
        token) until `SANDBOX_RUNNING`, then asks for the replay of the
        current execution's output and sends what was written meanwhile."""
        self._reconnecting = asyncio.Event()
        started = time.monotonic()
        delay = 0.1
        try:
            while True:
                if time.monotonic() - started > RECONNECT_FOR_S:
                    raise SandboxConnectionError(f"could not reconnect within {RECONNECT_FOR_S:.0f} s")
                try:
                    socket = await open_socket(
                        self._attach_url(), self._jar, bearer=await self._bearer(), ssl=self._ssl
                    )
                    if await self._await_running(socket):
                        self._socket = socket
                        await socket.send(json.dumps({"action": "reconnect"}))
                        outbox, self._outbox = self._outbox, []
                        for text in outbox:
                            await socket.send(text)
                        self._log("reconnected")
                        return
                except SandboxInUseError:
                    pass  # the old connection is not noticed yet: try again
                except (SandboxConnectionError, websockets.exceptions.ConnectionClosed, OSError):
                    pass
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        finally:
            event, self._reconnecting = self._reconnecting, None
            event.set()

    async def _await_running(self, socket: ClientConnection) -> bool:
        while True:
            frame = decode(await socket.recv())
            if isinstance(frame, bytes) or frame.get("event") != "status_update":
                continue
            status = str(frame.get("status", ""))
            if status == "SANDBOX_RUNNING":
                self._state = "running"
                return True
            if status == "SANDBOX_RESTORING":
                self._state = "restoring"
            elif status in READY_ERRORS:
                await socket.close()
                raise error_for(status, frame.get("message"))

    async def _send(self, data: dict[str, Any]) -> None:
        text = json.dumps(data)
        await self._send_text(text)

    async def _send_text(self, text: str) -> None:
        async with self._send_lock:
            await self._send_text_unlocked(text)

    async def _send_text_unlocked(self, text: str) -> None:
        if self._reconnecting is not None:
            self._outbox.append(text)
            return
        socket = self._socket
        if socket is None or self._closed_why is not None:
            raise SandboxConnectionError(
                f"the sandbox's connection is closed ({self._closed_why or 'never opened'})"
            )
        try:
            await socket.send(text)
        except websockets.exceptions.ConnectionClosed as err:
            if self._reconnect_allowed and self._enable_auto_reconnect and not self._closing:
                self._outbox.append(text)
                return
            raise SandboxConnectionError(f"the sandbox's connection is closed: {err}") from err

    async def _send_bytes(self, data: bytes | memoryview) -> None:
        socket = self._socket
        if socket is None or self._closed_why is not None or self._reconnecting is not None:
            raise SandboxConnectionError("the sandbox's connection is not open")
        try:
            await socket.send(data)
        except websockets.exceptions.ConnectionClosed as err:
            raise SandboxConnectionError(f"the sandbox's connection is closed: {err}") from err

    def _require_running(self) -> None:
        if self._state != "running":
            raise SandboxStateError(f"Sandbox is not in a running state. Current state: {self._state}")

    async def _close_socket(self) -> None:
        self._closing = True
        socket = self._socket
        if socket is not None:
            try:
                await socket.close()
            except Exception:
                pass
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            try:
                await asyncio.wait_for(asyncio.shield(reader), 5)
            except (asyncio.TimeoutError, Exception):
                reader.cancel()

    def _process_ended(self, process: SandboxProcess) -> None:
        if self._process is process:
            self._process = None

    # -- executions --------------------------------------------------------------

    async def exec(
        self,
        language: str,
        code: str,
        *,
        session: bool = False,
        pty: Optional[tuple[int, int]] = None,
        results: bool = False,
    ) -> SandboxProcess:
        """Starts `code` (`language` `"python"` or `"bash"`) and returns once
        it runs; read `process.stdout` / `stderr`, `await process.wait()` for
        the exit code. `session=True` runs a Python cell in the sandbox's
        persistent session (globals survive executions and checkpoints);
        `pty=(cols, rows)` runs on a terminal; `results=True` (with
        `session`) asks for rich results (see `run_code`)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, not {type(code).__name__}")
        if self._process is not None:
            raise SandboxStateError("Another process is already running in this sandbox.")
        self._require_running()
        frame: dict[str, Any] = {"language": language, "code": code}
        if session:
            frame["session"] = True
        if results:
            if not session or language != "python":
                raise ValueError("results=True needs language='python' and session=True")
            frame["results"] = True
        if pty is not None:
            if session:
                raise ValueError("pty cannot be used with session=True")
            cols, rows = pty
            for name, value in (("cols", cols), ("rows", rows)):
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
                    raise ValueError(f"{name} must be an integer from 1 to 1000, not {value!r}")
            frame["pty"] = {"cols": cols, "rows": rows}
        process = SandboxProcess(self, terminal=pty is not None)
        self._process = process
        try:
            await self._send(frame)
        except BaseException:
            self._process = None
            raise
        await process._wait_started()
        return process

    async def run_code(self, code: str, *, timeout: Optional[float] = None) -> Execution:
        """Runs Python `code` as a cell of the sandbox's persistent session
        (globals survive) and returns its output, exit code and rich results:
        `text/plain` of the last expression's value, and an `image/png` for
        each matplotlib figure the code shows or leaves open."""
        process = await self.exec("python", code, session=True, results=True)
        try:
            exit_code = await process.wait(timeout)
        except SandboxTimeoutError:
            await process.kill()
            raise
        if process.error is not None and process.error.status is not None and process.exit_code is None:
            raise process.error
        return Execution(
            stdout=process.stdout.text,
            stderr=process.stderr.text,
            exit_code=exit_code,
            results=list(process.results),
        )

    async def terminal(self, cols: int = 80, rows: int = 24, command: str = "exec bash -il") -> "Terminal":
        """Runs `command` (bash) on a pseudo-terminal of `cols` x `rows`:
        raw bytes both ways, `resize()`; see `Terminal`."""
        from .terminal import Terminal

        process = await self.exec("bash", command, pty=(cols, rows))
        return Terminal(process)

    # -- checkpoints, snapshots, forks -----------------------------------------

    async def checkpoint(self, name: Optional[str] = None, *, keep_running: bool = False) -> None:
        """Checkpoints the sandbox (memory, processes, files) to the store,
        also under `name` when given; the sandbox stops and the connection
        closes, as with the official client. `keep_running=True` attaches
        again right after (a restore), so this handle stays usable."""
        _check_checkpoint_name(name)
        _check_bool("keep_running", keep_running)
        self._require_running()
        future = self._future("checkpoint")
        self._state = "checkpointing"
        self._user_checkpoint = True
        frame: dict[str, Any] = {"action": "checkpoint"}
        if name is not None:
            frame["name"] = name
        try:
            await self._send(frame)
            await future
        finally:
            self._user_checkpoint = self._state == "checkpointed"
        await self._close_socket()
        self._state = "checkpointed"
        if keep_running:
            await self.reattach()

    async def checkpoints(self) -> list[CheckpointInfo]:
        """The sandbox's checkpoint history, newest first, as the server's
        store records it (`GET /sandboxes/{id}/checkpoints`): the latest,
        the earlier ones still kept, and every named one. Works whatever
        the sandbox's state (it is not attached or restored)."""
        if self._sandbox_id is None or self._sandbox_token is None:
            raise SandboxStateError("the sandbox has no id yet")
        http = "http" + self._url[2:]  # ws:// -> http://, wss:// -> https://
        url = (
            f"{http}/sandboxes/{quote(self._sandbox_id, safe='')}/checkpoints"
            f"?sandbox_token={quote(self._sandbox_token, safe='')}"
        )
        bearer = await self._bearer()
        payload = await asyncio.to_thread(_get_json, url, bearer, self._ssl)
        return [CheckpointInfo.from_json(row) for row in payload.get("checkpoints", [])]

    async def reattach(self, url: Optional[str] = None, *, checkpoint: Optional[str] = None) -> None:
        """Attaches this handle again (after a checkpoint, or to move the
        sandbox to the instance behind `url`: a handoff)."""
        _check_checkpoint_name(checkpoint)
        if self._state not in ("checkpointed", "closed"):
            await self._close_socket()
        if url is not None:
            self._url = _ws_url(url)
            self._jar = CookieJar()
        self._state = "attaching"
        self._user_checkpoint = False
        self._killing = False
        attach_url = self._attach_url()
        if checkpoint is not None:
            attach_url += f"&checkpoint={quote(checkpoint)}"
        await self._open(attach_url, None, None)

    async def snapshot_filesystem(self, name: str, *, token: Optional[str] = None) -> Snapshot:
        """Saves the sandbox's files as snapshot `name` (the sandbox keeps
        running); new sandboxes start from it with
        `create(filesystem_snapshot_name=name)`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a snapshot name must be a non-empty string, not {name!r}")
        self._require_running()
        future = self._future("snapshot")
        frame: dict[str, Any] = {"action": "snapshot_filesystem", "name": name}
        if token is not None:
            frame["filesystem_snapshot_token"] = token
        await self._send(frame)
        reported_name, reported_token = await future
        snapshot = Snapshot(name=reported_name or name, token=reported_token)
        if snapshot.token:
            _SNAPSHOT_TOKENS[name] = snapshot.token
        return snapshot

    async def fork(self, checkpoint: Optional[str] = None, *, url: Optional[str] = None, **options: Any) -> "Sandbox":
        """A new, independent sandbox from this one's checkpoint `checkpoint`
        (a name), or, without one, from this sandbox as it is now (it is
        checkpointed and attached again first). `options` are `create`'s."""
        _check_checkpoint_name(checkpoint)
        if self._sandbox_id is None or self._sandbox_token is None:
            raise SandboxStateError("the sandbox has no id yet")
        if checkpoint is None and self._state == "running":
            await self.checkpoint(keep_running=True)
        source: dict[str, str] = {"sandbox_id": self._sandbox_id, "sandbox_token": self._sandbox_token}
        if checkpoint is not None:
            source["name"] = checkpoint
        options.setdefault("ssl", self._ssl)
        options.setdefault("use_google_auth", self._use_google_auth)
        options.setdefault("id_token", self._id_token)
        return await Sandbox.create(url or self._url, from_checkpoint=source, **options)

    # -- the end -----------------------------------------------------------------

    async def kill(self, timeout: float = 5.0) -> None:
        """Deletes the sandbox and closes the connection (waits up to
        `timeout` for the server's `SANDBOX_KILLED`)."""
        if self._state in ("closed", "failed", "checkpointed"):
            return
        self._killing = True
        self._reconnect_allowed = False
        future = self._future("kill")
        try:
            await self._send({"action": "kill_sandbox"})
            outcome = await asyncio.wait_for(future, timeout)
        except (asyncio.TimeoutError, SandboxConnectionError):
            outcome = None
        finally:
            await self._close_socket()
            self._state = "closed"
        if isinstance(outcome, SandboxError):
            raise outcome

    async def close(self) -> None:
        """Closes the connection and leaves the sandbox running (attach again
        with its id and token), until its idle timeout."""
        self._reconnect_allowed = False
        await self._close_socket()
        if self._state not in ("checkpointed", "failed"):
            self._state = "closed"

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kill()


