"""Files (with a 100 MB round trip), terminals, forks and rich results,
against a real server on runsc."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd import (
    Sandbox,
    SandboxDirectoryNotEmptyError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
)

#: The image with numpy, pandas and matplotlib (docs/python.md).
DATA_IMAGE = os.environ.get("SANDBOXD_DATA_IMAGE", "python-data")


async def test_files_calls_and_errors(server):
    async with await Sandbox.create(server.url) as sandbox:
        files = sandbox.files
        entry = await files.write("notes/a.txt", "alpha\n", mode=0o600)
        assert entry.path == "/home/sandbox/notes/a.txt" and entry.size == 6 and entry.mode == 0o600
        assert await files.read_text("notes/a.txt") == "alpha\n"
        assert await files.read("notes/a.txt", offset=2, length=3) == b"pha"
        await files.write("/tmp/bin.dat", bytes(range(256)))
        assert await files.read("/tmp/bin.dat") == bytes(range(256))

        directory = await files.mkdir("notes/sub/deeper", parents=True)
        assert directory.is_dir
        await files.write("notes/sub/b.txt", b"beta")
        listing = await files.list("notes", depth=2)
        assert [e.name for e in listing] == ["a.txt", "sub", "sub/b.txt", "sub/deeper"]
        assert not listing.truncated
        assert (await files.list("notes", depth=2, max_entries=2)).truncated
        stat = await files.stat("notes/sub/b.txt")
        assert stat.is_file and stat.size == 4

        moved = await files.rename("notes/a.txt", "notes/moved.txt")
        assert moved.name == "moved.txt"
        assert not await files.exists("notes/a.txt")
        # Executions see the files, and files see what executions wrote.
        process = await sandbox.exec("bash", "cat notes/moved.txt; echo made > notes/made.txt")
        assert await process.stdout.read_all() == "alpha\n"
        await process.wait()
        assert await files.read_text("notes/made.txt") == "made\n"

        with pytest.raises(SandboxFileNotFoundError) as missing:
            await files.read("notes/nope.txt")
        assert isinstance(missing.value, FileNotFoundError) and missing.value.code == "ENOENT"
        with pytest.raises(SandboxFileExistsError):
            await files.mkdir("notes")
        with pytest.raises(SandboxDirectoryNotEmptyError):
            await files.remove("notes")
        with pytest.raises(SandboxIsADirectoryError):
            await files.read("notes", offset=0, length=10)
        with pytest.raises(SandboxNotADirectoryError):
            await files.list("notes/moved.txt/x")
        with pytest.raises(SandboxFileError) as denied:
            await files.write("/etc/passwd", "x")
        assert denied.value.code == "EACCES" and isinstance(denied.value, PermissionError)
        with pytest.raises(SandboxFileError) as proc:
            await files.read("/proc/self/environ")
        assert proc.value.code in ("EACCES", "EINVAL", "ENOENT", "EPERM")
        with pytest.raises(ValueError, match="path must be a non-empty string"):
            await files.stat("")
        with pytest.raises(ValueError, match="mode"):
            await files.write("x", "y", mode=0o17777)
        with pytest.raises(TypeError, match="data must be bytes or str"):
            await files.write("x", 42)  # type: ignore[arg-type]

        await files.remove("notes", recursive=True)
        assert not await files.exists("notes")


async def test_a_100_mb_upload_and_download_keep_their_digest(server, tmp_path):
    payload = os.urandom(1 << 20) * 100  # 100 MiB
    digest = hashlib.sha256(payload).hexdigest()
    source = tmp_path / "big.bin"
    source.write_bytes(payload)
    async with await Sandbox.create(server.url) as sandbox:
        sent = await sandbox.files.upload(source, "/tmp/big.bin", mode=0o640)
        assert sent.size == len(payload) and sent.sha256 == digest
        assert sent.entry is not None and sent.entry.mode == 0o640
        process = await sandbox.exec("bash", "sha256sum /tmp/big.bin")
        assert (await process.stdout.read_all()).split()[0] == digest
        target = tmp_path / "back.bin"
        got = await sandbox.files.download("/tmp/big.bin", target)
        assert got.size == len(payload) and got.sha256 == digest
        assert hashlib.sha256(target.read_bytes()).hexdigest() == digest
        assert oct(target.stat().st_mode & 0o777) == oct(0o640)
        # Large writes and reads stream too.
        await sandbox.files.write("/tmp/two.bin", payload[: 3 << 20])
        assert await sandbox.files.read("/tmp/two.bin") == payload[: 3 << 20]
        with pytest.raises(SandboxFileNotFoundError):
            await sandbox.files.download("/tmp/none.bin", tmp_path / "none.bin")
        assert not (tmp_path / "none.bin").exists()


async def test_terminal_python_repl_follows_a_resize(server):
    async with await Sandbox.create(server.url) as sandbox:
        terminal = await sandbox.terminal(80, 24, command="python3 -i")
        await terminal.read_until(b">>> ")
        await terminal.write(b"import subprocess\n")
        await terminal.read_until(b">>> ")
        await terminal.write("print(subprocess.run(['stty', 'size'], capture_output=True, text=True).stdout)\n")
        assert b"24 80" in await terminal.read_until(b">>> ")
        await terminal.resize(132, 43)
        await terminal.write("print(subprocess.run(['stty', 'size'], capture_output=True, text=True).stdout)\n")
        assert b"43 132" in await terminal.read_until(b">>> ")
        # Raw bytes both ways: a UTF-8 character typed and echoed back.
        await terminal.write("print('caf\u00e9'.upper())\n".encode())
        assert "CAFÉ\r\n".encode() in await terminal.read_until(b">>> ")
        await terminal.write(b"exit(5)\n")
        assert await terminal.wait(30) == 5
        with pytest.raises(ValueError, match="cols must be"):
            await (await sandbox.terminal()).resize(0, 10)


def _runsc_turns_ctrl_c_into_sigint() -> bool:
    """gVisor's terminals signal the foreground process group on ^C since
    its releases of March 2023; Debian bookworm's runsc (0.0~20221219)
    passes the byte through as input."""
    try:
        out = subprocess.run(["runsc", "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    match = re.search(r"(\d{8})", out)
    return match is not None and int(match.group(1)) >= 20230301


@pytest.mark.xfail(
    not _runsc_turns_ctrl_c_into_sigint(),
    reason="this runsc's terminals do not turn ^C into SIGINT (gVisor before March 2023)",
    strict=True,
)
async def test_ctrl_c_interrupts_the_foreground_program_and_the_terminal_carries_on(server):
    async with await Sandbox.create(server.url) as sandbox:
        # A Python REPL: Ctrl-C raises KeyboardInterrupt in the running code.
        repl = await sandbox.terminal(80, 24, command="python3 -i")
        await repl.read_until(b">>> ")
        await repl.write(b"import time; time.sleep(100)\n")
        await repl.read_until(b"time.sleep(100)\r\n")
        await repl.interrupt()
        assert b"KeyboardInterrupt" in await repl.read_until(b">>> ", timeout=10)
        await repl.write(b"print(6 * 7)\n")
        assert b"42\r\n" in await repl.read_until(b">>> ")
        await repl.write(b"exit()\n")
        assert await repl.wait(30) == 0

        # A shell: Ctrl-C (written as raw bytes) ends its foreground job; the prompt returns.
        shell = await sandbox.terminal(80, 24, command="PS1='ready$ ' exec bash --norc -i")
        await shell.read_until(b"ready$ ")
        await shell.write(b"sleep 100; echo after-sleep $?\n")
        await asyncio.sleep(0.5)
        await shell.write(b"\x03")
        interrupted = await shell.read_until(b"ready$ ", timeout=10)
        assert b"after-sleep" not in interrupted.replace(b"echo after-sleep", b"")
        await shell.write(b"echo still-here\n")
        assert b"still-here\r\n" in await shell.read_until(b"ready$ ")
        await shell.write(b"exit 3\n")
        assert await shell.wait(30) == 3


async def test_fork_copies_memory_and_files_independently(server):
    async with await Sandbox.create(server.url, enable_sandbox_checkpoint=True) as source:
        await source.files.write("fork.txt", "from the source")
        await (await source.exec("python", "memory = [1, 2, 3]", session=True)).wait()
        fork = await source.fork()  # checkpoints the source, attaches it again, forks
        try:
            assert fork.sandbox_id != source.sandbox_id
            assert await fork.files.read_text("fork.txt") == "from the source"
            cell = await fork.exec("python", "memory.append(4); print(memory)", session=True)
            assert await cell.stdout.read_all() == "[1, 2, 3, 4]\n"
            cell = await source.exec("python", "print(memory)", session=True)
            assert await cell.stdout.read_all() == "[1, 2, 3]\n"
            await source.checkpoint("named", keep_running=True)
            await source.files.write("fork.txt", "changed later")
            named = await source.fork("named")
            assert await named.files.read_text("fork.txt") == "from the source"
            await named.kill()
        finally:
            await fork.kill()


async def test_labels_reach_the_sandboxs_metadata(server):
    labels = {"team": "ml", "run.id": "42"}
    async with await Sandbox.create(server.url, labels=labels) as sandbox:
        assert sandbox.labels == labels
        metadata = next(server.home.rglob(f"sandboxes/{sandbox.sandbox_id}/metadata.json"))
        assert json.loads(metadata.read_text())["spec"]["labels"] == labels
        await sandbox.kill()
    with pytest.raises(ValueError, match="labels"):
        await Sandbox.create(server.url, labels={"not a key": "x"})


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:16]
    assert png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    return width, height


async def test_run_code_returns_values_and_figures(server):
    async with await Sandbox.create(server.url, image=DATA_IMAGE) as sandbox:
        result = await sandbox.run_code("x = 20\nx * 2 + 2")
        assert result.text == "42" and result.exit_code == 0 and result.pngs == []
        assert (await sandbox.run_code("x")).text == "20"  # the session keeps globals
        assert (await sandbox.run_code("y = 1")).results == []  # an assignment shows nothing
        failed = await sandbox.run_code("1 / 0")
        assert failed.error and "ZeroDivisionError" in failed.stderr and failed.results == []

        plot = await sandbox.run_code(
            "import matplotlib.pyplot as plt\n"
            "import numpy as np\n"
            "t = np.linspace(0, 6.28, 200)\n"
            "plt.figure(figsize=(4, 3), dpi=100)\n"
            "plt.plot(t, np.sin(t))\n"
            "plt.show()\n"
            "plt.figure(figsize=(2, 2), dpi=100)\n"
            "plt.plot([1, 2], [3, 4])\n"
            "print('plotted')\n"
        )
        assert plot.exit_code == 0, plot.stderr
        assert plot.stdout == "plotted\n"
        assert len(plot.pngs) == 2  # one shown, one left open
        (w1, h1), (w2, h2) = (_png_size(png) for png in plot.pngs)
        assert 250 < w1 <= 420 and 180 < h1 <= 320, (w1, h1)
        assert 120 < w2 <= 220 and 120 < h2 <= 220, (w2, h2)
        assert all(len(png) > 2000 for png in plot.pngs)
        # Figures are handed over once: nothing is left open.
        assert (await sandbox.run_code("plt.get_fignums()")).text == "[]"

        frame = await sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        (value,) = frame.results
        assert value.kind == "execute_result"
        assert "a" in value.data["text/plain"] and "<table" in value.data["text/html"]


def test_the_quickstart_runs_and_the_docs_quote_it(server):
    """examples/quickstart.py as docs/python.md shows it, run as a user would."""
    root = Path(__file__).resolve().parents[1]
    script = (root / "examples" / "quickstart.py").read_text()
    assert f"```python\n{script}```" in (root.parents[1] / "docs" / "python.md").read_text()
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    run = subprocess.run(
        [sys.executable, str(root / "examples" / "quickstart.py"), server.url],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "file: hello from the quickstart | value: 45", run.stdout
    assert re.fullmatch(r"figure: \d+ bytes, b'\\x89PNG\\r\\n\\x1a\\n'; fork \w+ reads: hello from the quickstart", lines[1])
    assert lines[2] == "checkpoints: [('latest', 'quickstart-done'), ('named', 'quickstart-done'), ('previous', None)]"
