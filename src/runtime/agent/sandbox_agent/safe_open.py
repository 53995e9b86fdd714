"""Opening files user code can reach, without letting it redirect the agent.

The agent runs as the same uid as user code, which can plant a symlink (or a
FIFO) under any name the agent is about to use: `.sandbox-state.tmp`,
`.sandbox-sync-*`, a snapshot's members, a file being hashed. A symlink would
send the agent's write elsewhere; a FIFO would block its only thread, and with
it every request of the host (checkpoint, kill). So the agent never follows a
symlink at the last component (O_NOFOLLOW), creates its temporaries with
O_EXCL after removing whatever holds the name (the name itself, not what it
points to), opens under the directory's fd, and reads only regular files,
opened without blocking (O_NONBLOCK) and checked with fstat (docs/security.md).
"""
import errno
import os
import stat as stat_module

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_regular(path, flags=os.O_RDONLY, dir_fd=None):
    """An fd on the existing regular file `path`: never through a symlink,
    never blocking on a FIFO or a device."""
    fd = os.open(path, flags | NOFOLLOW | CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path, dir_fd=None, mode=0o644, append=False):
    """A new file `path` for writing: whatever held the name (a planted
    symlink, a FIFO, a stale file) is removed first, and the create fails
    rather than follow anything that appears meanwhile (O_EXCL)."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise OSError(errno.EISDIR, "a directory holds the name", path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    if append:
        flags |= os.O_APPEND
    return os.open(path, flags, mode, dir_fd=dir_fd)


def open_dir(path):
    """An fd on the directory `path` itself (not a symlink to one)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC)


def no_symlink_between(root, target):
    """True when no component of `target` below `root` is a symlink (so a
    write to `target` lands where its name says)."""
    rel = os.path.relpath(target, root)
    if rel.startswith(".."):
        return False
    current = root
    for part in rel.split(os.sep)[:-1]:
        current = os.path.join(current, part)
        try:
            if stat_module.S_ISLNK(os.lstat(current).st_mode):
                return False
        except FileNotFoundError:
            return True
    return True
