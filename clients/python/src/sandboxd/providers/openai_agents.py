"""sandboxd as a sandbox of the OpenAI Agents SDK (`pip install
'sandboxd[openai-agents]'`): `SandboxdSandboxClient` creates, resumes (an
attach) and deletes sandboxes; `SandboxdSandboxSession` runs commands, reads
and writes files, and persists and hydrates the workspace as a tar stream.

    from agents.sandbox import Manifest
    from sandboxd.providers.openai_agents import SandboxdSandboxClient, SandboxdSandboxClientOptions

    client = SandboxdSandboxClient()
    session = await client.create(options=SandboxdSandboxClientOptions(url="ws://127.0.0.1:8080"))
    async with session:
        result = await session.exec("echo hi")

The SDK's state of a session (`client.serialize_session_state(session.state)`)
holds the sandbox's id and token: `client.resume(state)` attaches to it again
(restoring its checkpoint, on any instance), or, if the sandbox is gone,
creates a new one whose workspace the SDK hydrates from its snapshot. The end
of `async with session` closes the connection and leaves the sandbox (until
its idle timeout); `client.delete(session)` deletes it.

PTY processes (`supports_pty()` is True): `pty_exec_start` runs a command,
on a sandboxd terminal (80 x 24) with `tty=True` or else with stdout and
stderr merged, and returns what it printed within the yield time, with its
exit code if it ended, else a process id for `pty_write_stdin` (keystrokes,
`"\\x03"` for Ctrl-C; empty to poll). Output is collected, UTF-8 carried
over and truncated to `max_output_tokens` by the SDK's own helpers. The
Shell capability then offers `write_stdin`, and runs every `exec_command`
this way.

A sandbox runs one execution at a time, and a terminal is an execution.
Commands and workspace operations run one after another; while a PTY
process is still running, it holds that execution, so another
`pty_exec_start` or an `exec` (and what the SDK builds on it: `ls`, `mkdir`,
`persist_workspace`, ...) fails at once with `ExecTransportError`, whose
message says so and names the process id and command holding it
(`context["reason"] == "sandbox_busy"`, `context["holder_process_id"]`).
Waiting instead could wait forever (a shell, a server). A process that has
ended holds nothing, even before its last output is read.
`pty_terminate_all()` (called by the SDK before a stop or shutdown) kills
them.
"""

from __future__ import annotations

import asyncio
import io
import shlex
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    PtySessionNotFoundError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
    WorkspaceWriteTypeError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session import SandboxSession, SandboxSessionState
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, User

from ..errors import SandboxError as SandboxdError
from ..errors import SandboxFileNotFoundError, SandboxNotFoundError
from ..process import SandboxProcess, SandboxStream
from ..sandbox import Sandbox

#: The workspace root: every sandboxd image has `/workspace` (owned by the
#: sandbox's user).
DEFAULT_WORKSPACE_ROOT = "/workspace"
#: Exec timeouts the SDK leaves open.
UNBOUNDED_EXEC_S = 24 * 60 * 60
#: The terminal of a `tty=True` process (the SDK's providers use 80 x 24).
PTY_COLS, PTY_ROWS = 80, 24
#: The SDK's default yield times: a start waits up to 10 s for output or the
#: end, a write 250 ms (both clamped by the SDK's helpers).
PTY_START_YIELD_MS = 10_000
PTY_WRITE_YIELD_MS = 250
#: After keystrokes, a pause for the echo and the program's answer (as the
#: SDK's Docker and E2B sessions do).
PTY_WRITE_SETTLE_S = 0.1
#: The message of the SDK's write_stdin tool for a process without stdin.
NO_STDIN = "stdin is not available for this process"


class SandboxdSandboxClientOptions(BaseSandboxClientOptions):
    """How to create a sandbox: the server's `url` and `Sandbox.create`'s options."""

    type: Literal["sandboxd"] = "sandboxd"
    url: str
    image: Optional[str] = None
    idle_timeout: Optional[int] = 3600
    network: Optional[str] = None
    #: Checkpointing (on by default): a resume restores the sandbox's memory
    #: and files on any instance.
    enable_checkpoint: bool = True
    keep_executions: bool = False
    use_google_auth: bool = False


