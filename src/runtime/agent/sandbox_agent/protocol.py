"""The channel to the host: JSON lines on the init's stdin and stdout.

A message may carry raw bytes (protocol version 2): its object has
`"bytes": N`, and exactly N bytes follow its newline. File chunks travel so,
neither base64-encoded nor parsed as JSON (decision 19); every other field
stays in the JSON line.

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
# `AGENT_PROTOCOL_VERSION` in src/runtime/agent/protocol.rs and protocol.json
# when a message changes incompatibly. 2: messages may carry raw bytes.
VERSION = 2
READ_CHUNK = 65536
# Reads of the host's commands (a pipe never hands over more at once).
COMMAND_READ = 1 << 20
# The most raw bytes one command may carry (the host sends 1 MiB chunks); a
# command announcing more is refused and its bytes skipped, unkept.
MAX_PAYLOAD = 8 << 20
# The most bytes of commands read and not yet taken by the main loop: past
# it the reader thread stops reading, so a host that writes faster than the
# main loop works is held back by the pipe (and its own bound), never held
# in the agent's memory.
MAX_HANDED = 8 << 20
# Where a command's raw bytes are handed to its handler (no JSON key can
# collide: the reader removes any the host sent).
PAYLOAD = "\0payload"

# The host's end: the init process's stdout and stdin (tests swap them).
OUT = 1
IN = 0


def emit(event, payload=None):
    """Writes one event line (followed by `payload`, raw, announced by the
    event's `bytes`); retries a full pipe, ignores a closed one."""
    if payload is not None:
        event["bytes"] = len(payload)
    parts = [(json.dumps(event, separators=(",", ":")) + "\n").encode()]
    if payload:
        parts.append(memoryview(payload))
    write_all(parts)


def write_all(parts):
    views = [memoryview(part) for part in parts]
    while views:
        try:
            written = os.writev(OUT, views)
        except BlockingIOError:
            time.sleep(0.001)
            continue
        except BrokenPipeError:
            return
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def b64(data):
    return base64.b64encode(data).decode("ascii")


def unb64(text):
    return base64.b64decode(text)


def error(request_id, message):
    emit({"ev": "error", "id": request_id, "message": message})


class BadCommand:
    """A command line that could not be read: reported by the main loop."""

    def __init__(self, message, request_id=None):
        self.message = message
        self.request_id = request_id


def parse_command(line):
    """A command line as a message, or a BadCommand."""
    try:
        msg = json.loads(line)
    except ValueError as err:
        return BadCommand("bad command: %s" % err)
    if isinstance(msg, dict):
        msg.pop(PAYLOAD, None)
    return msg


def payload_length(msg):
    """How many raw bytes follow `msg` (0: none); None if it announces a
    count that is no count."""
    if not isinstance(msg, dict) or "bytes" not in msg:
        return 0
    length = msg["bytes"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        return None
    return length


class CommandReader:
    """Reads host commands with blocking reads on a thread of its own.

    After a restore, epoll readiness on the init's host stdio (which runsc
    swaps for the restoring caller's) is not reliable, but blocking reads are;
    so the thread reads and hands whole messages (parsed, with their raw
    bytes) to the main loop through an in-sandbox pipe (`wake`, which the
    main loop watches). A command's raw bytes are read straight into their
    own buffer, at most MAX_PAYLOAD of them.
    """

    def __init__(self, fd=None):
        self.fd = IN if fd is None else fd
        self.lines = []
        self.lock = threading.Lock()
        # Told when the main loop takes what was handed over.
        self.taken = threading.Condition(self.lock)
        self.handed = 0  # bytes handed over and not yet taken
        self.size = 0  # bytes of the last message read (line and payload)
        self.wake, self.wake_w = os.pipe()
        os.set_blocking(self.wake, False)
        self.pending = bytearray()
        # How many bytes at the start of `pending` hold no newline.
        self.scanned = 0
        self.buffer = None

    def start(self):
        threading.Thread(target=self.read_forever, daemon=True).start()

    def read_into(self, view):
        """Reads what the host sent next into `view`; 0 at its end."""
        while True:
            try:
                return os.readv(self.fd, [view])
            except InterruptedError:
                continue
            except OSError:
                return 0

    def fill(self):
        """Appends what the host sent next to `pending`; False at its end."""
        if self.buffer is None:
            self.buffer = bytearray(COMMAND_READ)
        read = self.read_into(self.buffer)
        if not read:
            return False
        self.pending += memoryview(self.buffer)[:read]
        return True

    def next_message(self):
        """The next command (a dict carrying its raw bytes under PAYLOAD, or
        anything else JSON; a BadCommand for one that cannot be read), or
        None if the stream ended first."""
        line = b""
        while not line.strip():
            newline = self.pending.find(b"\n", self.scanned)
            if newline < 0:
                self.scanned = len(self.pending)
                if not self.fill():
                    return None
                continue
            line = bytes(self.pending[:newline])
            del self.pending[:newline + 1]
            self.scanned = 0
        msg = parse_command(line)
        length = payload_length(msg)
        self.size = len(line) + 1 + (length or 0)
        if length is None:
            # No count: the stream cannot be framed past it.
            return BadCommand("bad command: \"bytes\" is no count", msg.get("id"))
        if not length:
            return msg
        if length > MAX_PAYLOAD:
            if not self.skip(length):
                return None
            return BadCommand("EINVAL: %d bytes in one command, more than %d" % (length, MAX_PAYLOAD),
                              msg.get("id"))
        payload = bytearray(length)
        view = memoryview(payload)
        got = min(length, len(self.pending))
        view[:got] = self.pending[:got]
        del self.pending[:got]
        while got < length:
            read = self.read_into(view[got:])
            if not read:
                return None
            got += read
        msg[PAYLOAD] = payload
        return msg

    def skip(self, length):
        """Drops the next `length` bytes of the stream; False at its end."""
        while length > 0:
            if not self.pending and not self.fill():
                return False
            taken = min(length, len(self.pending))
            del self.pending[:taken]
            length -= taken
        self.scanned = 0
        return True

    def read_forever(self):
        batch, size = [], 0
        while True:
            msg = self.next_message()
            if msg is None:
                # The host closed our stdin (it is gone, or this sandbox is
                # being checkpointed). A restore hands us a new one at the
                # same fd, and a new stream: nothing half-read carries over.
                self.hand_over(batch, size)
                batch, size = [], 0
                del self.pending[:]
                self.scanned = 0
                time.sleep(0.05)
                continue
            batch.append(msg)
            size += self.size
            if self.pending.find(b"\n") < 0 or size >= MAX_HANDED:
                # Nothing more without a read, or a batch as large as the
                # bound: let the main loop have these.
                self.hand_over(batch, size)
                batch, size = [], 0

    def hand_over(self, messages, size=0):
        """Hands `messages` (`size` bytes) to the main loop, once it has
        taken enough of what was handed before (MAX_HANDED)."""
        if messages:
            with self.taken:
                while self.handed and self.handed + size > MAX_HANDED:
                    self.taken.wait()
                self.lines.extend(messages)
                self.handed += size
            os.write(self.wake_w, b"x")

    def take(self):
        """The commands read so far; errors are answered for bad ones."""
        try:
            os.read(self.wake, 4096)
        except BlockingIOError:
            pass
        with self.taken:
            messages = self.lines[:]
            del self.lines[:]
            self.handed = 0
            self.taken.notify_all()
        commands = []
        for msg in messages:
            if isinstance(msg, BadCommand):
                error(msg.request_id, msg.message)
            else:
                commands.append(msg)
        return commands
