"""Both providers driven through their framework's own interfaces (the real
packages from PyPI), against a real server on runsc."""

from __future__ import annotations

import io
import re
import tarfile
import time
from pathlib import Path

import pytest


async def test_openai_agents_sandbox_client_and_session(server):
    from agents.sandbox.entries import File
    from agents.sandbox.errors import WorkspaceReadNotFoundError
    from agents.sandbox.manifest import Manifest
    from agents.sandbox.session.sandbox_client import BaseSandboxClient
    from agents.sandbox.session.base_sandbox_session import BaseSandboxSession

    from sandboxd.providers.openai_agents import (
        SandboxdSandboxClient,
        SandboxdSandboxClientOptions,
        SandboxdSandboxSession,
        SandboxdSandboxSessionState,
    )

    assert issubclass(SandboxdSandboxClient, BaseSandboxClient)
    assert issubclass(SandboxdSandboxSession, BaseSandboxSession)
    client = SandboxdSandboxClient()
    options = SandboxdSandboxClientOptions(url=server.url)
    # Options round-trip through the SDK's polymorphic parser.
    assert BaseSandboxClientOptionsParse(options.model_dump()) == options

    manifest = Manifest(root="/workspace", entries={"hello.txt": File(content=b"from the manifest\n")})
    session = await client.create(manifest=manifest, options=options)
    async with session:
        assert await session.running()
        result = await session.exec("cat hello.txt && pwd && echo err >&2 && exit 3")
        assert result.stdout == b"from the manifest\n/workspace\n"
        assert result.stderr == b"err\n" and result.exit_code == 3
        await session.write(Path("notes/plan.md"), io.BytesIO(b"# plan\n"))
        assert (await session.read(Path("notes/plan.md"))).read() == b"# plan\n"
        with pytest.raises(WorkspaceReadNotFoundError):
            await session.read(Path("missing.txt"))
        await session.mkdir(Path("made/deep"), parents=True)
        names = sorted(entry.path for entry in await session.ls(Path(".")))
        assert any(name.endswith("notes") for name in names), names

        # Persist: a tar stream of the workspace, members relative to its root.
        archive = (await session.persist_workspace()).read()
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            members = set(tar.getnames())
        assert {"./hello.txt", "./notes/plan.md"} <= members, members

        # Resume from the serialized state: an attach to the same sandbox.
        payload = client.serialize_session_state(session.state)
        assert payload["type"] == "sandboxd" and payload["sandbox_id"] == session.state.sandbox_id

    # After the context (stop without delete), the state still resumes.
    state = client.deserialize_session_state(payload)
    assert isinstance(state, SandboxdSandboxSessionState)
    assert session._inner.sandbox.state == "closed"
    resumed = await client.resume(state)
    async with resumed:
        assert (await resumed.read(Path("notes/plan.md"))).read() == b"# plan\n"
        assert resumed.state.sandbox_id == payload["sandbox_id"]

        # Hydrate a fresh sandbox from the tar stream.
        fresh = await client.create(options=options)
        async with fresh:
            await fresh.hydrate_workspace(io.BytesIO(archive))
            assert (await fresh.read(Path("hello.txt"))).read() == b"from the manifest\n"
            assert (await fresh.exec("cat notes/plan.md")).stdout == b"# plan\n"
            await client.delete(fresh)
            assert not await fresh.running()
        await client.delete(resumed)

    # A resume of a deleted sandbox creates a replacement.
    replacement = await client.resume(client.deserialize_session_state(payload))
    assert replacement.state.sandbox_id != payload["sandbox_id"]
    await client.delete(replacement)


async def _polled_until(session, process_id: int, wanted: bytes, output: bytes, within_s: float = 60) -> bytes:
    """`output` and what the running process prints next, polled (empty
    writes) until `wanted` is in it: what an agent does when a yield ended
    before the program answered, as it may on a loaded machine."""
    deadline = time.monotonic() + within_s
    while wanted not in output:
        assert time.monotonic() < deadline, f"no {wanted!r} within {within_s} s: {output!r}"
        update = await session.pty_write_stdin(session_id=process_id, chars="")
        assert update.exit_code is None, (update, output)
        output += update.output
    return output


