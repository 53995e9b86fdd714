# sandboxd agent: PID 1 inside every sandbox.
#
# The host talks to it over the agent's own stdin/stdout, one JSON object per
# line. Those are the init process's stdio, which runsc hands over to the
# restoring caller on `runsc restore`, so the channel survives checkpoint and
# restore with no socket, no bind mount and no `runsc exec` on the hot path.
#
# User code never holds a host file descriptor: every execution gets pipes made
# here, inside the sandbox, and the agent relays their bytes. (An exec'd process
# holding host pipes at checkpoint time makes every later restore fail.) As PID 1
# the agent also reaps every orphan.
#
# host -> agent: {"op": ...}   agent -> host: {"ev": ...}   bytes are base64.
#
# Resumable executions (the sandbox keeps executions across a move, see
# docs/decisions/0012-executions-survive-a-move.md) number their events
# ("seq") and keep them in a journal until the host acknowledges them (op
# "ack": delivered to the client). A checkpoint with "keep" pauses them (their
# pipes are no longer read, an exit is held back) so that everything not yet
# delivered is either in the journal or still in the pipes: both are in the
# image. After a restore, op "resume" with "replay" sends the journal again
# from the last acknowledged event, then the execution carries on.
import base64
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

VERSION = 1
READ_CHUNK = 65536
SEL = selectors.DefaultSelector()
START_TIME = time.time()

OUT = 1
IN = 0

REPL_SOURCE = r'''
import os, signal, sys, traceback
cmd_fd, done_fd = int(sys.argv[1]), int(sys.argv[2])
# An interrupt (the host's kill) only ever stops a running cell; between
# cells it is ignored, so a late kill cannot end the session.
signal.signal(signal.SIGINT, signal.SIG_IGN)
cmd = os.fdopen(cmd_fd, "rb", buffering=0)
done = os.fdopen(done_fd, "wb", buffering=0)
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
def report():
    kind, value, tb = sys.exc_info()
    traceback.print_exception(kind, value, tb.tb_next if tb is not None else None)
def read_exact(n):
    buf = b""
    while len(buf) < n:
        part = cmd.read(n - len(buf))
        if not part:
            sys.exit(0)
        buf += part
    return buf
while True:
    size = int(read_exact(10).decode(), 16)
    code = read_exact(size).decode("utf-8", "replace")
    status = 0
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        exec(compile(code, "<cell>", "exec"), namespace)
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except KeyboardInterrupt:
        status = 130
        report()
    except BaseException:
        status = 1
        report()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    done.write(b"%d\n" % status)
'''


def emit(event):
    data = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    view = memoryview(data)
    while view:
        try:
            written = os.write(OUT, view)
        except BlockingIOError:
            time.sleep(0.001)
            continue
        except BrokenPipeError:
            return
        view = view[written:]


def b64(data):
    return base64.b64encode(data).decode("ascii")


def exit_code(status):
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 255


def set_nonblocking(fd):
    os.set_blocking(fd, False)


