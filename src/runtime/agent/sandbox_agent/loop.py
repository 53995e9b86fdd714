"""The agent's main loop: one selector over the host's commands (handed over
by the reader thread), every execution's pipes and the signal wake-up pipe;
then the reaping every PID 1 owes its orphans."""
import os
import selectors
import signal
import sys
import time

from . import config, protocol, state
from .execution import Execution, PythonSession, exit_code
from .handlers import handle

COMMANDS = None  # the CommandReader, once `main` started it


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        owner = state.PIDS.pop(pid, None)
        if isinstance(owner, Execution):
            owner.finish(exit_code(status))
        elif isinstance(owner, PythonSession):
            owner.on_exit(exit_code(status))


def run_commands():
    for msg in COMMANDS.take():
        handle(msg)


def loop_once(timeout):
    for key, _ in state.SEL.select(timeout):
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


state.turn = loop_once


def main(argv=None):
    global COMMANDS
    argv = sys.argv if argv is None else argv
    config.load(argv[1] if len(argv) > 1 else "")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    state.SEL.register(wake_r, selectors.EVENT_READ, ("sig", None))
    COMMANDS = protocol.CommandReader()
    state.SEL.register(COMMANDS.wake, selectors.EVENT_READ, ("cmd", None))
    COMMANDS.start()
    config.drop_privileges()
    # What the boot wrote (the home's skel) is not the user's change.
    state.START_TIME = time.time()
    protocol.emit({"ev": "hello", "version": protocol.VERSION, "pid": os.getpid()})
    while True:
        loop_once(1.0)