class SandboxdSandboxSessionState(SandboxSessionState):
    """What a session's serialized state holds: where its sandbox is."""

    type: Literal["sandboxd"] = "sandboxd"
    url: str
    sandbox_id: str
    sandbox_token: str
    image: Optional[str] = None
    idle_timeout: Optional[int] = 3600
    network: Optional[str] = None
    enable_checkpoint: bool = True
    keep_executions: bool = False
    use_google_auth: bool = False


async def _create(options: SandboxdSandboxClientOptions | SandboxdSandboxSessionState) -> Sandbox:
    return await Sandbox.create(
        options.url,
        idle_timeout=options.idle_timeout,
        image=options.image,
        network=options.network,
        enable_sandbox_checkpoint=options.enable_checkpoint,
        keep_executions=options.keep_executions,
        enable_auto_reconnect=True,
        use_google_auth=options.use_google_auth,
    )


@dataclass
class _PtyProcess:
    """A process started by `pty_exec_start`: its output, merged into one
    byte queue the SDK's `collect_pty_output` drains, and its end."""

    process: SandboxProcess
    command: str
    tty: bool
    output_chunks: deque[bytes] = field(default_factory=deque)
    output_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    output_notify: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set once the process has ended and all its output is queued.
    output_closed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: Optional[int] = None
    last_used: float = field(default_factory=time.monotonic)
    pump: Optional[asyncio.Task[None]] = None

    async def _pump_stream(self, stream: SandboxStream) -> None:
        async for chunk in stream:
            async with self.output_lock:
                self.output_chunks.append(chunk.encode("utf-8"))
            self.output_notify.set()

    async def _pump(self) -> None:
        """Queues stdout and stderr (a terminal has only the first) until
        the process ends, then records its exit code and closes the output."""
        streams = [self.process.stdout] if self.tty else [self.process.stdout, self.process.stderr]
        await asyncio.gather(*(self._pump_stream(stream) for stream in streams))
        self.exit_code = await self.process.wait()
        self.output_closed.set()
        self.output_notify.set()

    def start(self) -> None:
        self.pump = asyncio.create_task(self._pump())

    @property
    def running(self) -> bool:
        return not self.process.done