class Execution:
    """One execution: a process (or a persistent-session cell) and its pipes."""

    def __init__(self, exec_id, pid, stdin_fd, out_fds, session=None, resumable=False):
        self.id = exec_id
        self.resumable = resumable
        self.seq = 0  # the last event numbered
        self.written = 0  # the last event written to the host
        self.acked = 0  # the last event the host delivered
        self.journal = []  # [(seq, line)] not yet acknowledged
        self.partial = {}  # stream -> the start of a UTF-8 character cut by a read
        self.pending_exit = None  # an exit held back while paused
        self.pid = pid
        self.stdin_fd = stdin_fd
        self.stdin_pending = b""
        self.stdin_close_requested = False
        self.out_fds = dict(out_fds)  # fd -> stream number (1 or 2)
        self.session = session
        self.finished = False
        for fd in self.out_fds:
            set_nonblocking(fd)
            SEL.register(fd, selectors.EVENT_READ, ("out", self))
        if stdin_fd is not None:
            set_nonblocking(stdin_fd)

    def pump(self, fd):
        stream = self.out_fds.get(fd)
        if stream is None:
            return
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.output(stream, data)
        elif self.session is None:
            self.close_out(fd)

    def output(self, stream, data):
        if self.resumable:
            # Events end on character boundaries, so the host never needs a
            # character's start from an event it already acknowledged.
            data = self.partial.pop(stream, b"") + data
            data, cut = split_utf8(data)
            if cut:
                self.partial[stream] = cut
            if not data:
                return
        self.event({"ev": "out", "id": self.id, "fd": stream, "data": b64(data)})

    def flush_partial(self):
        for stream in list(self.partial):
            data = self.partial.pop(stream)
            self.event({"ev": "out", "id": self.id, "fd": stream, "data": b64(data)})

    def event(self, event):
        """Emits one event of this execution (journaled when resumable)."""
        if not self.resumable:
            emit(event)
            return
        self.seq += 1
        event["seq"] = self.seq
        self.journal.append((self.seq, event))
        if not PAUSED:
            self.flush_journal()

    def flush_journal(self):
        for seq, event in self.journal:
            if seq > self.written:
                emit(event)
                self.written = seq

    def ack(self, seq):
        if seq <= self.acked:
            return
        self.acked = min(seq, self.seq)
        self.journal = [entry for entry in self.journal if entry[0] > self.acked]
        if self.finished and not self.journal:
            JOURNALS.pop(self.id, None)

    def drain(self, limit=1 << 20):
        """Reads what is already in the pipes, up to `limit` bytes per pipe.

        Bounded: a background process that keeps writing after the main one
        exited must not keep PID 1 busy forever.
        """
        for fd in list(self.out_fds):
            taken = 0
            while taken < limit:
                try:
                    data = os.read(fd, READ_CHUNK)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                taken += len(data)
                self.output(self.out_fds[fd], data)

    def close_out(self, fd):
        if fd in self.out_fds:
            del self.out_fds[fd]
            try:
                SEL.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)

    def write_stdin(self, data):
        if self.stdin_fd is None:
            return
        self.stdin_pending += data
        self.flush_stdin()

    def flush_stdin(self):
        while self.stdin_pending and self.stdin_fd is not None:
            try:
                written = os.write(self.stdin_fd, self.stdin_pending)
            except BlockingIOError:
                self.watch_stdin(True)
                return
            except OSError:
                self.stdin_pending = b""
                break
            self.stdin_pending = self.stdin_pending[written:]
        self.watch_stdin(False)
        if self.stdin_close_requested and self.session is None:
            self.close_stdin_now()

    def watch_stdin(self, on):
        if self.stdin_fd is None:
            return
        try:
            if on:
                SEL.register(self.stdin_fd, selectors.EVENT_WRITE, ("stdin", self))
            else:
                SEL.unregister(self.stdin_fd)
        except (KeyError, ValueError):
            pass

    def close_stdin(self):
        self.stdin_close_requested = True
        if not self.stdin_pending:
            self.close_stdin_now()

    def close_stdin_now(self):
        if self.session is not None or self.stdin_fd is None:
            return  # a persistent session keeps its stdin open across cells
        self.watch_stdin(False)
        os.close(self.stdin_fd)
        self.stdin_fd = None

    def finish(self, code):
        if self.finished:
            return
        if PAUSED and self.resumable:
            # Being checkpointed: the exit (and the output before it) waits
            # for the host that resumes the sandbox.
            self.pending_exit = code
            return
        self.finished = True
        self.drain()
        self.flush_partial()
        if self.session is None:
            for fd in list(self.out_fds):
                self.close_out(fd)
            self.stdin_pending = b""
            self.stdin_close_requested = True
            self.close_stdin_now()
        else:
            # The session's stdin outlives the cell: drop what this cell left.
            self.stdin_pending = b""
            self.watch_stdin(False)
        EXECS.pop(self.id, None)
        self.event({"ev": "exit", "id": self.id, "code": code})


