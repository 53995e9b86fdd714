"""The channel to the host: JSON lines on the init's stdin and stdout.

Writing events never raises (a host that went away is not the agent's
problem: a restore hands it a new stdout at the same fd); reading commands
happens on a thread of its own with blocking reads (see `CommandReader`).
"""
import base64
import json
import os
import threading
import time

# The protocol version: `hello` and `pong` carry it, the host refuses an agent
# that speaks another (and a checkpoint records it). Bump it with
# `AGENT_PROTOCOL_VERSION` in src/runtime/agent_protocol.rs and protocol.json
# when a message changes incompatibly.
VERSION = 1
READ_CHUNK = 65536
# Reads of the host's commands (a pipe never hands over more at once).
COMMAND_READ = 1 << 20

# The host's end: the init process's stdout and stdin (tests swap them).
OUT = 1
IN = 0


def emit(event):
    """Writes one event line; retries a full pipe, ignores a closed one."""
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


def unb64(text):
    return base64.b64decode(text)


def error(request_id, message):
    emit({"ev": "error", "id": request_id, "message": message})


def split_lines(pending, scanned=0):
    """Takes the whole lines out of `pending` (a bytearray), in order.
    `scanned`: how many bytes at its start are known to hold no newline
    (a long line arriving in many reads is then scanned once, not once
    per read)."""
    lines = []
    while True:
        newline = pending.find(b"\n", scanned)
        if newline < 0:
            return lines
        lines.append(bytes(pending[:newline]))
        del pending[:newline + 1]
        scanned = 0


class CommandReader:
    """Reads host commands with blocking reads on a thread of its own.

    After a restore, epoll readiness on the init's host stdio (which runsc
    swaps for the restoring caller's) is not reliable, but blocking reads are;
    so the thread reads and hands whole lines to the main loop through an
    in-sandbox pipe (`wake`, which the main loop watches).
    """

    def __init__(self):
        self.lines = []
        self.lock = threading.Lock()
        self.wake, self.wake_w = os.pipe()
        os.set_blocking(self.wake, False)

    def start(self):
        threading.Thread(target=self.read_forever, daemon=True).start()

    def read_forever(self):
        pending = bytearray()
        while True:
            try:
                data = os.read(IN, COMMAND_READ)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                # The host closed our stdin (it is gone, or this sandbox is
                # being checkpointed). A restore hands us a new one at the same fd.
                time.sleep(0.05)
                continue
            scanned = len(pending)
            pending.extend(data)
            self.hand_over(split_lines(pending, scanned))

    def hand_over(self, lines):
        if lines:
            with self.lock:
                self.lines.extend(lines)
            os.write(self.wake_w, b"x")

    def take(self):
        """The commands read so far (decoded), and errors for bad lines."""
        try:
            os.read(self.wake, 4096)
        except BlockingIOError:
            pass
        with self.lock:
            lines = self.lines[:]
            del self.lines[:]
        commands = []
        for line in lines:
            if not line.strip():
                continue
            try:
                commands.append(json.loads(line))
            except ValueError as err:
                error(None, "bad command: %s" % err)
        return commands