class SandboxdSandboxSession(BaseSandboxSession):
    """An OpenAI Agents SDK session on one sandboxd sandbox."""

    state: SandboxdSandboxSessionState

    def __init__(self, *, state: SandboxdSandboxSessionState, sandbox: Sandbox) -> None:
        self.state = state
        self.sandbox = sandbox
        # Serializes starting executions: the sandbox runs one at a time.
        self._exec_lock = asyncio.Lock()
        self._pty_processes: dict[int, _PtyProcess] = {}

    @property
    def sandbox_id(self) -> str:
        return self.state.sandbox_id

    async def _prepare_backend_workspace(self) -> None:
        root = self.state.manifest.root
        result = await self._run(f"mkdir -p -- {shlex.quote(root)}", None, ("mkdir", root))
        if result.exit_code != 0:
            raise WorkspaceArchiveWriteError(
                path=Path(root), context={"reason": "workspace_root_setup_failed", "output": result.stderr.decode()}
            )

    def _busy_error(self, command: tuple[str | Path, ...]) -> Optional[ExecTransportError]:
        """The error for a command while a PTY process holds the sandbox's
        only execution: it fails at once rather than waiting for a process
        that may never end (a shell, a server)."""
        for process_id, entry in self._pty_processes.items():
            if entry.running:
                return ExecTransportError(
                    command=command,
                    message=(
                        "sandboxd: the sandbox runs one execution at a time, and PTY process "
                        f"{process_id} ({entry.command!r}) holds it; end that process first (make it exit "
                        "through write_stdin, or pty_terminate_all())"
                    ),
                    context={"reason": "sandbox_busy", "holder_process_id": process_id},
                    retryable=False,
                )
        return None

    async def _run(self, script: str, timeout: Optional[float], command: tuple[str | Path, ...]) -> ExecResult:
        async with self._exec_lock:
            busy = self._busy_error(command)
            if busy is not None:
                raise busy
            try:
                process = await self.sandbox.exec("bash", script)
            except SandboxdError as err:
                raise ExecTransportError(command=command, cause=err, message=f"sandboxd: {err}") from err
            try:
                exit_code = await process.wait(timeout if timeout is not None else UNBOUNDED_EXEC_S)
            except TimeoutError as err:
                await process.kill()
                raise ExecTimeoutError(command=command, timeout_s=timeout, cause=err) from err
            if exit_code is None:
                raise ExecTransportError(
                    command=command, cause=process.error, message="sandboxd: the execution ended without an exit code"
                )
            return ExecResult(
                stdout=process.stdout.text.encode("utf-8"),
                stderr=process.stderr.text.encode("utf-8"),
                exit_code=exit_code,
            )

    async def _script(self, command: tuple[str | Path, ...], *, replace_shell: bool = False) -> str:
        """A bash script running `command` in the workspace root with the
        manifest's environment (`exec`: the command becomes the process, so
        its exit code and a terminal's signals are its own)."""
        envs = await self.state.manifest.environment.resolve()
        exports = "".join(f"export {shlex.quote(f'{key}={value}')}\n" for key, value in envs.items())
        run = ("exec " if replace_shell else "") + shlex.join(str(c) for c in command)
        return f"{exports}cd {shlex.quote(self.state.manifest.root)} && {run}"

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        return await self._run(await self._script(command), timeout, command)

    # -- PTY processes -----------------------------------------------------------

    def supports_pty(self) -> bool:
        return True

    async def _start_pty_process(
        self, command: tuple[str | Path, ...], display: str, tty: bool, timeout: Optional[float]
    ) -> tuple[int, _PtyProcess]:
        script = await self._script(command, replace_shell=True)
        async with self._exec_lock:
            busy = self._busy_error(command)
            if busy is not None:
                raise busy
            try:
                process = await asyncio.wait_for(
                    self.sandbox.exec("bash", script, pty=(PTY_COLS, PTY_ROWS) if tty else None), timeout
                )
            except asyncio.TimeoutError as err:
                raise ExecTimeoutError(command=command, timeout_s=timeout, cause=err) from err
            except SandboxdError as err:
                raise ExecTransportError(command=command, cause=err, message=f"sandboxd: {err}") from err
            entry = _PtyProcess(process=process, command=display, tty=tty)
            entry.start()
            # Ended processes whose last output was collected are gone, so
            # the ids in use are those of the live one and of ended ones
            # still holding output.
            process_id = allocate_pty_process_id(set(self._pty_processes))
            self._prune_ended_pty_processes()
            self._pty_processes[process_id] = entry
        return process_id, entry

    def _prune_ended_pty_processes(self) -> None:
        """Forgets the least recently used ended processes whose last output
        nobody read, beyond the SDK's limit (only one can be running)."""
        while len(self._pty_processes) >= PTY_PROCESSES_MAX:
            meta = [(pid, entry.last_used, not entry.running) for pid, entry in self._pty_processes.items()]
            victim = process_id_to_prune_from_meta(meta)
            if victim is None or self._pty_processes[victim].running:
                return
            del self._pty_processes[victim]

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        """Starts `command` (on a terminal with `tty=True`, which
        `pty_write_stdin` can type into) and returns its output of the
        first `yield_time_s` (10 s by default), with its exit code if it
        ended by then, else its process id. `timeout` bounds the start.
        Raises `ExecTransportError` (reason `sandbox_busy`) while another
        PTY process still runs."""
        prepared = tuple(self._prepare_exec_command(*command, shell=shell, user=user))
        display = " ".join(str(c) for c in command)
        process_id, entry = await self._start_pty_process(prepared, display, tty, timeout)
        yield_ms = PTY_START_YIELD_MS if yield_time_s is None else int(yield_time_s * 1000)
        return await self._collect(process_id, entry, clamp_pty_yield_time_ms(yield_ms), max_output_tokens)

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        """Types `chars` into the process's terminal (`"\\x03"` is Ctrl-C;
        empty `chars` only polls) and returns the output that follows."""
        entry = self._resolve_pty_session_entry(pty_processes=self._pty_processes, session_id=session_id)
        if chars:
            if not entry.tty:
                # The SDK's write_stdin tool recognizes this exact message.
                raise RuntimeError(NO_STDIN)
            if entry.running:
                try:
                    await entry.process.write_to_stdin(chars)
                except SandboxdError:
                    pass  # it ended meanwhile: the collection reports its exit
            await asyncio.sleep(PTY_WRITE_SETTLE_S)
        yield_ms = PTY_WRITE_YIELD_MS if yield_time_s is None else int(yield_time_s * 1000)
        entry.last_used = time.monotonic()
        return await self._collect(
            session_id,
            entry,
            resolve_pty_write_yield_time_ms(yield_time_ms=yield_ms, input_empty=chars == ""),
            max_output_tokens,
        )

    async def _collect(
        self, process_id: int, entry: _PtyProcess, yield_time_ms: int, max_output_tokens: Optional[int]
    ) -> PtyExecUpdate:
        """The output until the yield time or the end (the SDK's helper:
        UTF-8 carried over, `max_output_tokens` truncation); an ended
        process is forgotten once its last output is returned."""
        output, original_token_count, closed = await collect_pty_output(
            output_chunks=entry.output_chunks,
            output_lock=entry.output_lock,
            output_notify=entry.output_notify,
            is_done=entry.output_closed.is_set,
            yield_time_ms=yield_time_ms,
            max_output_tokens=max_output_tokens,
        )
        if not closed:
            return PtyExecUpdate(
                process_id=process_id, output=output, exit_code=None, original_token_count=original_token_count
            )
        self._pty_processes.pop(process_id, None)
        if entry.exit_code is None:
            cause = entry.process.error
            raise ExecTransportError(
                command=(entry.command,),
                cause=cause,
                message=f"sandboxd: PTY process {process_id} ended without an exit code"
                + (f" ({cause})" if cause is not None else ""),
            )
        return PtyExecUpdate(
            process_id=None, output=output, exit_code=entry.exit_code, original_token_count=original_token_count
        )

    async def pty_terminate_all(self) -> None:
        """Kills every PTY process (its whole process tree) and forgets them."""
        entries = list(self._pty_processes.values())
        self._pty_processes.clear()
        for entry in entries:
            if entry.running:
                try:
                    await entry.process.kill()
                except SandboxdError:
                    pass  # the connection is gone: the sandbox's end ends it
            if entry.pump is not None:
                entry.pump.cancel()
                await asyncio.gather(entry.pump, return_exceptions=True)

    async def read(self, path: Path | str, *, user: str | User | None = None) -> io.IOBase:
        if user is not None:
            workspace_path = await self._check_read_with_exec(path, user=user)
        else:
            workspace_path = await self._validate_path_access(path)
        try:
            return io.BytesIO(await self.sandbox.files.read(workspace_path.as_posix()))
        except SandboxFileNotFoundError as err:
            raise WorkspaceReadNotFoundError(path=Path(str(path)), cause=err) from err
        except SandboxdError as err:
            raise WorkspaceArchiveReadError(path=Path(str(path)), cause=err) from err

    async def write(self, path: Path | str, data: io.IOBase, *, user: str | User | None = None) -> None:
        if user is not None:
            await self._check_write_with_exec(path, user=user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        if not isinstance(payload, (bytes, bytearray)):
            raise WorkspaceWriteTypeError(path=Path(str(path)), actual_type=type(payload).__name__)
        workspace_path = await self._validate_path_access(path, for_write=True)
        try:
            await self.sandbox.files.write(workspace_path.as_posix(), bytes(payload))
        except SandboxdError as err:
            raise WorkspaceArchiveWriteError(path=workspace_path, cause=err) from err

    async def running(self) -> bool:
        return self.sandbox.state == "running"

    async def persist_workspace(self) -> io.IOBase:
        """The workspace as a tar stream (members relative to the root)."""
        root = self._workspace_root_path()
        archive = f"/tmp/sandboxd-persist-{uuid.uuid4().hex}.tar"
        excludes = " ".join(
            f"--exclude={shlex.quote('./' + p.as_posix())}" for p in sorted(self._persist_workspace_skip_relpaths())
        )
        result = await self._run(
            f"tar {excludes} -C {shlex.quote(root.as_posix())} -cf {archive} .", None, ("tar", "-cf", archive)
        )
        try:
            if result.exit_code != 0:
                raise WorkspaceArchiveReadError(
                    path=root, context={"reason": "tar_failed", "output": result.stderr.decode()}
                )
            try:
                return io.BytesIO(await self.sandbox.files.read(archive))
            except SandboxdError as err:
                raise WorkspaceArchiveReadError(path=root, cause=err) from err
        finally:
            try:
                await self.sandbox.files.remove(archive)
            except SandboxdError:
                pass

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        """Extracts a tar stream of `persist_workspace` under the root."""
        root = self._workspace_root_path()
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        if not isinstance(payload, (bytes, bytearray)):
            raise WorkspaceWriteTypeError(path=root, actual_type=type(payload).__name__)
        from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes

        try:
            validate_tar_bytes(bytes(payload), allow_external_symlink_targets=False)
        except UnsafeTarMemberError as err:
            raise WorkspaceArchiveWriteError(
                path=root, context={"reason": "unsafe_or_invalid_tar", "member": err.member}, cause=err
            ) from err
        archive = f"/tmp/sandboxd-hydrate-{uuid.uuid4().hex}.tar"
        try:
            await self.sandbox.files.upload(bytes(payload), archive)
            result = await self._run(
                f"mkdir -p {shlex.quote(root.as_posix())} && tar -C {shlex.quote(root.as_posix())} -xf {archive}",
                None,
                ("tar", "-xf", archive),
            )
            if result.exit_code != 0:
                raise WorkspaceArchiveWriteError(
                    path=root, context={"reason": "tar_extract_failed", "output": result.stderr.decode()}
                )
        except SandboxdError as err:
            raise WorkspaceArchiveWriteError(path=root, cause=err) from err
        finally:
            try:
                await self.sandbox.files.remove(archive)
            except SandboxdError:
                pass

    async def _shutdown_backend(self) -> None:
        # The end of `async with session`: the connection closes and the
        # sandbox stays (a resume attaches again) until its idle timeout or
        # the client's delete().
        await self.sandbox.close()

    async def delete(self) -> None:
        """Deletes the sandbox (attaching again first if the session closed)."""
        await self.pty_terminate_all()
        if self.sandbox.state != "running":
            try:
                await self.sandbox.reattach()
            except SandboxNotFoundError:
                return
        await self.sandbox.kill()


class SandboxdSandboxClient(BaseSandboxClient[SandboxdSandboxClientOptions]):
    """Creates, resumes and deletes sandboxd sandboxes for the Agents SDK."""

    backend_id = "sandboxd"

    def __init__(
        self,
        *,
        instrumentation: Instrumentation | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        self._instrumentation = instrumentation if instrumentation is not None else Instrumentation()
        self._dependencies = dependencies

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: SandboxdSandboxClientOptions,
    ) -> SandboxSession:
        if manifest is None:
            manifest = Manifest(root=DEFAULT_WORKSPACE_ROOT)
        self._validate_manifest_for_create(manifest)
        sandbox = await _create(options)
        session_id = uuid.uuid4()
        assert sandbox.sandbox_id is not None and sandbox.sandbox_token is not None
        state = SandboxdSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            url=options.url,
            sandbox_id=sandbox.sandbox_id,
            sandbox_token=sandbox.sandbox_token,
            image=options.image,
            idle_timeout=options.idle_timeout,
            network=options.network,
            enable_checkpoint=options.enable_checkpoint,
            keep_executions=options.keep_executions,
            use_google_auth=options.use_google_auth,
        )
        inner = SandboxdSandboxSession(state=state, sandbox=sandbox)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        if not isinstance(inner, SandboxdSandboxSession):
            raise TypeError("SandboxdSandboxClient.delete expects a SandboxdSandboxSession")
        await inner.delete()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """Attaches to the state's sandbox (restoring its checkpoint, on any
        instance); if it no longer exists, creates a new one (the SDK then
        hydrates its workspace from the state's snapshot)."""
        if not isinstance(state, SandboxdSandboxSessionState):
            raise TypeError("SandboxdSandboxClient.resume expects a SandboxdSandboxSessionState")
        state.assert_path_grants_rebound()
        preserved = True
        try:
            sandbox = await Sandbox.attach(
                state.url,
                state.sandbox_id,
                state.sandbox_token,
                enable_auto_reconnect=True,
                use_google_auth=state.use_google_auth,
            )
        except SandboxNotFoundError:
            sandbox = await _create(state)
            assert sandbox.sandbox_id is not None and sandbox.sandbox_token is not None
            state.sandbox_id = sandbox.sandbox_id
            state.sandbox_token = sandbox.sandbox_token
            state.workspace_root_ready = False
            preserved = False
        inner = SandboxdSandboxSession(state=state, sandbox=sandbox)
        inner._set_start_state_preserved(preserved, system=preserved)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, SandboxdSandboxSessionState)


__all__ = [
    "DEFAULT_WORKSPACE_ROOT",
    "SandboxdSandboxClient",
    "SandboxdSandboxClientOptions",
    "SandboxdSandboxSession",
    "SandboxdSandboxSessionState",
]