class PythonSession:
    """A persistent Python interpreter whose globals survive between cells."""

    def __init__(self):
        self.proc = None

    def ensure(self):
        if self.proc is not None and self.alive:
            return
        cmd_r, self.cmd_w = os.pipe()
        self.done_r, done_w = os.pipe()
        in_r, self.stdin_fd = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.proc = subprocess.Popen(
            [PYTHON, "-u", "-c", REPL_SOURCE, str(cmd_r), str(done_w)],
            stdin=in_r, stdout=out_w, stderr=err_w, pass_fds=(cmd_r, done_w),
            close_fds=True, start_new_session=True, cwd=HOME, env=user_env({}))
        for fd in (cmd_r, done_w, in_r, out_w, err_w):
            os.close(fd)
        self.proc.returncode = None
        set_nonblocking(self.done_r)
        SEL.register(self.done_r, selectors.EVENT_READ, ("done", self))
        self.out = {out_r: 1, err_r: 2}
        self.current = None
        self.done_buffer = b""
        self.alive = True
        PIDS[self.proc.pid] = self

    def run(self, exec_id, code, resumable=False):
        self.ensure()
        execution = Execution(exec_id, self.proc.pid, self.stdin_fd, self.out, session=self,
                              resumable=resumable)
        self.current = execution
        data = code.encode()
        os.write(self.cmd_w, b"%010x" % len(data) + data)
        return execution

    def on_done(self):
        try:
            data = os.read(self.done_r, 4096)
        except BlockingIOError:
            return
        self.done_buffer += data
        while b"\n" in self.done_buffer:
            line, self.done_buffer = self.done_buffer.split(b"\n", 1)
            if self.current is not None:
                execution, self.current = self.current, None
                unregister_outputs(execution)
                execution.finish(int(line or b"1"))

    def on_exit(self, code):
        # The interpreter died (os._exit, a crash, a kill): the session restarts
        # on the next cell; the running cell ends with the interpreter's code.
        for fd in (self.done_r, self.cmd_w, self.stdin_fd, *self.out):
            try:
                SEL.unregister(fd)
            except (KeyError, ValueError):
                pass
        if self.current is not None:
            execution, self.current = self.current, None
            execution.drain()
            execution.session = None
            execution.out_fds = {}
            execution.finish(code)
        for fd in (self.done_r, self.cmd_w, self.stdin_fd, *self.out):
            try:
                os.close(fd)
            except OSError:
                pass
        self.alive = False
        self.proc.returncode = code
        self.proc = None


def unregister_outputs(execution):
    for fd in list(execution.out_fds):
        try:
            SEL.unregister(fd)
        except (KeyError, ValueError):
            pass


def split_utf8(data):
    """(whole, cut): `data` without the start of a character its end cuts."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: look further back
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if need > back:
                return data[:-back], data[-back:]
        break
    return data, b""


EXECS = {}
# Resumable executions whose events the host has not all acknowledged
# (running or ended), by id; at most the newest one.
JOURNALS = {}
# Set by a checkpoint that keeps executions, until "resume".
PAUSED = False
PIDS = {}  # main pid -> Execution or PythonSession
SESSION = PythonSession()
# Set by the host in argv[1] (JSON): the interpreter for Python code, the user
# code runs as (non-root, so RLIMIT_NPROC applies), its home and environment.
CONFIG = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
PYTHON = CONFIG.get("python", "/usr/bin/python3")
UID = CONFIG.get("uid", 1000)
GID = CONFIG.get("gid", 1000)
HOME = CONFIG.get("home", "/home/sandbox")
WORKSPACE = CONFIG.get("workspace", "/workspace")
BASE_ENV = CONFIG.get("env", {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME})


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


def user_env(extra):
    env = dict(BASE_ENV)
    env.update(extra)
    return env


def start_exec(msg):
    exec_id = msg["id"]
    if EXECS:
        emit({"ev": "error", "id": exec_id, "message": "another execution is running"})
        return
    resumable = bool(msg.get("resumable"))
    # A new execution supersedes what an earlier one left unacknowledged,
    # as the host's replay log keeps only the current execution.
    JOURNALS.clear()
    if msg.get("session"):
        execution = SESSION.run(exec_id, msg["code"], resumable)
        EXECS[exec_id] = execution
        if resumable:
            JOURNALS[exec_id] = execution
        emit({"ev": "started", "id": exec_id, "pid": execution.pid})
        return
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(
            msg["argv"], stdin=in_r, stdout=out_w, stderr=err_w, close_fds=True,
            start_new_session=True, cwd=msg.get("cwd") or HOME, env=user_env(msg.get("env") or {}))
    except OSError as err:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        emit({"ev": "error", "id": exec_id, "message": "cannot start %s: %s" % (msg["argv"][0], err)})
        return
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    # Reaped by the agent's own loop (it is PID 1), never by Popen.
    proc.returncode = 0
    stdin_fd, out_fds = in_w, {out_r: 1, err_r: 2}
    execution = Execution(exec_id, proc.pid, stdin_fd, out_fds, resumable=resumable)
    EXECS[exec_id] = execution
    if resumable:
        JOURNALS[exec_id] = execution
    PIDS[proc.pid] = execution
    emit({"ev": "started", "id": exec_id, "pid": proc.pid})


def descendants(root_pid):
    """Pids of root_pid's process tree (by parent links in /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            tree.append(child)
            todo.append(child)
    return tree


def kill_tree(pid):
    for victim in [pid] + descendants(pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def kill_exec(exec_id):
    execution = EXECS.get(exec_id)
    if execution is None:
        return
    if execution.session is not None:
        SESSION.on_done()  # the cell may have finished already
        if exec_id not in EXECS:
            return
        os.kill(execution.pid, signal.SIGINT)
        deadline = time.time() + 1.0
        while exec_id in EXECS and time.time() < deadline:
            loop_once(0.05)
        if exec_id not in EXECS:
            return
    kill_tree(execution.pid)


def host_fd_holders():
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % entry):
                if os.readlink("/proc/%s/fd/%s" % (entry, fd)).startswith("host:"):
                    holders.append(int(entry))
                    break
        except OSError:
            continue
    return holders


def prepare_checkpoint(msg):
    global PAUSED
    for exec_id, seq in (msg.get("acked") or {}).items():
        execution = JOURNALS.get(exec_id)
        if execution is not None:
            execution.ack(int(seq))
    if msg.get("keep") and all(e.resumable for e in EXECS.values()) and (EXECS or JOURNALS):
        # Keep them: stop reading their output (it stays in the pipes, in
        # the image) and hold back exits, until "resume".
        PAUSED = True
        for execution in EXECS.values():
            unregister_outputs(execution)
        holders = [pid for pid in host_fd_holders()
                   if pid not in {e.pid for e in EXECS.values()}]
        for pid in holders:
            kill_tree(pid)
        emit({"ev": "ready", "id": msg["id"], "killed_host_fd_holders": holders,
              "running": [], "kept": list(JOURNALS)})
        return
    if EXECS and not msg.get("force"):
        emit({"ev": "error", "id": msg["id"], "message": "an execution is running"})
        return
    for exec_id in list(EXECS):
        kill_tree(EXECS[exec_id].pid)
    deadline = time.time() + 2.0
    while EXECS and time.time() < deadline:
        loop_once(0.05)
    # A checkpoint that keeps nothing (a periodic one, restored in place):
    # the host's replay log has what an ended execution printed; a journal
    # kept in the image would make a later move replay it again.
    JOURNALS.clear()
    holders = host_fd_holders()
    for pid in holders:
        kill_tree(pid)
    emit({"ev": "ready", "id": msg["id"], "killed_host_fd_holders": holders,
          "running": list(EXECS)})


def journals(msg):
    """What a restore brings back: the journaled executions and whether paused."""
    emit({"ev": "journals", "id": msg["id"], "paused": PAUSED, "executions": [
        {"id": e.id, "acked": e.acked, "running": e.id in EXECS} for e in JOURNALS.values()]})


def resume(msg):
    """Ends a pause. With "replay" (a restore: a new host) every journaled
    event after the last acknowledged one is sent again; without (the
    checkpoint failed, same host) only those not sent yet."""
    global PAUSED
    PAUSED = False
    for execution in list(JOURNALS.values()):
        if msg.get("replay"):
            execution.written = execution.acked
        execution.flush_journal()
    for execution in list(EXECS.values()):
        ended = execution.pending_exit is not None
        # A session cell that ended already left the session's pipes
        # unwatched (the next cell watches them); finish reads what is left.
        if not (ended and execution.session is not None):
            for fd in execution.out_fds:
                try:
                    SEL.register(fd, selectors.EVENT_READ, ("out", execution))
                except (KeyError, ValueError):
                    pass
        if ended:
            code, execution.pending_exit = execution.pending_exit, None
            execution.finish(code)
    emit({"ev": "resumed", "id": msg["id"]})


def ack(msg):
    execution = JOURNALS.get(msg["exec"])
    if execution is not None:
        execution.ack(int(msg["seq"]))


# TCP states in /proc/net/tcp that hold no connection: LISTEN, CLOSE.
IDLE_TCP_STATES = ("0A", "07")


def is_loopback_hex(address):
    """True for a /proc/net/tcp{,6} address on loopback (127/8, ::1, ::ffff:127/8)."""
    host = address.split(":")[0]
    if len(host) == 8:
        return host[6:8] == "7F"
    return host == "00000000000000000000000001000000" or (
        host[:24] == "0000000000000000FFFF0000" and host[30:32] == "7F")


