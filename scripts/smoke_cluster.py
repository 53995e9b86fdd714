"""The podman side of the container smoke test (scripts/smoke-container.py):
failing a step, running a command, an HTTP probe, and the cluster (a bridge
network, fake-gcs-server and the image's instances, removed on exit). Kept
apart from the smoke steps so each file holds one concern."""

import ipaddress
import json
import os
import re
import resource
import subprocess
import time
import urllib.error
import urllib.request


class SmokeFailure(Exception):
    """A step did not happen as the image and the service promise."""


def fail(message):
    raise SmokeFailure(message)


def need(condition, message):
    if not condition:
        fail(message)


def run(args, check=True, timeout=120):
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        fail(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def http_get(url, timeout=5, headers=None):
    """(status, parsed JSON or text); status 0 when nothing answers."""
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as err:
        body, status = err.read().decode(), err.code
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


class Cluster:
    """The bridge network, the emulator and the instances; removed on exit."""

    def __init__(self, image, emulator_binary, subnet):
        self.image = image
        self.emulator_binary = emulator_binary
        self.subnet = ipaddress.ip_network(subnet)
        self.tag = f"sandboxd-smoke-{os.getpid()}"
        self.network = None
        self.containers = []
        hosts = list(self.subnet.hosts())
        self.emulator_ip = str(hosts[1])
        self.instance_ips = [str(hosts[10]), str(hosts[11])]
        # podman runs conmon, and so the container's runc, with RLIMIT_NPROC
        # 32768 here, and without CAP_SYS_RESOURCE runc cannot raise a limit:
        # ask for what the host allows instead of podman's defaults (1048576
        # open files, 4194304 processes), which fail with "setrlimit:
        # operation not permitted" (docs/decisions/0011).
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
        self.ulimits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]

    @staticmethod
    def remove_stale():
        """Containers and networks of earlier runs that were killed (their
        process is gone): they would hold the subnet."""

        def dead(name):
            match = re.match(r"sandboxd-smoke-(\d+)", name)
            if not match:
                return False
            try:
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False

        names = run(["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()
        for name in filter(dead, names):
            run(["podman", "rm", "-f", "-t", "0", name], check=False)
        for name in filter(dead, run(["podman", "network", "ls", "--format", "{{.Name}}"]).stdout.split()):
            run(["podman", "network", "rm", "-f", name], check=False)

    def create_network(self):
        self.remove_stale()
        for route in run(["ip", "-o", "route"]).stdout.splitlines():
            dest = route.split()[0]
            if dest != "default" and "/" in dest and ipaddress.ip_network(dest, strict=False).overlaps(self.subnet):
                fail(f"the smoke network {self.subnet} overlaps a route of this host ({route}); "
                     "another smoke run, or pass --subnet")
        run(["podman", "network", "create", "--subnet", str(self.subnet), self.tag])
        self.network = self.tag

    def start_emulator(self, bucket):
        name = f"{self.tag}-gcs"
        run(["podman", "run", "-d", "--name", name, "--runtime", "runc", *self.ulimits,
             "--network", self.network, "--ip", self.emulator_ip,
             "-v", f"{self.emulator_binary}:/usr/local/bin/fake-gcs-server:ro",
             "--entrypoint", "/usr/local/bin/fake-gcs-server", self.image,
             "-scheme", "http", "-backend", "memory", "-host", "0.0.0.0", "-port", "80"])
        self.containers.append(name)
        deadline = time.monotonic() + 20
        while http_get(f"http://{self.emulator_ip}/storage/v1/b?project=smoke")[0] != 200:
            need(time.monotonic() < deadline, f"fake-gcs-server did not answer on {self.emulator_ip}:80 within 20 s")
            time.sleep(0.2)
        request = urllib.request.Request(
            f"http://{self.emulator_ip}/storage/v1/b?project=smoke",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            need(response.status == 200, f"bucket creation answered {response.status}")

    def start_instance(self, letter, ip, service):
        """The image as it is: its entrypoint, command, user and environment;
        the service's port and environment on top, as Cloud Run sets them."""
        name = f"{self.tag}-{letter}"
        env = dict(service["env"])
        env["PORT"] = str(service["port"])
        env["STORAGE_EMULATOR_HOST"] = f"http://{self.emulator_ip}"
        env_args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
        # Privileged: runsc creates namespaces, mounts and ptraces its
        # sandboxes, as it does in Cloud Run's second-generation environment.
        run(["podman", "run", "-d", "--name", name, "--runtime", "runc", "--privileged",
             *self.ulimits, "--network", self.network, "--ip", ip, *env_args, self.image])
        self.containers.append(name)
        return name

    def logs(self, name, lines=40):
        result = run(["podman", "logs", "--tail", str(lines), name], check=False)
        return (result.stdout + result.stderr).strip()

    def save_logs(self, directory):
        os.makedirs(directory, exist_ok=True)
        for name in self.containers:
            result = run(["podman", "logs", name], check=False)
            with open(os.path.join(directory, f"{name}.log"), "w") as f:
                f.write(result.stdout + result.stderr)

    def remove(self):
        for name in reversed(self.containers):
            run(["podman", "rm", "-f", "-t", "0", name], check=False)
        if self.network:
            run(["podman", "network", "rm", "-f", self.network], check=False)
