"""The filesystem API (ops fs_*): stat, list, read, write, mkdir, remove,
rename, and chunked uploads, run inside the sandbox as its user. Large
files move in chunks of raw bytes beside the JSON (`fs_read_bytes`,
`fs_upload_bytes`, protocol version 2); `fs_read` and `fs_upload_chunk`
(base64) stay for hosts that speak version 1.

Confinement comes from where this runs: the agent is inside gVisor and has
dropped to the sandbox's user, so every path, symlinks included, resolves
inside the sandbox's own root and is checked by the kernel's permissions
(EACCES). What the agent can reach that user code cannot is its own
`/proc/1` (its host stdio, see `config.drop_privileges`): so nothing under
/proc, /sys or /dev is served, and a file is read or written only once the
descriptor opened is known to be a regular file on an ordinary filesystem
(checked with fstat on the descriptor, so a symlink swapped in between
cannot redirect it).

Errors are POSIX errors by name: the `error` event's message starts with
the errno's symbol (`ENOENT: No such file or directory: '/x'`), which the
host turns into a typed error. Every answer is bounded: reads by `length`
(at most MAX_READ), listings by `max_entries`.
"""
import errno
import os
import stat as stat_module
import time

from . import config, protocol

MAX_READ = 4 << 20
MAX_ENTRIES = 10000
# A listing's answer stays under this many bytes (long names: fewer entries).
MAX_LIST_BYTES = 4 << 20
UPLOAD_PREFIX = ".sandboxd-upload-"
# Uploads in progress by upload id: [fd, temp path, final path, mode, size, last used].
UPLOADS = {}
MAX_UPLOADS = 8
UPLOAD_IDLE_S = 600
SPECIAL_ROOTS = ("/proc", "/sys", "/dev")
_SPECIAL_DEVS = None


