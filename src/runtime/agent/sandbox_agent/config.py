"""What the host passes in argv[1] (JSON): the interpreter for Python code,
the user code runs as (non-root, so RLIMIT_NPROC applies), its home, the
workspace directory and the environment. See `BundleSpec::config_with`."""
import json
import os

PYTHON = "/usr/bin/python3"
UID = 1000
GID = 1000
HOME = "/home/sandbox"
WORKSPACE = "/workspace"
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME}


def load(text):
    """Sets this module's values from the host's JSON (missing keys keep the defaults)."""
    global PYTHON, UID, GID, HOME, WORKSPACE, BASE_ENV
    config = json.loads(text) if text else {}
    PYTHON = config.get("python", PYTHON)
    UID = config.get("uid", UID)
    GID = config.get("gid", GID)
    HOME = config.get("home", HOME)
    WORKSPACE = config.get("workspace", WORKSPACE)
    BASE_ENV = config.get("env", {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME})


def user_env(extra):
    env = dict(BASE_ENV)
    env.update(extra)
    return env


def drop_privileges():
    """Creates the user's home as root, then becomes the user for good.

    Everything the agent starts then runs as the user without a setuid per
    execution, which would stop subprocess from using vfork (about 25 ms more
    per execution under ptrace). The agent still reaps (PID 1), can kill every
    process of its user and read their /proc entries.
    """
    os.makedirs(HOME, exist_ok=True)
    os.chown(HOME, UID, GID)
    os.chmod(HOME, 0o755)
    os.makedirs(WORKSPACE, exist_ok=True)
    os.chown(WORKSPACE, UID, GID)
    os.setgroups([])
    os.setgid(GID)
    os.setuid(UID)
    try:  # keep user code (same uid) out of /proc/1: the agent's host stdio
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass
