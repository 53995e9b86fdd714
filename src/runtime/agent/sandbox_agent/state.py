"""What the agent's modules share: one selector for every pipe the main loop
watches, and the executions by id and by pid. One agent per process: module
state is the agent's state (tests reset it with `reset`)."""
import selectors
import time

START_TIME = time.time()
SEL = selectors.DefaultSelector()
EXECS = {}
# Resumable executions whose events the host has not all acknowledged
# (running or ended), by id; at most the newest one.
JOURNALS = {}
# Set by a checkpoint that keeps executions, until "resume".
PAUSED = False
PIDS = {}  # main pid -> Execution or PythonSession


def turn(timeout):
    """One turn of the main loop (`loop.loop_once`, installed by the loop
    module): for a command that must wait for events while it is handled
    (`kill` waiting for a Python cell to stop). Kept here so that the
    execution module does not import the loop, which imports it."""
    raise RuntimeError("the main loop is not loaded")


def reset():
    """Forgets every execution (tests: a fresh agent)."""
    global SEL, PAUSED
    SEL.close()
    SEL = selectors.DefaultSelector()
    EXECS.clear()
    JOURNALS.clear()
    PIDS.clear()
    PAUSED = False