class FsError(Exception):
    """A refused request, under a POSIX error name."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (errno.errorcode.get(code, "EIO"), message))


def special_devs():
    global _SPECIAL_DEVS
    if _SPECIAL_DEVS is None:
        devs = set()
        for root in SPECIAL_ROOTS:
            try:
                devs.add(os.stat(root).st_dev)
            except OSError:
                pass
        _SPECIAL_DEVS = devs
    return _SPECIAL_DEVS


def resolve(path):
    """The absolute path asked for (relative: under the user's home), refusing
    what is no path or lies under /proc, /sys or /dev (also through links)."""
    if not isinstance(path, str) or not path or "\0" in path or len(path.encode()) > 4096:
        raise FsError(errno.EINVAL, "invalid path %r" % (path,))
    full = path if path.startswith("/") else os.path.join(config.HOME, path)
    full = os.path.normpath(full)
    if full.startswith("//"):
        full = full[1:]
    for candidate in (full, os.path.realpath(full)):
        for root in SPECIAL_ROOTS:
            if candidate == root or candidate.startswith(root + "/"):
                raise FsError(errno.EACCES, "%s is not served by the filesystem API" % root)
    return full


def kind_of(mode):
    if stat_module.S_ISREG(mode):
        return "file"
    if stat_module.S_ISDIR(mode):
        return "directory"
    if stat_module.S_ISLNK(mode):
        return "symlink"
    return "other"


def entry(path, st, name=None):
    result = {
        "path": path,
        "name": name if name is not None else (os.path.basename(path) or "/"),
        "type": kind_of(st.st_mode),
        "size": st.st_size,
        "mode": stat_module.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }
    if stat_module.S_ISLNK(st.st_mode):
        try:
            result["target"] = os.readlink(path)
        except OSError:
            pass
    return result


def checked_regular(fd, path):
    """Refuses a descriptor that is not a regular file on an ordinary filesystem."""
    st = os.fstat(fd)
    if stat_module.S_ISDIR(st.st_mode):
        raise FsError(errno.EISDIR, "Is a directory: %r" % path)
    if not stat_module.S_ISREG(st.st_mode):
        raise FsError(errno.EINVAL, "not a regular file: %r" % path)
    if st.st_dev in special_devs():
        raise FsError(errno.EACCES, "not served by the filesystem API: %r" % path)
    return st


def reply(msg, payload=None, **fields):
    fields.update({"ev": "done", "id": msg["id"]})
    protocol.emit(fields, payload)


def fs_stat(msg):
    path = resolve(msg["path"])
    reply(msg, entry=entry(path, os.lstat(path)))


def fs_list(msg):
    """Entries under a directory, `depth` levels deep (1: its children),
    sorted, never following symlinks, at most `max_entries`."""
    root = resolve(msg["path"])
    depth = max(1, min(int(msg.get("depth", 1)), 64))
    limit = max(1, min(int(msg.get("max_entries", MAX_ENTRIES)), MAX_ENTRIES))
    st = os.lstat(root)
    if not stat_module.S_ISDIR(st.st_mode):
        raise FsError(errno.ENOTDIR, "Not a directory: %r" % msg["path"])
    entries = []
    truncated = False
    listed_bytes = 0
    pending = [(root, "", 1)]
    while pending and not truncated:
        directory, prefix, level = pending.pop(0)
        try:
            with os.scandir(directory) as scan:
                children = sorted(scan, key=lambda child: child.name)
        except OSError:
            if directory == root:
                raise
            continue
        for child in children:
            if len(entries) >= limit or listed_bytes > MAX_LIST_BYTES:
                truncated = True
                break
            try:
                child_st = child.stat(follow_symlinks=False)
            except OSError:
                continue
            rel = prefix + child.name
            listed = entry(child.path, child_st, name=rel)
            listed_bytes += len(child.path) + len(rel) + len(listed.get("target", "")) + 100
            entries.append(listed)
            if level < depth and stat_module.S_ISDIR(child_st.st_mode):
                pending.append((child.path, rel + "/", level + 1))
    reply(msg, entries=entries, truncated=truncated)


def read_at(msg):
    """Up to `length` bytes at `offset`, and the file's stat."""
    path = resolve(msg["path"])
    offset = max(0, int(msg.get("offset", 0)))
    length = max(0, min(int(msg.get("length", MAX_READ)), MAX_READ))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = checked_regular(fd, msg["path"])
        data = os.pread(fd, length, offset) if length else b""
    finally:
        os.close(fd)
    return data, dict(size=st.st_size, mode=stat_module.S_IMODE(st.st_mode), ino=st.st_ino,
                      mtime_ns=st.st_mtime_ns, eof=offset + len(data) >= st.st_size)


def fs_read(msg):
    """Up to `length` bytes at `offset` (base64), with the file's size and
    identity (inode, mtime) so that a reader of many pieces sees a change."""
    data, facts = read_at(msg)
    reply(msg, data=protocol.b64(data), **facts)


def fs_read_bytes(msg):
    """`fs_read` with the bytes raw after the reply (protocol version 2)."""
    data, facts = read_at(msg)
    reply(msg, payload=data, **facts)


def make_parents(path, wanted):
    parent = os.path.dirname(path)
    if wanted and parent:
        os.makedirs(parent, exist_ok=True)


def fs_write(msg):
    """Writes a whole (small) file: created with `mode` (default 0644) or
    truncated, parents created when `parents`."""
    path = resolve(msg["path"])
    data = protocol.unb64(msg["data"])
    make_parents(path, msg.get("parents", True))
    mode = msg.get("mode")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                 0o644 if mode is None else int(mode) & 0o7777)
    try:
        checked_regular(fd, msg["path"])
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if mode is not None:
            os.fchmod(fd, int(mode) & 0o7777)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    reply(msg, entry=entry(path, st))


def fs_mkdir(msg):
    path = resolve(msg["path"])
    mode = int(msg.get("mode", 0o755)) & 0o7777
    if msg.get("parents", False):
        os.makedirs(path, mode=mode, exist_ok=True)
        if not os.path.isdir(path):
            raise FsError(errno.EEXIST, "File exists: %r" % msg["path"])
    else:
        os.mkdir(path, mode)
    reply(msg, entry=entry(path, os.lstat(path)))


def fs_remove(msg):
    """Removes a file, a link or an empty directory; with `recursive`, a
    directory and everything in it (links are removed, never followed)."""
    import shutil  # off the boot path
    path = resolve(msg["path"])
    st = os.lstat(path)
    if stat_module.S_ISDIR(st.st_mode):
        if msg.get("recursive", False):
            shutil.rmtree(path)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)
    reply(msg)


def fs_rename(msg):
    source = resolve(msg["path"])
    target = resolve(msg["to"])
    if not msg.get("overwrite", True) and os.path.lexists(target):
        raise FsError(errno.EEXIST, "File exists: %r" % msg["to"])
    os.rename(source, target)
    reply(msg, entry=entry(target, os.lstat(target)))


