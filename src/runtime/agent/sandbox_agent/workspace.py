"""Workspace sync's file operations (ops ws_*): the host plans, the agent
touches files, as the sandbox's user, so the host never resolves a path the
sandbox controls.

Paths are relative to the workspace root and checked here again (the host
checks them too): no absolute paths, no "..", and no symlink anywhere on the
way, so nothing outside the root is ever read, written or deleted. Each op
answers `done` or, for a refused path or a failed file operation, `error`
(`handlers` turns a `WorkspaceError` or `OSError` into one).
"""
import json
import os
import stat as stat_module
import time

from . import safe_open as safe, protocol

STATE_NAME = ".sandbox-state"
SYNC_TEMP_PREFIX = ".sandbox-sync-"
WRITES = {}
# Refused files listed by name in a scan's reply; the rest are counted.
MAX_REFUSED_LISTED = 1000
# Largest local state file read (larger: treated as absent, every file hashed).
MAX_STATE_BYTES = 32 << 20


class WorkspaceError(Exception):
    pass


def ws_target(root, rel):
    """The absolute path of `rel` under `root`, refusing anything that could
    leave it: bad segments, or a symlink or non-directory among the parents."""
    if not rel or rel.startswith("/") or "\0" in rel:
        raise WorkspaceError("invalid path %r" % rel)
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise WorkspaceError("invalid path %r" % rel)
    current = root
    for part in parts[:-1]:
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            continue
        if not stat_module.S_ISDIR(st.st_mode):
            raise WorkspaceError("%r: a parent is a symlink or not a directory" % rel)
    return os.path.join(root, *parts)


def ws_is_internal(name):
    return name in (STATE_NAME, STATE_NAME + ".tmp") or name.startswith(SYNC_TEMP_PREFIX)


def md5_file(path):
    import hashlib  # off the boot path
    digest = hashlib.md5()
    with os.fdopen(safe.open_regular(path), "rb", buffering=0) as source:
        while True:
            block = source.read(protocol.READ_CHUNK * 4)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def max_files_or_all(msg):
    limit = msg.get("max_files")
    return limit if isinstance(limit, int) and limit >= 0 else None


def read_local_state(root):
    """The state file user code can write: read only up to MAX_STATE_BYTES."""
    try:
        with os.fdopen(safe.open_regular(os.path.join(root, STATE_NAME)), "rb") as source:
            data = source.read(MAX_STATE_BYTES + 1)
        if len(data) > MAX_STATE_BYTES:
            return 0.0, {}
        state = json.loads(data)
        files = {entry["path"]: entry for entry in state.get("files", [])}
        return float(state.get("last_synced_at", 0)), files
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0.0, {}


