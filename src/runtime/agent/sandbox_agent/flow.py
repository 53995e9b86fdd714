"""Flow control for terminals. This runsc's pseudo-terminal takes every
write of the program at once and keeps what its reader has not taken yet in
the sentry's memory, without bound: a program that writes faster than the
agent reads (`os.write(1, b'A' * 65535 + b'\\n')` in a loop, about 1.5 MB/s
read under ptrace) grew the sentry by hundreds of MB until the host's memory
cgroup killed the whole sandbox. A terminal on Linux would block the writer.
So while the agent finds the terminal still full after a wake's worth of
reading for `HOLD_AFTER`, it stops (SIGSTOP) every process of the terminal's
session, and continues them (SIGCONT) once it has read all that was queued.
The session leader is stopped first and continued last, so a job-control
shell never sees its job stop. The agent runs as the user, so it may."""
import os
import signal
import time

# Bytes read from a terminal per wake at most (the loop serves others too).
PUMP_BYTES = 256 << 10
# Seconds of a terminal that stays full before its session is stopped.
HOLD_AFTER = 0.05


def session_members(sid):
    """The processes of session `sid`, its leader first."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        pid = int(name)
        try:
            if os.getsid(pid) == sid:
                members.append(pid)
        except OSError:
            continue
    members.sort(key=lambda pid: pid != sid)
    return members


class TerminalFlow:
    """Stops and continues the session of one terminal."""

    def __init__(self, sid):
        self.sid = sid
        self.full_since = None
        self.held = []

    def still_full(self):
        """A wake's worth was read and more is queued."""
        now = time.monotonic()
        if self.full_since is None:
            self.full_since = now
        elif not self.held and now - self.full_since >= HOLD_AFTER:
            self.hold()

    def drained(self):
        """All that was queued is read."""
        self.full_since = None
        self.release()

    def hold(self):
        for pid in session_members(self.sid):
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                continue
            self.held.append(pid)

    def release(self):
        for pid in reversed(self.held):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        self.held = []