def drop_upload(upload_id):
    upload = UPLOADS.pop(upload_id, None)
    if upload is None:
        return
    try:
        os.close(upload[0])
    except OSError:
        pass
    try:
        os.unlink(upload[1])
    except OSError:
        pass


def fs_upload_open(msg):
    """Starts an upload into a temporary file beside the target (so the
    commit is one rename); the host sends chunks, then commits or aborts."""
    now = time.monotonic()
    for upload_id, upload in list(UPLOADS.items()):
        if now - upload[5] > UPLOAD_IDLE_S:
            drop_upload(upload_id)
    while len(UPLOADS) >= MAX_UPLOADS:
        drop_upload(min(UPLOADS, key=lambda key: UPLOADS[key][5]))
    upload_id = msg["upload"]
    if not isinstance(upload_id, str) or not upload_id.isalnum() or len(upload_id) > 64:
        raise FsError(errno.EINVAL, "invalid upload id")
    drop_upload(upload_id)
    path = resolve(msg["path"])
    if os.path.isdir(path):
        raise FsError(errno.EISDIR, "Is a directory: %r" % msg["path"])
    final = os.path.realpath(path)
    make_parents(final, msg.get("parents", True))
    temp = os.path.join(os.path.dirname(final), UPLOAD_PREFIX + upload_id)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    mode = msg.get("mode")
    UPLOADS[upload_id] = [fd, temp, final, None if mode is None else int(mode) & 0o7777, 0, now]
    reply(msg)


def upload_of(msg):
    upload = UPLOADS.get(msg.get("upload"))
    if upload is None:
        raise FsError(errno.EBADF, "no upload %r in progress" % (msg.get("upload"),))
    upload[5] = time.monotonic()
    return upload


def append(msg, data):
    upload = upload_of(msg)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(upload[0], view):]
    except OSError:
        drop_upload(msg["upload"])
        raise
    upload[4] += len(data)
    reply(msg, size=upload[4])


def fs_upload_chunk(msg):
    append(msg, protocol.unb64(msg["data"]))


def fs_upload_bytes(msg):
    """`fs_upload_chunk` with the bytes raw after the command (version 2)."""
    data = msg.get(protocol.PAYLOAD)
    if not isinstance(data, (bytes, bytearray)):
        raise FsError(errno.EINVAL, "no bytes came with the chunk")
    append(msg, data)


def fs_upload_commit(msg):
    """Checks the size, sets the mode (the target's own if it existed, else
    `mode` or 0644) and renames the temporary file over the target."""
    upload = upload_of(msg)
    fd, temp, final, mode, size = upload[:5]
    if size != msg["size"]:
        drop_upload(msg["upload"])
        raise FsError(errno.EIO, "%d bytes arrived, %d were announced" % (size, msg["size"]))
    try:
        if mode is None:
            try:
                mode = stat_module.S_IMODE(os.stat(final).st_mode)
            except OSError:
                mode = 0o644
        os.fchmod(fd, mode)
        os.rename(temp, final)
    except OSError:
        drop_upload(msg["upload"])
        raise
    UPLOADS.pop(msg["upload"], None)
    st = os.fstat(fd)
    os.close(fd)
    reply(msg, entry=entry(final, st))


def fs_upload_abort(msg):
    drop_upload(msg.get("upload"))
    reply(msg)


def handled(run):
    """`run` with its failures as the request's POSIX-named error."""
    def handle(msg):
        try:
            run(msg)
        except FsError as err:
            protocol.error(msg.get("id"), str(err))
        except OSError as err:
            name = errno.errorcode.get(err.errno, "EIO")
            detail = err.strerror or str(err)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                detail = "disk full: %s (the sandbox's disk budget is used up)" % detail
            where = err.filename if err.filename is not None else msg.get("path")
            if where is None:
                protocol.error(msg.get("id"), "%s: %s" % (name, detail))
            else:
                protocol.error(msg.get("id"), "%s: %s: %r" % (name, detail, where))
        except (KeyError, TypeError, ValueError) as err:
            protocol.error(msg.get("id"), "EINVAL: bad request: %s" % err)
    return handle


for _name in ("fs_stat", "fs_list", "fs_read", "fs_read_bytes", "fs_write", "fs_mkdir",
              "fs_remove", "fs_rename", "fs_upload_open", "fs_upload_chunk", "fs_upload_bytes",
              "fs_upload_commit", "fs_upload_abort"):
    globals()[_name] = handled(globals()[_name])
