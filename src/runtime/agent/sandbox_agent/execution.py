"""Executions: a process (or a persistent-session cell) and its pipes, made
here inside the sandbox, whose bytes the agent relays; ops exec, stdin,
stdin_close and kill.

Resumable executions (docs/decisions/0012-executions-survive-a-move.md)
number their events ("seq") and keep them in a journal until the host
acknowledges them (see `journal`); while the agent is paused for a
checkpoint their exit is held back.
"""
import os
import selectors
import signal
import subprocess
import time

from . import config, flow, protocol, state

REPL_SOURCE = r'''
import os, signal, sys, traceback
cmd_fd, done_fd = int(sys.argv[1]), int(sys.argv[2])
# Rich results (a cell sent with flag "1"): each is a line "R<json>" on the
# done pipe before the cell's status line. matplotlib draws with an inline
# backend whose show() hands the figures over (as Jupyter's does); figures
# left open are handed over at the end of the cell.
RICH = [False]
MAX_RESULT = 16 << 20
INLINE_BACKEND = """
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas
from matplotlib.backend_bases import FigureManagerBase as FigureManager
def show(*args, **kwargs):
    import __main__
    __main__.flush_figures()
"""
class InlineBackendFinder:
    """Provides the inline backend's module from memory when matplotlib
    imports it: nothing is written to the user's filesystem."""
    NAME = "sandboxd_inline_backend"
    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        import importlib.util
        return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        exec(INLINE_BACKEND, module.__dict__)
def install_inline_backend():
    if os.environ.get("MPLBACKEND"):
        return
    sys.meta_path.append(InlineBackendFinder())
    os.environ["MPLBACKEND"] = "module://" + InlineBackendFinder.NAME
install_inline_backend()
def send_result(kind, data):
    import json
    line = json.dumps({"kind": kind, "data": data}, separators=(",", ":")).encode()
    if len(line) > MAX_RESULT:
        sys.stderr.write("[sandboxd] a %s of %d bytes was not sent (the limit is %d)\n" % (kind, len(line), MAX_RESULT))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    write_done(b"R" + line + b"\n")
def write_done(data):
    view = memoryview(data)
    while view:
        view = view[done.write(view):]
def bundle(value):
    data = {"text/plain": repr(value)}
    for method, mime in (("_repr_html_", "text/html"), ("_repr_png_", "image/png"), ("_repr_svg_", "image/svg+xml")):
        render = getattr(type(value), method, None)
        if render is None:
            continue
        try:
            out = render(value)
        except Exception:
            continue
        if isinstance(out, bytes) and mime == "image/png":
            import base64
            out = base64.b64encode(out).decode()
        if isinstance(out, str):
            data[mime] = out
    return data
def flush_figures():
    if not RICH[0]:
        return
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    import base64, io
    for number in pyplot.get_fignums():
        figure = pyplot.figure(number)
        buffer = io.BytesIO()
        try:
            figure.savefig(buffer, format="png", bbox_inches="tight")
        except Exception:
            report()
            continue
        finally:
            pyplot.close(figure)
        send_result("display_data", {"image/png": base64.b64encode(buffer.getvalue()).decode(), "text/plain": repr(figure)})
def run_rich(code):
    import ast
    tree = ast.parse(code, "<cell>", "exec")
    last = None
    # The last expression's value is shown, unless a ";" ends the cell (as in Jupyter).
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), namespace)
        if value is not None:
            namespace["_"] = value
            send_result("execute_result", bundle(value))
# An interrupt (the host's kill) only ever stops a running cell; between
# cells it is ignored, so a late kill cannot end the session.
signal.signal(signal.SIGINT, signal.SIG_IGN)
cmd = os.fdopen(cmd_fd, "rb", buffering=0)
done = os.fdopen(done_fd, "wb", buffering=0)
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
def report():
    kind, value, tb = sys.exc_info()
    # The traceback starts at the cell: this program's own frames are left out.
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
    traceback.print_exception(kind, value, tb)
def read_exact(n):
    buf = b""
    while len(buf) < n:
        part = cmd.read(n - len(buf))
        if not part:
            sys.exit(0)
        buf += part
    return buf
while True:
    RICH[0] = read_exact(1) == b"1"
    size = int(read_exact(10).decode(), 16)
    code = read_exact(size).decode("utf-8", "replace")
    status = 0
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if RICH[0]:
            run_rich(code)
        else:
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
        flush_figures()
    except BaseException:
        report()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    write_done(b"%d\n" % status)
'''