async def test_openai_agents_pty_processes(server):
    """The SDK's PTY interface: a REPL on a terminal typed into, its exit
    code; a command without a terminal; the one-execution limit; terminate."""
    from agents.sandbox.errors import ExecTransportError, PtySessionNotFoundError

    from sandboxd.providers.openai_agents import SandboxdSandboxClient, SandboxdSandboxClientOptions

    client = SandboxdSandboxClient()
    session = await client.create(options=SandboxdSandboxClientOptions(url=server.url))
    async with session:
        assert session.supports_pty()

        # A Python REPL on a terminal: output until the prompt, typed input, exit code.
        started = await session.pty_exec_start("python3 -i -q", tty=True, yield_time_s=3)
        repl = started.process_id
        assert repl is not None and started.exit_code is None
        await _polled_until(session, repl, b">>> ", started.output)
        update = await session.pty_write_stdin(session_id=repl, chars="print(6 * 7)\n", yield_time_s=1)
        assert update.process_id == repl and update.exit_code is None
        await _polled_until(session, repl, b"42\r\n", update.output)

        # While it runs, it holds the sandbox's only execution: other starts and execs fail at once.
        with pytest.raises(ExecTransportError, match=f"one execution at a time.*PTY process {repl}") as busy:
            await session.exec("true")
        assert busy.value.context["reason"] == "sandbox_busy" and busy.value.context["holder_process_id"] == repl
        with pytest.raises(ExecTransportError, match="python3 -i -q"):
            await session.pty_exec_start("echo hi", tty=True)

        # A yield ends at the process's end: a long one costs nothing here.
        done = await session.pty_write_stdin(session_id=repl, chars="exit(7)\n", yield_time_s=30)
        assert done.exit_code == 7 and done.process_id is None
        with pytest.raises(PtySessionNotFoundError):
            await session.pty_write_stdin(session_id=repl, chars="")
        assert (await session.exec("echo free")).stdout == b"free\n"

        # Without a terminal: stdout and stderr merged, in the workspace root, no stdin.
        quick = await session.pty_exec_start("pwd; echo err >&2; exit 3", yield_time_s=30)
        assert quick.exit_code == 3 and quick.process_id is None
        assert b"/workspace\n" in quick.output and b"err\n" in quick.output
        slow = await session.pty_exec_start("echo begin; sleep 2; echo end", yield_time_s=0.5)
        assert slow.process_id is not None and slow.exit_code is None
        with pytest.raises(RuntimeError, match="stdin is not available for this process"):
            await session.pty_write_stdin(session_id=slow.process_id, chars="x")
        polled = await session.pty_write_stdin(session_id=slow.process_id, chars="", yield_time_s=30)
        assert slow.output + polled.output == b"begin\nend\n" and polled.exit_code == 0 and polled.process_id is None

        # max_output_tokens truncates as the SDK's helper does.
        long = await session.pty_exec_start("seq 1 5000", yield_time_s=30, max_output_tokens=20)
        assert long.exit_code == 0 and long.original_token_count is not None and long.original_token_count > 20
        assert len(long.output) < 400 and b"truncated" in long.output.lower(), long.output

        # A bash on a terminal ended by pty_terminate_all; the sandbox is free again.
        shell = await session.pty_exec_start("bash --norc -i", tty=True, yield_time_s=1)
        assert shell.process_id is not None
        await session.pty_terminate_all()
        with pytest.raises(PtySessionNotFoundError):
            await session.pty_write_stdin(session_id=shell.process_id, chars="echo hi\n")
        assert (await session.exec("echo after")).stdout == b"after\n"

        # The Shell capability's tools (what an agent calls) go through the same interface.
        from agents.sandbox.capabilities.tools.shell_tool import (
            ExecCommandArgs,
            ExecCommandTool,
            WriteStdinArgs,
            WriteStdinTool,
        )

        exec_tool, stdin_tool = ExecCommandTool(session=session), WriteStdinTool(session=session)
        opened = await exec_tool.run(ExecCommandArgs(cmd="python3 -i -q", tty=True, yield_time_ms=3000))
        match = re.search(r"Process running with session ID (\d+)", opened)
        assert match is not None, opened
        deadline = time.monotonic() + 60
        while ">>> " not in opened:
            assert time.monotonic() < deadline, opened
            opened += await stdin_tool.run(WriteStdinArgs(session_id=int(match.group(1)), chars=""))
        answer = await stdin_tool.run(WriteStdinArgs(session_id=int(match.group(1)), chars="exit(4)\n", yield_time_ms=30000))
        assert "Process exited with code 4" in answer, answer
        await client.delete(session)


def BaseSandboxClientOptionsParse(payload):
    from agents.sandbox.session.sandbox_client import BaseSandboxClientOptions

    return BaseSandboxClientOptions.parse(payload)


def test_deepagents_backend(server):
    from deepagents.backends.protocol import SandboxBackendProtocol
    from deepagents.backends.sandbox import BaseSandbox

    from sandboxd.providers.deepagents import SandboxdSandbox

    backend = SandboxdSandbox.create(server.url)
    try:
        assert isinstance(backend, BaseSandbox) and isinstance(backend, SandboxBackendProtocol)
        assert len(backend.id) == 32
        response = backend.execute("echo out; echo err >&2; exit 2")
        assert response.output == "out\nerr\n" and response.exit_code == 2
        timed_out = backend.execute("sleep 30", timeout=1)
        assert timed_out.exit_code == 124 and "timed out" in timed_out.output

        uploaded = backend.upload_files([("/home/sandbox/app/main.py", b"print('hi')\n"), ("relative.txt", b"x")])
        assert [u.error for u in uploaded] == [None, "invalid_path"]
        downloaded = backend.download_files(["/home/sandbox/app/main.py", "/home/sandbox/none", "/etc/shadow"])
        assert downloaded[0].content == b"print('hi')\n"
        assert [d.error for d in downloaded] == [None, "file_not_found", "permission_denied"]

        # Deep Agents' own file tools, built on execute/upload/download.
        written = backend.write("/home/sandbox/app/notes.txt", "one\ntwo\nthree\n")
        assert written.error is None, written
        read = backend.read("/home/sandbox/app/notes.txt")
        assert "two" in str(read), read
        edited = backend.edit("/home/sandbox/app/notes.txt", "two", "TWO")
        assert edited.error is None, edited
        assert backend.download_files(["/home/sandbox/app/notes.txt"])[0].content == b"one\nTWO\nthree\n"
        listing = backend.ls("/home/sandbox/app")
        assert "main.py" in str(listing) and "notes.txt" in str(listing), listing
        found = backend.grep("TWO", path="/home/sandbox/app")
        assert "notes.txt" in str(found), found
        globbed = backend.glob("*.py", path="/home/sandbox/app")
        assert "main.py" in str(globbed), globbed
        assert backend.execute("python3 /home/sandbox/app/main.py").output == "hi\n"
    finally:
        backend.kill()
