#!/usr/bin/env python3
"""What waiting WebSockets make the server hold (docs/benchmarks.md).

Starts BINARY (`sandboxd`, local store, needs root and runsc) with room for
one sandbox, creates that sandbox and stays attached (so nothing can be
evicted), then opens --sockets `/create` sockets: each sends its init
message (all at once, once every socket is open), waits in admission (the
instance is full: with nothing to evict, a create is refused about two
seconds into its wait), and sends --frames text frames of 1 MiB meanwhile. The server
reads a waiting socket (to answer its pings) and keeps the frames it reads
for the session. Prints the server's resident memory (VmRSS) before, the
highest sampled while the sockets wait, and its peak (VmHWM).

    python3 scripts/early-frames-flood.py target/release/sandboxd --sockets 200
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import websockets

FRAME = 1 << 20


def memory_mb(pid, field):
    with open("/proc/%d/status" % pid) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no %s for pid %d" % (field, pid))


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(url, server, log):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit("the server exited: " + open(log).read()[-2000:])
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit("the server was not ready within 60 s: " + open(log).read()[-2000:])


async def status_until(ws, wanted):
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("status") == wanted:
            return
        if "ERROR" in frame.get("status", ""):
            raise RuntimeError("the server answered %s" % frame)


async def waiter(ws, frames, sent):
    await ws.send(json.dumps({"idle_timeout": 60}))
    payload = "x" * FRAME
    for _ in range(frames):
        await ws.send(payload)
        sent.append(1)


async def flood(url, pid, sockets, frames, settle):
    holder = await websockets.connect(url + "/create")
    await holder.send(json.dumps({"idle_timeout": 300}))
    await status_until(holder, "SANDBOX_RUNNING")
    await asyncio.sleep(2)
    before = memory_mb(pid, "VmRSS")
    peak_before = memory_mb(pid, "VmHWM")
    # Every socket is open before any sends its init, so that they all
    # wait at once (a create that finds nothing to evict is refused about
    # two seconds into its wait).
    opened = await asyncio.gather(
        *(websockets.connect(url + "/create", max_size=None) for _ in range(sockets)))
    sent = []
    tasks = [asyncio.create_task(waiter(ws, frames, sent)) for ws in opened]
    # Sends the server does not read stay in the sockets' buffers: the
    # senders are not awaited; the server's memory is sampled meanwhile.
    highest = before
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline:
        highest = max(highest, memory_mb(pid, "VmRSS"))
        await asyncio.sleep(0.05)
    peak = memory_mb(pid, "VmHWM")
    figures = {
        "sockets": sockets,
        "frames_sent_mb": len(sent),
        "rss_before_mb": round(before, 1),
        "highest_rss_sampled_mb": round(highest, 1),
        "peak_rss_before_mb": round(peak_before, 1),
        "peak_rss_mb": round(peak, 1),
        "peak_growth_per_socket_mb": round((peak - before) / sockets, 2),
    }
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(ws.close() for ws in opened), return_exceptions=True)
    await holder.close()
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--sockets", type=int, default=200)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--settle", type=float, default=4.0)
    parser.add_argument("--extra", default="", help="more server flags, space-separated")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="early-frames-")
    port = free_port()
    url = "http://127.0.0.1:%d" % port
    log = os.path.join(home, "sandboxd.log")
    env = dict(os.environ, SANDBOXD_DATA_DIR=os.path.join(home, "data"), LOG_LEVEL="warn")
    # Room for one sandbox of 256 MiB (and its session's buffers, 60 MiB,
    # where the server counts them): the second create waits in admission.
    command = [args.binary, "serve", "--listen", "127.0.0.1:%d" % port, "--instance-id", "flood",
               "--runtime-dir", os.path.join(home, "run"), "--warm-pool", "0",
               "--memory-capacity-mb", "828", "--memory-reserve-mb", "512",
               "--sandbox-memory-mb", "256", "--admission-wait-s", "120",
               "--max-sandboxes-per-caller", "100000"] + args.extra.split()
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_ready(url, server, log)
        ws_url = url.replace("http", "ws", 1)
        figures = asyncio.run(flood(ws_url, server.pid, args.sockets, args.frames, args.settle))
        print(json.dumps(figures))
    finally:
        server.kill()
        server.wait()
        # A killed server leaves its sandbox running: delete it.
        root = ["runsc", "--root", os.path.join(home, "run", "runsc")]
        listed = subprocess.run(root + ["list", "--format", "json"], capture_output=True)
        for container in json.loads(listed.stdout or b"[]") or []:
            subprocess.run(root + ["delete", "--force", container["id"]],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