def exit_code(status):
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 255


def set_nonblocking(fd):
    os.set_blocking(fd, False)


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


def unregister_outputs(execution):
    for fd in list(execution.out_fds):
        try:
            state.SEL.unregister(fd)
        except (KeyError, ValueError):
            pass


# The most input an execution may have waiting for its program to read it.
# Past it the input is dropped, with a notice on the program's output: a
# program that reads no input must not make the agent hold whatever the
# client sends. A host that asks for a stdin window (`exec`'s
# `stdin_window`) gets at most this, and waits for the `stdin_taken` reports
# instead of sending more: its input is never dropped.
MAX_STDIN_PENDING = 8 << 20

# Input taken by a program is reported to the host once this much (or a
# quarter of the window, if less) has been: a report per megabyte, not per
# write.
STDIN_REPORT_BYTES = 1 << 20

STDIN_DROPPED = (b"\n[sandboxd] input dropped: the program has not read the %d MiB "
                 b"of input already waiting for it\n" % (MAX_STDIN_PENDING >> 20))


class Execution:
    """One execution: a process (or a persistent-session cell) and its pipes."""

    flow = None  # a terminal's flow control (`flow.TerminalFlow`)
    stdin_window = None  # the stdin window granted to the host, if any
    stdin_taken = 0  # input taken (or let go) and not yet reported

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
        self.stdin_pending = bytearray()
        self.stdin_dropping = False  # input is being dropped (noticed once)
        self.stdin_close_requested = False
        self.out_fds = dict(out_fds)  # fd -> stream number (1 or 2)
        self.session = session
        self.finished = False
        for fd in self.out_fds:
            set_nonblocking(fd)
            state.SEL.register(fd, selectors.EVENT_READ, ("out", self))
        if stdin_fd is not None:
            set_nonblocking(stdin_fd)

    def pump(self, fd):
        """Reads what a wake found: one read, or for a terminal up to
        `flow.PUMP_BYTES`, holding its session while it stays full."""
        stream = self.out_fds.get(fd)
        if stream is None:
            return
        taken = 0
        while True:
            try:
                data = os.read(fd, protocol.READ_CHUNK)
            except BlockingIOError:
                if self.flow is not None:
                    self.flow.drained()
                return
            except OSError:
                data = b""
            if not data:
                if self.flow is not None:
                    self.flow.release()
                if self.session is None:
                    self.close_out(fd)
                return
            self.output(stream, data)
            if self.flow is None:
                return
            taken += len(data)
            if taken >= flow.PUMP_BYTES:
                self.flow.still_full()
                return

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
        self.event({"ev": "out", "id": self.id, "fd": stream, "data": protocol.b64(data)})

    def flush_partial(self):
        for stream in list(self.partial):
            data = self.partial.pop(stream)
            self.event({"ev": "out", "id": self.id, "fd": stream, "data": protocol.b64(data)})

    def event(self, event):
        """Emits one event of this execution (journaled when resumable)."""
        if not self.resumable:
            protocol.emit(event)
            return
        self.seq += 1
        event["seq"] = self.seq
        self.journal.append((self.seq, event))
        if not state.PAUSED:
            self.flush_journal()

    def flush_journal(self):
        for seq, event in self.journal:
            if seq > self.written:
                protocol.emit(event)
                self.written = seq

    def ack(self, seq):
        if seq <= self.acked:
            return
        self.acked = min(seq, self.seq)
        self.journal = [entry for entry in self.journal if entry[0] > self.acked]
        if self.finished and not self.journal:
            state.JOURNALS.pop(self.id, None)

    def drain(self, limit=1 << 20):
        """Reads what is already in the pipes, up to `limit` bytes per pipe.

        Bounded: a background process that keeps writing after the main one
        exited must not keep PID 1 busy forever.
        """
        for fd in list(self.out_fds):
            taken = 0
            while taken < limit:
                try:
                    data = os.read(fd, protocol.READ_CHUNK)
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
                state.SEL.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)

    def grant_stdin_window(self, asked):
        """The stdin window for a host that `asked` for one (None if it did
        not, or asked for no number)."""
        if isinstance(asked, bool) or not isinstance(asked, int) or asked <= 0:
            return None
        self.stdin_window = min(asked, MAX_STDIN_PENDING)
        return self.stdin_window

    def took_stdin(self, count):
        """Counts input the program took, or that was let go; reports it to a
        host that keeps a window, a batch at a time (never while paused: the
        host is being swapped)."""
        if self.stdin_window is None or count <= 0:
            return
        self.stdin_taken += count
        batch = max(1, min(STDIN_REPORT_BYTES, self.stdin_window // 4))
        if self.stdin_taken >= batch and not state.PAUSED:
            protocol.emit({"ev": "stdin_taken", "id": self.id, "count": self.stdin_taken})
            self.stdin_taken = 0

    def write_stdin(self, data):
        if self.stdin_fd is None:
            self.took_stdin(len(data))
            return
        # Once input is dropped, all of it is until the program has read
        # what waits: one gap with its notice, not holes.
        if self.stdin_dropping or len(self.stdin_pending) + len(data) > MAX_STDIN_PENDING:
            if not self.stdin_dropping:
                self.stdin_dropping = True
                stream = 2 if 2 in self.out_fds.values() else 1
                self.output(stream, STDIN_DROPPED)
            self.took_stdin(len(data))
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
                self.took_stdin(len(self.stdin_pending))
                self.stdin_pending.clear()
                break
            del self.stdin_pending[:written]
            self.took_stdin(written)
        self.stdin_dropping = False
        self.watch_stdin(False)
        if self.stdin_close_requested and self.session is None:
            self.close_stdin_now()

    def watch_stdin(self, on):
        if self.stdin_fd is None:
            return
        try:
            if on:
                state.SEL.register(self.stdin_fd, selectors.EVENT_WRITE, ("stdin", self))
            else:
                state.SEL.unregister(self.stdin_fd)
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
        if state.PAUSED and self.resumable:
            # Being checkpointed: the exit (and the output before it) waits
            # for the host that resumes the sandbox.
            self.pending_exit = code
            return
        self.finished = True
        if self.flow is not None:
            self.flow.release()  # nothing of the session stays stopped
        self.drain()
        self.flush_partial()
        if self.session is None:
            for fd in list(self.out_fds):
                self.close_out(fd)
            self.stdin_pending.clear()
            self.stdin_close_requested = True
            self.close_stdin_now()
        else:
            # The session's stdin outlives the cell: drop what this cell left.
            self.stdin_pending.clear()
            self.watch_stdin(False)
        state.EXECS.pop(self.id, None)
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
            [config.PYTHON, "-u", "-c", REPL_SOURCE, str(cmd_r), str(done_w)],
            stdin=in_r, stdout=out_w, stderr=err_w, pass_fds=(cmd_r, done_w),
            close_fds=True, start_new_session=True, cwd=config.HOME, env=config.user_env({}))
        for fd in (cmd_r, done_w, in_r, out_w, err_w):
            os.close(fd)
        self.proc.returncode = None
        set_nonblocking(self.done_r)
        state.SEL.register(self.done_r, selectors.EVENT_READ, ("done", self))
        self.out = {out_r: 1, err_r: 2}
        self.current = None
        self.done_buffer = b""
        self.alive = True
        state.PIDS[self.proc.pid] = self

    def run(self, exec_id, code, resumable=False, results=False):
        self.ensure()
        execution = Execution(exec_id, self.proc.pid, self.stdin_fd, self.out, session=self,
                              resumable=resumable)
        self.current = execution
        data = code.encode()
        flag = b"1" if results else b"0"
        os.write(self.cmd_w, flag + b"%010x" % len(data) + data)
        return execution

    def on_done(self):
        try:
            data = os.read(self.done_r, 4096)
        except BlockingIOError:
            return
        self.done_buffer += data
        while b"\n" in self.done_buffer:
            line, self.done_buffer = self.done_buffer.split(b"\n", 1)
            if line.startswith(b"R"):
                # A rich result: an output event on fd 3, in order with the
                # cell's other events.
                if self.current is not None:
                    self.current.drain()
                    self.current.output(3, line[1:])
                continue
            if self.current is not None:
                execution, self.current = self.current, None
                unregister_outputs(execution)
                execution.finish(int(line or b"1"))

    def on_exit(self, code):
        # The interpreter died (os._exit, a crash, a kill): the session restarts
        # on the next cell; the running cell ends with the interpreter's code.
        for fd in (self.done_r, self.cmd_w, self.stdin_fd, *self.out):
            try:
                state.SEL.unregister(fd)
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


SESSION = PythonSession()


def start_exec(msg):
    exec_id = msg["id"]
    if state.EXECS:
        protocol.error(exec_id, "another execution is running")
        return
    resumable = bool(msg.get("resumable"))
    # A new execution supersedes what an earlier one left unacknowledged,
    # as the host's replay log keeps only the current execution.
    state.JOURNALS.clear()
    if msg.get("session"):
        execution = SESSION.run(exec_id, msg["code"], resumable, bool(msg.get("results")))
        state.EXECS[exec_id] = execution
        if resumable:
            state.JOURNALS[exec_id] = execution
        announce_start(msg, execution)
        return
    load_prctl()
    if msg.get("pty"):
        start_terminal(msg, exec_id, resumable)
        return
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(
            msg["argv"], stdin=in_r, stdout=out_w, stderr=err_w, close_fds=True,
            start_new_session=True, preexec_fn=restore_default_signals,
            cwd=msg.get("cwd") or config.HOME, env=config.user_env(msg.get("env") or {}))
    except OSError as err:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        protocol.error(exec_id, "cannot start %s: %s" % (msg["argv"][0], err))
        return
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    # Reaped by the agent's own loop (it is PID 1), never by Popen.
    proc.returncode = 0
    stdin_fd, out_fds = in_w, {out_r: 1, err_r: 2}
    execution = Execution(exec_id, proc.pid, stdin_fd, out_fds, resumable=resumable)
    state.EXECS[exec_id] = execution
    if resumable:
        state.JOURNALS[exec_id] = execution
    state.PIDS[proc.pid] = execution
    announce_start(msg, execution)


def announce_start(msg, execution):
    """`started`, with the stdin window granted if the host asked for one."""
    event = {"ev": "started", "id": execution.id, "pid": execution.pid}
    window = execution.grant_stdin_window(msg.get("stdin_window"))
    if window is not None:
        event["stdin_window"] = window
    protocol.emit(event)


def set_size(fd, size):
    import fcntl
    import struct
    import termios
    rows = max(1, min(int(size.get("rows", 24)), 1000))
    cols = max(1, min(int(size.get("cols", 80)), 1000))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


# prctl(2), looked up in the parent before the first execution's fork (an
# import between fork and exec could wait on a lock held by another thread);
# False where it cannot be had.
PRCTL = None
PR_SET_CHILD_SUBREAPER = 36


def load_prctl():
    global PRCTL
    if PRCTL is None:
        try:
            import ctypes
            PRCTL = ctypes.CDLL(None, use_errno=True).prctl
        except (ImportError, OSError, AttributeError):
            PRCTL = False


def restore_default_signals():
    """In the child, before exec: SIGINT and SIGTERM back to their defaults,
    and the execution's program made a child subreaper.

    The agent (PID 1) ignores SIGINT and SIGTERM, and an ignored signal
    stays ignored across exec, so without this no program in the sandbox
    could be interrupted: Ctrl-C on a terminal, `kill`, `timeout` would do
    nothing. (Popen's restore_signals covers SIGPIPE only.)

    As a subreaper (kept across exec), the program adopts what its children
    orphan while it runs: a process that left the execution's session and
    group with `setsid` and whose parent exited is still in the tree a kill
    walks (`kill_tree`), instead of the agent's. A kernel without it (the
    call fails) leaves the escape open, nothing else."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if PRCTL:
        PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def become_terminal_owner():
    """In the child, after setsid: the terminal on fd 0 becomes its
    controlling one, and its signals are the defaults again."""
    import fcntl
    import termios
    restore_default_signals()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def start_terminal(msg, exec_id, resumable):
    """An execution on a pseudo-terminal of `pty`'s size: one stream of raw
    bytes each way (output as fd 1), resized with the `resize` op."""
    master, slave = os.openpty()
    try:
        set_size(slave, msg["pty"])
        env = dict(msg.get("env") or {})
        env.setdefault("TERM", "xterm-256color")
        proc = subprocess.Popen(
            msg["argv"], stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            start_new_session=True, preexec_fn=become_terminal_owner,
            cwd=msg.get("cwd") or config.HOME, env=config.user_env(env))
    except (OSError, subprocess.SubprocessError) as err:
        os.close(master)
        os.close(slave)
        protocol.error(exec_id, "cannot start %s: %s" % (msg["argv"][0], err))
        return
    os.close(slave)
    proc.returncode = 0
    execution = Execution(exec_id, proc.pid, os.dup(master), {master: 1}, resumable=resumable)
    execution.terminal = master
    execution.flow = flow.TerminalFlow(proc.pid)
    state.EXECS[exec_id] = execution
    if resumable:
        state.JOURNALS[exec_id] = execution
    state.PIDS[proc.pid] = execution
    announce_start(msg, execution)


def resize(msg):
    execution = state.EXECS.get(msg["id"])
    terminal = getattr(execution, "terminal", None)
    if terminal is not None and terminal in execution.out_fds:
        try:
            set_size(terminal, msg)
        except (OSError, ValueError, TypeError):
            pass


def stdin(msg):
    execution = state.EXECS.get(msg["id"])
    if execution is not None:
        execution.write_stdin(protocol.unb64(msg["data"]))


def stdin_close(msg):
    execution = state.EXECS.get(msg["id"])
    if execution is not None:
        execution.close_stdin()


# How long kill_tree sweeps for what its first kill missed.
KILL_SWEEP_S = 1.0


def processes():
    """(pid, state, ppid, pgrp, session) of every process, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            found.append((int(entry), fields[0], int(fields[1]), int(fields[2]), int(fields[3])))
        except (OSError, IndexError, ValueError):
            continue
    return found


def descendants(root_pid, table=None):
    """Pids of root_pid's process tree (by parent links in /proc)."""
    children = {}
    for pid, _, ppid, _, _ in processes() if table is None else table:
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            tree.append(child)
            todo.append(child)
    return tree


def alive_in_tree(pid):
    """What is still alive (not a zombie) of pid, its descendants, its
    process group and its session (an execution leads both)."""
    table = processes()
    tree = {pid} | set(descendants(pid, table))
    return sorted(p for p, state, _, group, session in table
                  if state != b"Z" and p != os.getpid()
                  and (p in tree or group == pid or session == pid))


def kill_tree(pid):
    """SIGKILL to pid, its descendants, its process group and its session,
    swept again until none of them is alive (at most KILL_SWEEP_S). A child
    forked while the first kill was under way escapes one sweep: gVisor lets
    a fork through with SIGKILL pending (Linux fails it), and the child is
    in neither the tree walked before nor, if it was forked after the
    group's kill, dead. A process this agent may not signal is left after
    its first refusal (it would hold the sweep for its whole bound)."""
    deadline = time.monotonic() + KILL_SWEEP_S
    refused = set()
    # Stopped first, until every process of the tree is: a stopped process
    # forks nothing, and a child it forked just before (that the walk of
    # /proc may have missed) keeps it as parent, so the next walk finds the
    # child even if it left the session. Killed at once instead, such a
    # parent would hand the child to PID 1 and lose it.
    stopped = set()
    while time.monotonic() < deadline:
        victims = [victim for victim in alive_in_tree(pid)
                   if victim not in refused and victim not in stopped]
        if not victims:
            break
        stopped.update(signal_each(victims, signal.SIGSTOP, refused))
    while True:
        victims = [victim for victim in alive_in_tree(pid) if victim not in refused]
        if not victims:
            return
        signal_each(victims, signal.SIGKILL, refused)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def signal_each(victims, signum, refused):
    """Sends `signum` to each of `victims`; those it may not signal go into
    `refused`. Returns those signalled."""
    signalled = []
    for victim in victims:
        try:
            os.kill(victim, signum)
            signalled.append(victim)
        except PermissionError:
            refused.add(victim)
        except OSError:
            pass
    return signalled


def kill(msg):
    exec_id = msg["id"]
    execution = state.EXECS.get(exec_id)
    if execution is None:
        return
    if execution.session is not None:
        SESSION.on_done()  # the cell may have finished already
        if exec_id not in state.EXECS:
            return
        os.kill(execution.pid, signal.SIGINT)
        deadline = time.time() + 1.0
        while exec_id in state.EXECS and time.time() < deadline:
            state.turn(0.05)
        if exec_id not in state.EXECS:
            return
    kill_tree(execution.pid)
