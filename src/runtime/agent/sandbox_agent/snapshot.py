"""Filesystem snapshots: op archive streams a gzipped tar of what changed
since the agent started as chunks; ops extract_chunk and extract_end unpack
one into a fresh sandbox. `tarfile` is imported only here and only when
used: it stays off the boot path."""
import os

from . import safe_open as safe, protocol, state


class ChunkWriter:
    """A file object that sends what is written as `chunk` events."""

    def __init__(self, request_id):
        self.id = request_id
        self.size = 0

    def write(self, data):
        if data:
            self.size += len(data)
            protocol.emit({"ev": "chunk", "id": self.id, "data": protocol.b64(bytes(data))})
        return len(data)

    def flush(self):
        pass


def add_member(tar, path):
    """Adds one file, directory or symlink. Regular files are always stored
    whole: a hard-link member would be skipped on extraction."""
    import tarfile
    info = tar.gettarinfo(path, arcname=path.lstrip("/"))
    if info.isfile() or info.islnk():
        # Opened without following a symlink or blocking on a FIFO put in
        # its place since the lstat; stored with the size it has now.
        with os.fdopen(safe.open_regular(path), "rb") as data:
            info = tar.gettarinfo(arcname=path.lstrip("/"), fileobj=data)
            info.type = tarfile.REGTYPE
            info.linkname = ""
            tar.addfile(info, data)
    else:
        tar.addfile(info)


def archive(msg):
    import tarfile
    since = msg.get("since", state.START_TIME)
    writer = ChunkWriter(msg["id"])
    count = 0
    with tarfile.open(fileobj=writer, mode="w|gz") as tar:
        for top in msg["paths"]:
            for dirpath, dirnames, filenames in os.walk(top):
                for name in sorted(dirnames) + sorted(filenames):
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    if max(st.st_mtime, st.st_ctime) < since:
                        continue
                    if not (os.path.isfile(path) or os.path.islink(path) or os.path.isdir(path)):
                        continue
                    try:
                        add_member(tar, path)
                    except OSError:
                        continue  # unreadable or gone meanwhile: not the user's
                    count += 1
    protocol.emit({"ev": "done", "id": msg["id"], "size": writer.size, "entries": count})


# Where an incoming archive collects (tests point it elsewhere).
EXTRACT_DIR = "/tmp"
# Where it unpacks (tests point it elsewhere).
EXTRACT_ROOT = "/"


def extract_path(request_id):
    return os.path.join(EXTRACT_DIR, ".sandboxd-extract-%s" % request_id)


# Extractions whose temporary file this agent created.
EXTRACTING = set()


def extract_chunk(msg):
    path = extract_path(msg["id"])
    if msg["id"] in EXTRACTING:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | safe.NOFOLLOW | safe.CLOEXEC)
    else:
        # /tmp is everyone's: never append to what someone put under the name.
        fd = safe.create_new(path, mode=0o600, append=True)
        EXTRACTING.add(msg["id"])
    with os.fdopen(fd, "ab") as target:
        target.write(protocol.unb64(msg["data"]))


def member_target_is_safe(member, target):
    """No symlink among the target's parents; a symlink (or a file) already
    at a file's name is replaced, never written through; a directory member
    never lands on a symlink (its attributes would be set on the target)."""
    if not safe.no_symlink_between(EXTRACT_ROOT, target):
        return False
    try:
        existing = os.lstat(target)
    except FileNotFoundError:
        return True
    import stat as stat_module
    if stat_module.S_ISLNK(existing.st_mode):
        if member.isdir():
            return False
        os.unlink(target)
    return True


def extract_end(msg):
    import tarfile
    path = extract_path(msg["id"])
    EXTRACTING.discard(msg["id"])
    count = 0
    try:
        with os.fdopen(safe.open_regular(path), "rb") as source, \
                tarfile.open(fileobj=source, mode="r:gz") as tar:
            for member in tar:
                name = member.name
                if name.startswith("/") or ".." in name.split("/"):
                    continue
                if not (member.isfile() or member.isdir() or member.issym()):
                    continue
                if not member_target_is_safe(member, os.path.join(EXTRACT_ROOT, name)):
                    continue
                # Members were checked above; newer Pythons would otherwise
                # apply their default filter (and refuse absolute symlinks).
                trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
                tar.extract(member, EXTRACT_ROOT, set_attrs=True, **trusted)
                count += 1
    except (OSError, tarfile.TarError) as err:
        protocol.error(msg["id"], "cannot extract the snapshot: %s" % err)
        return
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    protocol.emit({"ev": "done", "id": msg["id"], "entries": count})
