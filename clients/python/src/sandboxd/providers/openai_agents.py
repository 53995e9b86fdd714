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

A sandbox runs one execution at a time: the session runs its commands one
after another. The SDK's PTY sessions are not offered (`supports_pty()` is
False): a long-lived terminal would hold the sandbox's only execution.
"""

from __future__ import annotations

import asyncio
import io
import shlex
import uuid
from pathlib import Path
from typing import Literal, Optional

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
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
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, User

from ..errors import SandboxError as SandboxdError
from ..errors import SandboxFileNotFoundError, SandboxNotFoundError
from ..sandbox import Sandbox

#: The workspace root: every sandboxd image has `/workspace` (owned by the
#: sandbox's user).
DEFAULT_WORKSPACE_ROOT = "/workspace"
#: Exec timeouts the SDK leaves open.
UNBOUNDED_EXEC_S = 24 * 60 * 60


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


class SandboxdSandboxSession(BaseSandboxSession):
    """An OpenAI Agents SDK session on one sandboxd sandbox."""

    state: SandboxdSandboxSessionState

    def __init__(self, *, state: SandboxdSandboxSessionState, sandbox: Sandbox) -> None:
        self.state = state
        self.sandbox = sandbox
        self._exec_lock = asyncio.Lock()

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

    async def _run(self, script: str, timeout: Optional[float], command: tuple[str | Path, ...]) -> ExecResult:
        async with self._exec_lock:
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

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        envs = await self.state.manifest.environment.resolve()
        exports = "".join(f"export {shlex.quote(f'{key}={value}')}\n" for key, value in envs.items())
        script = f"{exports}cd {shlex.quote(self.state.manifest.root)} && {shlex.join(str(c) for c in command)}"
        return await self._run(script, timeout, command)

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
