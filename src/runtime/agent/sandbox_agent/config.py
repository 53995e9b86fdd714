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


SKEL = "/etc/skel"


def seed_home():
    """Fills an empty home with the image's `/etc/skel`, as `useradd
    --create-home` made the image's own home: the home is a tmpfs of the
    sandbox's disk budget mounted over it (`bundle::USER_WRITABLE_DIRS`).
    Only the top level's regular files (Debian's skel has three); a home
    that holds anything is left alone."""
    try:
        if os.listdir(HOME) or not os.path.isdir(SKEL):
            return
        names = os.listdir(SKEL)
    except OSError:
        return
    for name in names:
        source = os.path.join(SKEL, name)
        if os.path.islink(source) or not os.path.isfile(source):
            continue
        target = os.path.join(HOME, name)
        try:
            with open(source, "rb") as data:
                content = data.read()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(content)
            os.chown(target, UID, GID)
        except OSError:
            continue


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
    seed_home()
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