def external_tcp():
    """(inode, remote) of every TCP socket connected to something off loopback."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] in IDLE_TCP_STATES or is_loopback_hex(fields[2]):
                continue
            found.append((fields[9], fields[2]))
    return found


def close_connections(msg):
    """Ends every process holding a connection off loopback: this runsc cannot
    checkpoint a sandbox with one open (the host turns the closes into resets)."""
    inodes = {"socket:[%s]" % inode for inode, _ in external_tcp()}
    owners = set()
    if inodes:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                for fd in os.listdir("/proc/%s/fd" % entry):
                    if os.readlink("/proc/%s/fd/%s" % (entry, fd)) in inodes:
                        owners.add(int(entry))
                        break
            except OSError:
                continue
    for pid in owners:
        kill_tree(pid)
    deadline = time.time() + 1.0
    while owners and time.time() < deadline:
        loop_once(0.05)
        if not external_tcp():
            break
    emit({"ev": "ready", "id": msg["id"], "killed": sorted(owners),
          "remaining": [remote for _, remote in external_tcp()]})


class ChunkWriter:
    def __init__(self, exec_id):
        self.id = exec_id
        self.size = 0

    def write(self, data):
        if data:
            self.size += len(data)
            emit({"ev": "chunk", "id": self.id, "data": b64(bytes(data))})
        return len(data)

    def flush(self):
        pass


def add_member(tar, path):
    """Adds one file, directory or symlink. Regular files are always stored
    whole: a hard-link member would be skipped on extraction."""
    import tarfile
    info = tar.gettarinfo(path, arcname=path.lstrip("/"))
    if os.path.isfile(path) and not os.path.islink(path):
        info.type = tarfile.REGTYPE
        info.linkname = ""
        with open(path, "rb") as data:
            tar.addfile(info, data)
    else:
        tar.addfile(info)


def archive(msg):
    import tarfile  # only snapshots need it: keep it off the boot path
    since = msg.get("since", START_TIME)
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
    emit({"ev": "done", "id": msg["id"], "size": writer.size, "entries": count})


def extract_chunk(msg):
    path = "/tmp/.sandboxd-extract-%s" % msg["id"]
    with open(path, "ab") as target:
        target.write(base64.b64decode(msg["data"]))


def extract_end(msg):
    path = "/tmp/.sandboxd-extract-%s" % msg["id"]
    count = 0
    import tarfile
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            for member in tar:
                name = member.name
                if name.startswith("/") or ".." in name.split("/"):
                    continue
                if not (member.isfile() or member.isdir() or member.issym()):
                    continue
                # Members were checked above; newer Pythons would otherwise
                # apply their default filter (and refuse absolute symlinks).
                trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
                tar.extract(member, "/", set_attrs=True, **trusted)
                count += 1
    except (OSError, tarfile.TarError) as err:
        emit({"ev": "error", "id": msg["id"], "message": "cannot extract the snapshot: %s" % err})
        return
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    emit({"ev": "done", "id": msg["id"], "entries": count})


# --- workspace sync (seed 004): the host plans, the agent touches files ----
#
# Paths are relative to the workspace root and checked here again (the host
# checks them too): no absolute paths, no "..", and no symlink anywhere on the
# way, so nothing outside the root is ever read, written or deleted.

STATE_NAME = ".sandbox-state"
SYNC_TEMP_PREFIX = ".sandbox-sync-"
WRITES = {}


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
        import stat as stat_module
        if not stat_module.S_ISDIR(st.st_mode):
            raise WorkspaceError("%r: a parent is a symlink or not a directory" % rel)
    return os.path.join(root, *parts)


def ws_is_internal(name):
    return name in (STATE_NAME, STATE_NAME + ".tmp") or name.startswith(SYNC_TEMP_PREFIX)


def md5_file(path):
    import hashlib
    digest = hashlib.md5()
    with open(path, "rb", buffering=0) as source:
        while True:
            block = source.read(READ_CHUNK * 4)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def read_local_state(root):
    try:
        with open(os.path.join(root, STATE_NAME), "rb") as source:
            state = json.loads(source.read())
        files = {entry["path"]: entry for entry in state.get("files", [])}
        return float(state.get("last_synced_at", 0)), files
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0.0, {}


def ws_scan(msg):
    """Lists the workspace's regular files with md5, size and mtime. A file's
    md5 is reused from the local state file when its size and mtime are the
    recorded ones and it was not modified within the second of that sync (git's
    "racy clean" rule), unless the state is older than `stale_s`."""
    import stat as stat_module
    root = msg["root"]
    max_file = msg.get("max_file_bytes")
    max_total = msg.get("max_total_bytes")
    scanned_at = time.time()
    synced_at, cached = read_local_state(root)
    synced = [cached[path] for path in sorted(cached)]
    if scanned_at - synced_at > msg.get("stale_s", 3600):
        cached = {}
    max_files = msg.get("max_files")
    sweep_sync_temps(root)
    files, refused = [], []
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
                refused.append({"path": rel.encode("utf-8", "replace").decode(), "reason": "the name is not UTF-8"})
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if stat_module.S_ISLNK(st.st_mode):
                target = os.path.realpath(full)
                if target != root_real and not target.startswith(root_real + "/"):
                    refused.append({"path": rel, "reason": "a symlink that escapes the workspace"})
                else:
                    refused.append({"path": rel, "reason": "a symlink (only regular files are synced)"})
                continue
            if not stat_module.S_ISREG(st.st_mode):
                continue
            if max_files is not None and len(files) >= max_files:
                emit({"ev": "error", "id": msg["id"],
                      "message": "the workspace holds more than the %d-file limit" % max_files})
                return
            if max_file is not None and st.st_size > max_file:
                refused.append({"path": rel, "reason": "larger than the %d-byte file limit" % max_file})
                continue
            total += st.st_size
            if max_total is not None and total > max_total:
                emit({"ev": "error", "id": msg["id"],
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
                    refused.append({"path": rel, "reason": "unreadable: %s" % err.strerror})
                    continue
                hashed += 1
            files.append({"path": rel, "checksum": checksum, "size": st.st_size, "modified_at": modified})
    emit({"ev": "done", "id": msg["id"], "files": files, "refused": refused, "hashed": hashed,
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
    emit({"ev": "done", "id": msg["id"]})


def ws_read(msg):
    """Streams one file's bytes as chunks; the reply carries the md5 and size
    of exactly the bytes sent (the file may have changed since the scan)."""
    import hashlib
    path = ws_target(msg["root"], msg["path"])
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise WorkspaceError("cannot read %r: %s" % (msg["path"], err.strerror))
    digest = hashlib.md5()
    size = 0
    limit = msg.get("max_file_bytes")
    with os.fdopen(fd, "rb", buffering=0) as source:
        while True:
            block = source.read(READ_CHUNK * 3)
            if not block:
                break
            size += len(block)
            if limit is not None and size > limit:
                raise WorkspaceError("%r grew past the %d-byte file limit" % (msg["path"], limit))
            digest.update(block)
            emit({"ev": "chunk", "id": msg["id"], "data": b64(block)})
    emit({"ev": "done", "id": msg["id"], "checksum": digest.hexdigest(), "size": size})


def ws_write_chunk(msg):
    import hashlib
    write = WRITES.get(msg["id"])
    if write is None:
        root = msg["root"]
        os.makedirs(root, exist_ok=True)
        temp = os.path.join(root, SYNC_TEMP_PREFIX + str(msg["id"]))
        write = WRITES[msg["id"]] = [open(temp, "wb"), hashlib.md5(), temp]
    try:
        data = base64.b64decode(msg["data"])
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
    import hashlib
    root = msg["root"]
    write = WRITES.pop(msg["id"], None)
    if write is None:  # an empty file: no chunk came
        temp = os.path.join(root, SYNC_TEMP_PREFIX + str(msg["id"]))
        os.makedirs(root, exist_ok=True)
        write = [open(temp, "wb"), hashlib.md5(), temp]
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
    emit({"ev": "done", "id": msg["id"]})


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
    emit({"ev": "done", "id": msg["id"], "deleted": deleted})


def ws_state(msg):
    """Writes the local state file atomically (temporary file + rename)."""
    root = msg["root"]
    os.makedirs(root, exist_ok=True)
    temp = os.path.join(root, STATE_NAME + ".tmp")
    with open(temp, "w") as target:
        target.write(msg["content"])
        target.flush()
        os.fsync(target.fileno())
    os.replace(temp, os.path.join(root, STATE_NAME))
    emit({"ev": "done", "id": msg["id"]})


WORKSPACE_OPS = {
    "ws_scan": ws_scan,
    "ws_read": ws_read,
    "ws_write_chunk": ws_write_chunk,
    "ws_write_end": ws_write_end,
    "ws_write_abort": ws_write_abort,
    "ws_delete": ws_delete,
    "ws_state": ws_state,
}


def handle(msg):
    op = msg.get("op")
    if op == "exec":
        start_exec(msg)
    elif op == "stdin":
        execution = EXECS.get(msg["id"])
        if execution is not None:
            execution.write_stdin(base64.b64decode(msg["data"]))
    elif op == "stdin_close":
        execution = EXECS.get(msg["id"])
        if execution is not None:
            execution.close_stdin()
    elif op == "kill":
        kill_exec(msg["id"])
    elif op == "ping":
        emit({"ev": "pong", "id": msg.get("id"), "version": VERSION, "running": list(EXECS)})
    elif op == "prepare_checkpoint":
        prepare_checkpoint(msg)
    elif op == "ack":
        ack(msg)
    elif op == "journals":
        journals(msg)
    elif op == "resume":
        resume(msg)
    elif op == "close_connections":
        close_connections(msg)
    elif op == "archive":
        archive(msg)
    elif op == "extract_chunk":
        extract_chunk(msg)
    elif op == "extract_end":
        extract_end(msg)
    elif op in WORKSPACE_OPS:
        try:
            WORKSPACE_OPS[op](msg)
        except (WorkspaceError, OSError) as err:
            emit({"ev": "error", "id": msg.get("id"), "message": str(err)})
    else:
        emit({"ev": "error", "id": msg.get("id"), "message": "unknown op %r" % op})


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        owner = PIDS.pop(pid, None)
        if isinstance(owner, Execution):
            owner.finish(exit_code(status))
        elif isinstance(owner, PythonSession):
            owner.on_exit(exit_code(status))


COMMANDS = []
COMMANDS_LOCK = threading.Lock()
COMMAND_WAKE = os.pipe()


def read_commands_forever():
    """Reads host commands with blocking reads on a thread of its own.

    After a restore, epoll readiness on the init's host stdio (which runsc
    swaps for the restoring caller's) is not reliable, but blocking reads are;
    so this thread reads and hands whole lines to the main loop through an
    in-sandbox pipe.
    """
    pending = bytearray()
    while True:
        try:
            data = os.read(IN, READ_CHUNK)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            # The host closed our stdin (it is gone, or this sandbox is being
            # checkpointed). A restore hands us a new one at the same fd.
            time.sleep(0.05)
            continue
        pending.extend(data)
        lines = []
        while True:
            newline = pending.find(b"\n")
            if newline < 0:
                break
            lines.append(bytes(pending[:newline]))
            del pending[:newline + 1]
        if lines:
            with COMMANDS_LOCK:
                COMMANDS.extend(lines)
            os.write(COMMAND_WAKE[1], b"x")


def run_commands():
    try:
        os.read(COMMAND_WAKE[0], 4096)
    except BlockingIOError:
        pass
    with COMMANDS_LOCK:
        lines = COMMANDS[:]
        del COMMANDS[:]
    for line in lines:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError as err:
            emit({"ev": "error", "id": None, "message": "bad command: %s" % err})
            continue
        try:
            handle(msg)
        except Exception as err:  # never let one bad command kill PID 1
            emit({"ev": "error", "id": msg.get("id"), "message": "%s: %s" % (type(err).__name__, err)})


def loop_once(timeout):
    for key, _ in SEL.select(timeout):
        kind, owner = key.data
        if kind == "cmd":
            run_commands()
        elif kind == "out":
            owner.pump(key.fd)
        elif kind == "stdin":
            owner.flush_stdin()
        elif kind == "done":
            owner.on_done()
        elif kind == "sig":
            try:
                os.read(key.fd, 4096)
            except OSError:
                pass
    reap()


def main():
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    SEL.register(wake_r, selectors.EVENT_READ, ("sig", None))
    os.set_blocking(COMMAND_WAKE[0], False)
    SEL.register(COMMAND_WAKE[0], selectors.EVENT_READ, ("cmd", None))
    threading.Thread(target=read_commands_forever, daemon=True).start()
    drop_privileges()
    emit({"ev": "hello", "version": VERSION, "pid": os.getpid()})
    while True:
        loop_once(1.0)


main()
