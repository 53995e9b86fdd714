"""The Python client's figures against a running server:

    python clients/python/bench/bench.py [ws://127.0.0.1:8080] [--rounds 200] [--mb 100]

prints the median `echo hi` round trip of the client (exec, then wait for its
end) and of a raw `websockets` client sending the same frames on its own
connection to the same server, and the throughput of a 100 MB upload and
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


async def client_round_trips(url: str, rounds: int) -> list[float]:
    async with await Sandbox.create(url) as sandbox:
        times = []
        for i in range(rounds + 10):
            started = time.perf_counter()
            process = await sandbox.exec("bash", "echo hi")
            await process.wait()
            if i >= 10:  # warm-up
                times.append(time.perf_counter() - started)
            assert process.stdout.text == "hi\n"
        return times


async def raw_round_trips(url: str, rounds: int) -> list[float]:
    async with websockets.connect(f"{url}/create", compression=None, max_size=None) as ws:
        await ws.send(json.dumps({"idle_timeout": 60}))
        while json.loads(await ws.recv()).get("status") != "SANDBOX_RUNNING":
            pass
        times = []
        for i in range(rounds + 10):
            started = time.perf_counter()
            await ws.send(EXEC)
            while json.loads(await ws.recv()).get("status") != "SANDBOX_EXECUTION_DONE":
                pass
            if i >= 10:
                times.append(time.perf_counter() - started)
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        return times


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
    # Interleaved, so both see the same load.
    client, raw = [], []
    for _ in range(2):
        raw += await raw_round_trips(args.url, args.rounds // 2)
        client += await client_round_trips(args.url, args.rounds // 2)
    ms = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(f"exec round trip (echo hi), median of {len(client)}: client {ms(client):.2f} ms, "
          f"raw websockets {ms(raw):.2f} ms, difference {ms(client) - ms(raw):+.2f} ms")
    up, down = await transfers(args.url, args.mb)
    size = args.mb * (1 << 20) / 1e6
    print(f"{args.mb} MiB ({size:.0f} MB): upload {size / up:.0f} MB/s ({up:.2f} s), "
          f"download {size / down:.0f} MB/s ({down:.2f} s), SHA-256 checked")


if __name__ == "__main__":
    asyncio.run(main())