def ws_scan(msg):
    """Lists the workspace's regular files with md5, size and mtime. A file's
    md5 is reused from the local state file when its size and mtime are the
    recorded ones and it was not modified within the second of that sync (git's
    "racy clean" rule), unless the state is older than `stale_s`."""
    root = msg["root"]
    max_file = msg.get("max_file_bytes")
    max_total = msg.get("max_total_bytes")
    scanned_at = time.time()
    synced_at, cached = read_local_state(root)
    synced = [cached[path] for path in sorted(cached)][:max_files_or_all(msg)]
    if scanned_at - synced_at > msg.get("stale_s", 3600):
        cached = {}
    max_files = msg.get("max_files")
    sweep_sync_temps(root)
    files, refused = [], []
    unlisted = [0]

    def refuse(entry):
        # Bounded (docs/security.md): a workspace of a million symlinks is one line.
        if len(refused) < MAX_REFUSED_LISTED:
            refused.append(entry)
        else:
            unlisted[0] += 1

    total = 0
    hashed = 0
    root_real = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in list(dirnames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                dirnames.remove(name)
                filenames.append(name)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if dirpath == root and ws_is_internal(name):
                continue
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                refuse({"path": rel.encode("utf-8", "replace").decode(), "reason": "the name is not UTF-8"})
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if stat_module.S_ISLNK(st.st_mode):
                target = os.path.realpath(full)
                if target != root_real and not target.startswith(root_real + "/"):
                    refuse({"path": rel, "reason": "a symlink that escapes the workspace"})
                else:
                    refuse({"path": rel, "reason": "a symlink (only regular files are synced)"})
                continue
            if not stat_module.S_ISREG(st.st_mode):
                continue
            if max_files is not None and len(files) >= max_files:
                protocol.emit({"ev": "error", "id": msg["id"],
                      "message": "the workspace holds more than the %d-file limit" % max_files})
                return
            if max_file is not None and st.st_size > max_file:
                refuse({"path": rel, "reason": "larger than the %d-byte file limit" % max_file})
                continue
            total += st.st_size
            if max_total is not None and total > max_total:
                protocol.emit({"ev": "error", "id": msg["id"],
                      "message": "the workspace holds more than the %d-byte limit" % max_total})
                return
            modified = int(st.st_mtime)
            entry = cached.get(rel)
            if (entry is not None and entry.get("size") == st.st_size
                    and entry.get("modified_at") == modified and modified < int(synced_at)
                    and isinstance(entry.get("checksum"), str)):
                checksum = entry["checksum"]
            else:
                try:
                    checksum = md5_file(full)
                except FileNotFoundError:
                    continue  # gone meanwhile
                except OSError as err:
                    refuse({"path": rel, "reason": "unreadable: %s" % err.strerror})
                    continue
                hashed += 1
            files.append({"path": rel, "checksum": checksum, "size": st.st_size, "modified_at": modified})
    if unlisted[0]:
        refused.append({"path": "...", "reason": "and %d more files refused (not listed)" % unlisted[0]})
    protocol.emit({"ev": "done", "id": msg["id"], "files": files, "refused": refused, "hashed": hashed,
          "synced": synced, "scanned_at": int(scanned_at)})


def sweep_sync_temps(root):
    """Removes temporary files of downloads that never finished (the host gave
    up, or a checkpoint cut them off)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    active = {SYNC_TEMP_PREFIX + str(write_id) for write_id in WRITES}
    for name in names:
        if name.startswith(SYNC_TEMP_PREFIX) and name not in active:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass


def ws_write_abort(msg):
    write = WRITES.pop(msg["id"], None)
    if write is not None:
        write[0].close()
        try:
            os.unlink(write[2])
        except OSError:
            pass
    protocol.emit({"ev": "done", "id": msg["id"]})


def ws_read(msg):
    """Streams one file's bytes as chunks; the reply carries the md5 and size
    of exactly the bytes sent (the file may have changed since the scan)."""
    import hashlib  # off the boot path
    path = ws_target(msg["root"], msg["path"])
    try:
        fd = safe.open_regular(path)
    except OSError as err:
        raise WorkspaceError("cannot read %r: %s" % (msg["path"], err.strerror))
    digest = hashlib.md5()
    size = 0
    limit = msg.get("max_file_bytes")
    with os.fdopen(fd, "rb", buffering=0) as source:
        while True:
            block = source.read(protocol.READ_CHUNK * 3)
            if not block:
                break
            size += len(block)
            if limit is not None and size > limit:
                raise WorkspaceError("%r grew past the %d-byte file limit" % (msg["path"], limit))
            digest.update(block)
            protocol.emit({"ev": "chunk", "id": msg["id"], "data": protocol.b64(block)})
    protocol.emit({"ev": "done", "id": msg["id"], "checksum": digest.hexdigest(), "size": size})


def ws_write_chunk(msg):
    import hashlib  # off the boot path
    write = WRITES.get(msg["id"])
    if write is None:
        root = msg["root"]
        os.makedirs(root, exist_ok=True)
        temp = os.path.join(root, SYNC_TEMP_PREFIX + str(msg["id"]))
        write = WRITES[msg["id"]] = [os.fdopen(safe.create_new(temp), "wb"), hashlib.md5(), temp]
    try:
        data = protocol.unb64(msg["data"])
        write[0].write(data)
        write[1].update(data)
    except (OSError, ValueError):
        WRITES.pop(msg["id"], None)
        write[0].close()
        try:
            os.unlink(write[2])
        except OSError:
            pass
        raise


def ws_write_end(msg):
    """Finishes a download: checks the md5, then renames the temporary file
    over the target (atomic) and sets its mtime."""
    import hashlib  # off the boot path
    root = msg["root"]
    write = WRITES.pop(msg["id"], None)
    if write is None:  # an empty file: no chunk came
        temp = os.path.join(root, SYNC_TEMP_PREFIX + str(msg["id"]))
        os.makedirs(root, exist_ok=True)
        write = [os.fdopen(safe.create_new(temp), "wb"), hashlib.md5(), temp]
    handle_, digest, temp = write
    handle_.close()
    try:
        if digest.hexdigest() != msg["checksum"]:
            raise WorkspaceError("%r: md5 %s does not match the expected %s"
                                 % (msg["path"], digest.hexdigest(), msg["checksum"]))
        target = ws_target(root, msg["path"])
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        ws_target(root, msg["path"])  # again: no symlink appeared among the parents
        if os.path.isdir(target) and not os.path.islink(target):
            raise WorkspaceError("%r is a directory here" % msg["path"])
        os.replace(temp, target)
        modified = msg.get("modified_at")
        if modified is not None:
            os.utime(target, (modified, modified), follow_symlinks=False)
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass
    protocol.emit({"ev": "done", "id": msg["id"]})


def ws_delete(msg):
    """Deletes files (never directories) and then their parents left empty."""
    root = msg["root"]
    deleted = 0
    for rel in msg["paths"]:
        target = ws_target(root, rel)
        try:
            if os.path.isdir(target) and not os.path.islink(target):
                continue
            os.unlink(target)
            deleted += 1
        except FileNotFoundError:
            continue
        parent = os.path.dirname(target)
        while parent != root and parent.startswith(root + "/"):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)
    protocol.emit({"ev": "done", "id": msg["id"], "deleted": deleted})


def ws_state(msg):
    """Writes the local state file atomically (temporary file + rename)."""
    root = msg["root"]
    os.makedirs(root, exist_ok=True)
    root_fd = safe.open_dir(root)
    try:
        temp = STATE_NAME + ".tmp"
        with os.fdopen(safe.create_new(temp, dir_fd=root_fd), "w") as target:
            target.write(msg["content"])
            target.flush()
            os.fsync(target.fileno())
        # rename replaces the name, never what a planted symlink points to
        os.replace(temp, STATE_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    finally:
        os.close(root_fd)
    protocol.emit({"ev": "done", "id": msg["id"]})


