"""Journals of resumable executions across a checkpoint: ops ack, journals
and resume.

A checkpoint with "keep" pauses them (see `checkpoint.prepare`: their pipes
are no longer read, an exit is held back) so that everything not yet
delivered is either in the journal or still in the pipes: both are in the
image. After a restore, op "resume" with "replay" sends the journal again
from the last acknowledged event, then the execution carries on.
"""
import selectors

from . import protocol, state


def ack(msg):
    execution = state.JOURNALS.get(msg["exec"])
    if execution is not None:
        execution.ack(int(msg["seq"]))


def journals(msg):
    """What a restore brings back: the journaled executions and whether paused,
    with each one's stdin window and the room left in it (the new host starts
    from that room: what the old one was not told yet is not reported)."""
    executions = []
    for e in state.JOURNALS.values():
        entry = {"id": e.id, "acked": e.acked, "running": e.id in state.EXECS}
        if e.stdin_window is not None:
            entry["stdin_window"] = e.stdin_window
            entry["stdin_room"] = max(0, e.stdin_window - len(e.stdin_pending))
            e.stdin_taken = 0
        executions.append(entry)
    protocol.emit({"ev": "journals", "id": msg["id"], "paused": state.PAUSED,
                   "executions": executions})


def resume(msg):
    """Ends a pause. With "replay" (a restore: a new host) every journaled
    event after the last acknowledged one is sent again; without (the
    checkpoint failed, same host) only those not sent yet."""
    state.PAUSED = False
    for execution in list(state.JOURNALS.values()):
        if msg.get("replay"):
            execution.written = execution.acked
        execution.flush_journal()
    for execution in list(state.EXECS.values()):
        ended = execution.pending_exit is not None
        # A session cell that ended already left the session's pipes
        # unwatched (the next cell watches them); finish reads what is left.
        if not (ended and execution.session is not None):
            for fd in execution.out_fds:
                try:
                    state.SEL.register(fd, selectors.EVENT_READ, ("out", execution))
                except (KeyError, ValueError):
                    pass
        if ended:
            code, execution.pending_exit = execution.pending_exit, None
            execution.finish(code)
    protocol.emit({"ev": "resumed", "id": msg["id"]})
