"""A fresh agent for each test, run in this process without root or runsc:
commands go straight to the handlers, events are read back from a file that
stands in for the host's pipe, and every event is checked against
`protocol.json` (type, fields, and the reply shape of the request it ends)."""
import json
import os
import shutil
import sys
import tempfile
import time
import unittest

from sandbox_agent import config, protocol, state
from sandbox_agent import execution as execution_module
from sandbox_agent.handlers import handle
from sandbox_agent.loop import loop_once

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "protocol.json")
with open(SCHEMA_PATH) as schema_file:
    SCHEMA = json.load(schema_file)

TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def conforms(value, kind):
    for alternative in kind.split("|"):
        if alternative.endswith("[]"):
            item = alternative[:-2]
            if isinstance(value, list) and all(conforms(v, item) for v in value):
                return True
        elif TYPES[alternative](value):
            return True
    return False


def check_fields(message, entry, skip, what):
    """Problems of `message` against a schema entry's required/optional fields."""
    required = entry.get("required", {})
    optional = entry.get("optional", {})
    problems = []
    for name, kind in required.items():
        if name not in message:
            problems.append("%s lacks %r" % (what, name))
        elif not conforms(message[name], kind):
            problems.append("%s: %r is not %s" % (what, name, kind))
    for name, value in message.items():
        if name in skip or name in required:
            continue
        if name not in optional:
            problems.append("%s has %r, which protocol.json does not list" % (what, name))
        elif not conforms(value, optional[name]):
            problems.append("%s: %r is not %s" % (what, name, optional[name]))
    return problems


def check_event(event, ops_by_id):
    """Problems of one event against protocol.json."""
    kind = event.get("ev")
    entry = SCHEMA["events"].get(kind)
    if entry is None:
        return ["unknown event %r" % kind]
    if not entry.get("replies"):
        return check_fields(event, entry, ("ev",), kind)
    # ready and done: the rest of their fields depend on the request they end
    problems = check_fields({k: event.get(k) for k in entry["required"]}, entry, (), kind)
    if True:
        op = ops_by_id.get(event.get("id"))
        reply = SCHEMA["requests"].get(op, {}).get("reply", {})
        if reply.get("ev") != kind:
            problems.append("%r answers %r, whose reply is not %r" % (kind, op, kind))
        else:
            body = {k: v for k, v in event.items() if k not in entry["required"] and k != "ev"}
            problems += check_fields(body, reply, (), "%s of %s" % (kind, op))
    return problems


class AgentTest(unittest.TestCase):
    """Runs commands through the real handlers; `events()` returns what was emitted."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sandbox-agent-test-")
        state.reset()
        config.load(json.dumps({
            "python": sys.executable,
            "uid": os.getuid(),
            "gid": os.getgid(),
            "home": os.path.join(self.dir, "home"),
            "workspace": os.path.join(self.dir, "workspace"),
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.path.join(self.dir, "home")},
        }))
        os.makedirs(config.HOME)
        self.out_path = os.path.join(self.dir, "events")
        self.saved_out = protocol.OUT
        protocol.OUT = os.open(self.out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.reader = open(self.out_path, "rb")
        self.ops_by_id = {}
        self.next_id = 0

    def tearDown(self):
        for execution in list(state.EXECS.values()):
            try:
                os.kill(execution.pid, 9)
            except OSError:
                pass
        deadline = time.time() + 5
        while state.EXECS and time.time() < deadline:
            loop_once(0.05)
        if execution_module.SESSION.proc is not None:
            execution_module.SESSION.proc.kill()
            execution_module.SESSION.proc.wait()
        execution_module.SESSION = execution_module.PythonSession()
        os.close(protocol.OUT)
        protocol.OUT = self.saved_out
        self.reader.close()
        state.reset()
        shutil.rmtree(self.dir, ignore_errors=True)

    def send(self, op, payload=None, **fields):
        """Runs one command (with `payload` as its raw bytes, announced by
        `bytes`, as the reader hands them over); returns its id (a fresh
        one unless given)."""
        message = {"op": op}
        message.update(fields)
        if payload is not None:
            message["bytes"] = len(payload)
        if op != "ack" and "id" not in message:
            self.next_id += 1
            message["id"] = "r%d" % self.next_id
        request = SCHEMA["requests"][op]
        problems = check_fields(message, request, ("op",), "request %s" % op)
        self.assertEqual(problems, [], "the test sends what protocol.json does not allow")
        if "id" in message:
            self.ops_by_id[message["id"]] = op  # the last op under an id is the one answered
        if payload is not None:
            message[protocol.PAYLOAD] = bytearray(payload)
        handle(message)
        return message.get("id")

    def events(self):
        """The events emitted since the last call, each checked against the
        schema; an event's raw bytes (announced by `bytes`) under
        `protocol.PAYLOAD`."""
        events = frames(self.reader.read())
        for event in events:
            checked = {k: v for k, v in event.items() if k != protocol.PAYLOAD}
            self.assertEqual(check_event(checked, self.ops_by_id), [], checked)
        return events

    def run_until(self, done, timeout=10.0):
        """Runs the main loop until `done(events so far)`; returns those events."""
        seen = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            seen += self.events()
            if done(seen):
                return seen
            loop_once(0.02)
        self.fail("timed out; events so far: %r" % seen)

    def run_to_exit(self, exec_id, timeout=10.0):
        return self.run_until(
            lambda seen: any(e["ev"] == "exit" and e["id"] == exec_id for e in seen), timeout)


def frames(data):
    """The events in what the agent wrote: JSON lines, each followed by the
    raw bytes its `bytes` announces."""
    events = []
    while data:
        line, _, data = data.partition(b"\n")
        if not line.strip():
            continue
        event = json.loads(line)
        if "bytes" in event:
            length = event["bytes"]
            if len(data) < length:
                raise AssertionError("%d bytes announced, %d follow" % (length, len(data)))
            event[protocol.PAYLOAD], data = data[:length], data[length:]
        events.append(event)
    return events


def output(events, exec_id, fd=1):
    """The bytes execution `exec_id` wrote to `fd`."""
    return b"".join(protocol.unb64(e["data"]) for e in events
                    if e["ev"] == "out" and e["id"] == exec_id and e["fd"] == fd)
