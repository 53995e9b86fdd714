"""The core calls against a real server on runsc: create, exec with streams,
stdin, exit codes, kill, attach, checkpoints (named too), snapshots,
reconnect, Google auth headers, and every error the server reports."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

import sandboxd
from sandboxd import (
    Sandbox,
    SandboxCheckpointError,
    SandboxCreationError,
    SandboxExecutionError,
    SandboxExecutionInProgressError,
    SandboxInUseError,
    SandboxNotFoundError,
    SandboxRestoreError,
    SandboxStateError,
    SandboxUnsupportedLanguageError,
)


async def test_exec_streams_stdin_exit_codes_and_kill(server):
    async with await Sandbox.create(server.url) as sandbox:
        assert len(sandbox.sandbox_id) == 32 and len(sandbox.sandbox_token) == 64
        assert sandbox.state == "running"

        process = await sandbox.exec("bash", "echo hi; echo err >&2; exit 3")
        assert await process.stdout.read_all() == "hi\n"
        assert await process.stderr.read_all() == "err\n"
        assert await process.wait() == 3
        assert process.exit_code == 3

        process = await sandbox.exec("python", "import sys\nprint(input()[::-1])\nsys.exit(int(input()))")
        await process.write_to_stdin("olleh\n")
        await process.write_to_stdin("7\n")
        chunks = [chunk async for chunk in process.stdout]
        assert "".join(chunks) == "hello\n"
        assert await process.wait() == 7

        process = await sandbox.exec("bash", "echo started; sleep 60")
        assert (await anext(aiter(process.stdout))) == "started\n"
        with pytest.raises(SandboxStateError, match="Another process"):
            await sandbox.exec("bash", "true")
        await process.kill()
        assert process.done and process.killed
        assert process.exit_code == 137

        with pytest.raises(SandboxUnsupportedLanguageError, match="Unsupported language: 'ruby'") as refused:
            await sandbox.exec("ruby", "puts 1")
        assert isinstance(refused.value, SandboxExecutionError)
        assert refused.value.status == "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR"

        # Python session cells keep their globals.
        cell = await sandbox.exec("python", "counter = 41", session=True)
        assert await cell.wait() == 0
        cell = await sandbox.exec("python", "counter += 1\nprint(counter)", session=True)
        assert await cell.stdout.read_all() == "42\n"
    assert sandbox.state == "closed"
    with pytest.raises(SandboxStateError, match="not in a running state"):
        await sandbox.exec("bash", "true")


async def test_client_side_errors_are_clear(server):
    with pytest.raises(ValueError, match="idle_timeout"):
        await Sandbox.create(server.url, idle_timeout=-1)
    with pytest.raises(ValueError, match="network"):
        await Sandbox.create(server.url, network="internet")
    with pytest.raises(ValueError, match="url must start with"):
        await Sandbox.create("ftp://example")
    with pytest.raises(sandboxd.SandboxConnectionError, match="Failed to connect"):
        await Sandbox.create("ws://127.0.0.1:1")
    async with await Sandbox.create(server.url) as sandbox:
        with pytest.raises(ValueError, match="invalid checkpoint name"):
            await sandbox.checkpoint("Not A Name")
        with pytest.raises(TypeError, match="code must be str"):
            await sandbox.exec("bash", b"echo")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="results=True needs"):
            await sandbox.exec("bash", "echo", results=True)
        with pytest.raises(ValueError, match="cols must be"):
            await sandbox.exec("bash", "echo", pty=(0, 10))


async def test_server_refusals_become_typed_errors(server):
    with pytest.raises(SandboxCreationError, match='no sandbox image "no-such-image"'):
        await Sandbox.create(server.url, image="no-such-image")
    with pytest.raises(SandboxCreationError, match="requires checkpointing"):
        await Sandbox.create(server.url, keep_executions=True)
    with pytest.raises(SandboxCreationError, match="egress is not enabled"):
        await Sandbox.create(server.url, network="egress")
    with pytest.raises(SandboxCreationError, match="Sandbox handoff requires checkpointing"):
        await Sandbox.create(server.url, enable_sandbox_handoff=True)
    with pytest.raises(SandboxNotFoundError):
        await Sandbox.attach(server.url, "0" * 32, "0" * 64)
    async with await Sandbox.create(server.url) as sandbox:
        # A wrong token is answered as an unknown id: it learns nothing.
        with pytest.raises(SandboxNotFoundError):
            await Sandbox.attach(server.url, sandbox.sandbox_id, "f" * 64)
        with pytest.raises(SandboxInUseError):
            await Sandbox.attach(server.url, sandbox.sandbox_id, sandbox.sandbox_token)
        # A fork of a sandbox without checkpoints.
        with pytest.raises(SandboxCreationError, match="checkpoint"):
            await sandbox.fork("nothing-here")


async def test_named_checkpoints_attach_and_refusals(server):
    sandbox = await Sandbox.create(server.url, enable_sandbox_checkpoint=True)
    sandbox_id, token = sandbox.sandbox_id, sandbox.sandbox_token
    await (await sandbox.exec("bash", "echo one > /tmp/state")).wait()
    await (await sandbox.exec("python", "answer = 1", session=True)).wait()

    running = await sandbox.exec("bash", "sleep 30")
    with pytest.raises(SandboxExecutionInProgressError) as busy:
        await sandbox.checkpoint()
    assert isinstance(busy.value, SandboxCheckpointError)
    await running.kill()

    await sandbox.checkpoint("first")
    assert sandbox.state == "checkpointed"
    await sandbox.kill()  # no-op after a checkpoint, as in the official client

    again = await Sandbox.attach(server.url, sandbox_id, token)
    process = await again.exec("bash", "cat /tmp/state; echo two > /tmp/state")
    assert await process.stdout.read_all() == "one\n"
    cell = await again.exec("python", "print(answer); answer = 2", session=True)
    assert await cell.stdout.read_all() == "1\n"
    # keep_running: checkpointed, then attached again in one call.
    await again.checkpoint("second", keep_running=True)
    assert again.state == "running"
    await again.checkpoint()

    with pytest.raises(SandboxRestoreError, match="no checkpoint named"):
        await Sandbox.attach(server.url, sandbox_id, token, checkpoint="nope")
    first = await Sandbox.attach(server.url, sandbox_id, token, checkpoint="first")
    process = await first.exec("bash", "cat /tmp/state")
    assert await process.stdout.read_all() == "one\n"
    cell = await first.exec("python", "print(answer)", session=True)
    assert await cell.stdout.read_all() == "1\n"
    history = await _history(first, {"first", "second"})
    assert [c.role for c in history].count("latest") == 1
    assert history == sorted(history, key=lambda c: c.created_at, reverse=True)
    assert all(c.size > 0 and c.checkpoint_id for c in history)
    await first.kill()
    with pytest.raises(SandboxNotFoundError):
        await Sandbox.attach(server.url, sandbox_id, token)
    with pytest.raises(SandboxNotFoundError):
        await first.checkpoints()


async def _history(sandbox, names):
    """The history once it names `names` (the store records a checkpoint's
    name right after the checkpoint)."""
    for _ in range(50):
        history = await sandbox.checkpoints()
        if names <= {c.name for c in history if c.role == "named"}:
            return history
        await asyncio.sleep(0.2)
    raise AssertionError(f"the history never named {names}: {history}")


async def test_filesystem_snapshot_and_create_from_it(server):
    async with await Sandbox.create(server.url) as source:
        await (await source.exec("bash", "echo kept > /home/sandbox/snap.txt")).wait()
        name = f"snap-{source.sandbox_id[:8]}"
        snapshot = await source.snapshot_filesystem(name)
        assert snapshot.name == name and snapshot.token
        with pytest.raises(sandboxd.SandboxFilesystemSnapshotError):
            await source.snapshot_filesystem("bad name/with slash")
        assert source.state == "running"
    # The earlier clients' call: the name alone (this process took it).
    async with await Sandbox.create(server.url, filesystem_snapshot_name=name) as copy:
        process = await copy.exec("bash", "cat /home/sandbox/snap.txt")
        assert await process.stdout.read_all() == "kept\n"


async def test_reconnect_continues_the_output(server, proxy):
    sandbox = await Sandbox.create(proxy.url, enable_auto_reconnect=True)
    try:
        process = await sandbox.exec("bash", "for i in $(seq 1 30); do echo line $i; sleep 0.1; done")
        seen = ""
        async for chunk in process.stdout:
            seen += chunk
            if "line 5\n" in seen and len(proxy.requests) == 1:
                proxy.cut()  # the front end drops the stream (Cloud Run's timeout)
        assert seen == "".join(f"line {i}\n" for i in range(1, 31))
        assert await process.wait() == 0
        assert len(proxy.requests) >= 2, "the client never reconnected"
        assert proxy.requests[1].startswith(f"GET /attach/{sandbox.sandbox_id}?sandbox_token=")
        # And the sandbox is usable afterwards.
        process = await sandbox.exec("bash", "echo after")
        assert await process.stdout.read_all() == "after\n"
    finally:
        await sandbox.kill()


async def test_google_auth_sends_a_bearer_token_the_server_accepts(server, proxy, monkeypatch):
    fetched: list[str] = []

    def fake_fetch(url: str) -> str:
        # Stands in for Application Default Credentials (no Google account here).
        fetched.append(url)
        return f"id-token-{len(fetched)}"

    monkeypatch.setattr(sandboxd.auth, "fetch_id_token", fake_fetch)
    sandbox = await Sandbox.create(proxy.url, use_google_auth=True, enable_sandbox_checkpoint=True)
    process = await sandbox.exec("bash", "echo authed")
    assert await process.stdout.read_all() == "authed\n"
    await sandbox.checkpoint()
    attached = await Sandbox.attach(proxy.url, sandbox.sandbox_id, sandbox.sandbox_token, use_google_auth=True)
    await attached.kill()
    assert fetched == [proxy.url, proxy.url]
    assert "Authorization: Bearer id-token-1" in proxy.requests[0].replace("authorization", "Authorization")
    assert "Authorization: Bearer id-token-2" in proxy.requests[1].replace("authorization", "Authorization")
    assert sandboxd.auth.audience_for("wss://svc-abc.a.run.app/x") == "https://svc-abc.a.run.app"


async def test_results_are_never_sent_unasked(server):
    """An earlier client's session cell gets no `result` events."""
    async with websockets.connect(f"{server.url}/create") as ws:
        await ws.send(json.dumps({"idle_timeout": 60}))
        while json.loads(await ws.recv()).get("status") != "SANDBOX_RUNNING":
            pass
        await ws.send(json.dumps({"language": "python", "code": "1 + 1", "session": True}))
        events = []
        while True:
            frame = json.loads(await ws.recv())
            events.append(frame)
            if frame.get("status") == "SANDBOX_EXECUTION_DONE":
                break
        assert [e for e in events if e.get("event") == "result"] == []
        await ws.send(json.dumps({"language": "bash", "code": "true", "results": True}))
        frame = json.loads(await ws.recv())
        assert frame["event"] == "error" and "results" in frame["message"], frame
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            while True:
                await ws.recv()


def test_sync_facade(server):
    from sandboxd.sync import Sandbox as SyncSandbox

    with SyncSandbox.create(server.url) as sandbox:
        process = sandbox.exec("bash", "echo sync; exit 4")
        assert process.stdout.read_all() == "sync\n"
        assert process.wait() == 4
        sandbox.files.write("sync.txt", "hello")
        assert sandbox.files.read_text("sync.txt") == "hello"
        assert sandbox.run_code("6 * 7").text == "42"
