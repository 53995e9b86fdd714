"""The Python client's figures against a running server:

    python clients/python/bench/bench.py [ws://127.0.0.1:8080] [--rounds 200] [--mb 100]

prints the median `echo hi` round trip of the client (exec, then wait for its
end) and of a raw `websockets` client sending the same frames, taking turns
on one sandbox (blocks of 20 rounds), and the throughput of a 100 MB upload and
download through `sandbox.files` (digests checked on both sides)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import time

import websockets

from sandboxd import Sandbox

EXEC = json.dumps({"language": "bash", "code": "echo hi"})


async def round_trips(url: str, rounds: int, block: int = 20) -> tuple[list[float], list[float]]:
    """(client, raw) round trips on one sandbox: the client and a raw
    `websockets` connection take turns attaching to it, `block` rounds
    each, so both see the same sandbox and the same load."""
    sandbox = await Sandbox.create(url)
    sandbox_id, token = sandbox.sandbox_id, sandbox.sandbox_token
    client: list[float] = []
    raw: list[float] = []
    try:
        while len(client) < rounds:
            if sandbox.state != "running":
                await sandbox.reattach()
            for i in range(block + 2):
                started = time.perf_counter()
                process = await sandbox.exec("bash", "echo hi")
                await process.wait()
                if i >= 2:  # warm-up after each attach
                    client.append(time.perf_counter() - started)
                assert process.stdout.text == "hi\n"
            await sandbox.close()
            attach = f"{url}/attach/{sandbox_id}?sandbox_token={token}"
            for _ in range(50):  # until the server has seen the client go
                ws = await websockets.connect(attach, compression=None, max_size=None)
                if json.loads(await ws.recv()).get("status") == "SANDBOX_RUNNING":
                    break
                await ws.close()
                await asyncio.sleep(0.05)
            for i in range(block + 2):
                started = time.perf_counter()
                await ws.send(EXEC)
                while json.loads(await ws.recv()).get("status") != "SANDBOX_EXECUTION_DONE":
                    pass
                if i >= 2:
                    raw.append(time.perf_counter() - started)
            await ws.close()
            await asyncio.sleep(0.2)
    finally:
        if sandbox.state != "running":
            await sandbox.reattach()
        await sandbox.kill()
    return client[:rounds], raw[:rounds]


async def transfers(url: str, megabytes: int) -> tuple[float, float]:
    payload = os.urandom(1 << 20) * megabytes
    digest = hashlib.sha256(payload).hexdigest()
    async with await Sandbox.create(url) as sandbox:
        started = time.perf_counter()
        sent = await sandbox.files.upload(payload, "/tmp/bench.bin")
        up = time.perf_counter() - started
        started = time.perf_counter()
        got = await sandbox.files.download("/tmp/bench.bin")
        down = time.perf_counter() - started
        assert sent.sha256 == digest and got.sha256 == digest and got.data == payload
    return up, down


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="?", default="ws://127.0.0.1:8080")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    client, raw = await round_trips(args.url, args.rounds)
    ms = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(f"exec round trip (echo hi) on one sandbox, median of {len(client)} rounds each (alternating "
          f"blocks of 20): client {ms(client):.2f} ms, raw websockets {ms(raw):.2f} ms, "
          f"difference {ms(client) - ms(raw):+.2f} ms")
    up, down = await transfers(args.url, args.mb)
    size = args.mb * (1 << 20) / 1e6
    print(f"{args.mb} MiB ({size:.0f} MB): upload {size / up:.0f} MB/s ({up:.2f} s), "
          f"download {size / down:.0f} MB/s ({down:.2f} s), SHA-256 checked")


if __name__ == "__main__":
    asyncio.run(main())
