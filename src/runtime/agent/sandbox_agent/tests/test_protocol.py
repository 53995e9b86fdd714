"""The agent handles every op protocol.json lists, and nothing else; bad
commands are answered with an error, never a crash."""
import json
import os
import threading
import time
import unittest

from sandbox_agent import protocol
from sandbox_agent.handlers import HANDLERS, handler

from .support import SCHEMA, AgentTest


class SchemaTest(unittest.TestCase):
    def test_every_listed_op_has_a_handler_and_every_handler_is_listed(self):
        self.assertEqual(sorted(HANDLERS), sorted(SCHEMA["requests"]))

    def test_every_handler_resolves_to_a_function(self):
        for op in HANDLERS:
            self.assertTrue(callable(handler(op)), op)

    def test_the_agent_speaks_the_schemas_version(self):
        self.assertEqual(protocol.VERSION, SCHEMA["version"])


def read_all(stream, read_size=7):
    """The messages a CommandReader makes of `stream`, read `read_size`
    bytes at a time (so lines and payloads arrive in pieces)."""
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, stream), os.close(w)))
    writer.start()
    reader = protocol.CommandReader(fd=r)
    reader.buffer = bytearray(read_size)
    messages = []
    while True:
        msg = reader.next_message()
        if msg is None:
            break
        messages.append(msg)
    writer.join()
    os.close(r)
    return messages, reader


class BackPressureTest(unittest.TestCase):
    def test_commands_the_main_loop_has_not_taken_stop_the_reader_at_the_bound(self):
        r, w = os.pipe()
        line = b'{"op":"stdin","id":"e1","data":"%s"}\n' % (b"A" * ((1 << 20) - 40))
        lines = 3 * protocol.MAX_HANDED // len(line)
        done = threading.Event()

        def write():
            for _ in range(lines):
                os.write(w, line)
            done.set()

        threading.Thread(target=write, daemon=True).start()
        reader = protocol.CommandReader(fd=r)
        reader.start()
        time.sleep(1.0)
        # Nothing taken: the reader holds at most the bound, and the writer
        # waits on the pipe.
        with reader.lock:
            held = sum(len(m["data"]) for m in reader.lines)
        self.assertLessEqual(held, protocol.MAX_HANDED)
        self.assertFalse(done.is_set(), "all %d lines were read with none taken" % lines)
        taken = []
        deadline = time.monotonic() + 30
        while len(taken) < lines and time.monotonic() < deadline:
            taken += reader.take()
            time.sleep(0.01)
        self.assertEqual(len(taken), lines)
        self.assertTrue(done.wait(5))
        os.close(w)


class FramingTest(unittest.TestCase):
    def test_lines_and_raw_bytes_are_split_whatever_the_reads(self):
        payload = bytes(range(256)) * 40 + b"\n\n{"
        stream = (b'{"op":"ping","id":"p1"}\n\n'
                  + b'{"op":"fs_upload_bytes","id":"u1","upload":"x","bytes":%d}\n' % len(payload)
                  + payload
                  + b'{"op":"ping","id":"p2"}\n{"op":')
        for read_size in (1, 7, 4096, 1 << 20):
            messages, reader = read_all(stream, read_size)
            self.assertEqual([m["id"] for m in messages], ["p1", "u1", "p2"], read_size)
            self.assertEqual(bytes(messages[1][protocol.PAYLOAD]), payload)
            self.assertNotIn(protocol.PAYLOAD, messages[0])
            self.assertEqual(bytes(reader.pending), b'{"op":')

    def test_too_many_bytes_are_refused_and_skipped_unkept(self):
        too_many = protocol.MAX_PAYLOAD + 1
        stream = (b'{"op":"fs_upload_bytes","id":"u1","upload":"x","bytes":%d}\n' % too_many
                  + b"z" * too_many + b'{"op":"ping","id":"p1"}\n')
        messages, reader = read_all(stream, 1 << 16)
        self.assertIsInstance(messages[0], protocol.BadCommand)
        self.assertEqual(messages[0].request_id, "u1")
        self.assertTrue(messages[0].message.startswith("EINVAL"), messages[0].message)
        self.assertEqual(messages[1], {"op": "ping", "id": "p1"})
        self.assertLess(len(reader.pending), 1 << 16)

    def test_a_count_that_is_no_count_is_refused(self):
        messages, _ = read_all(b'{"op":"ping","id":"p1","bytes":-1}\n{"op":"ping","id":"p2"}\n')
        self.assertIsInstance(messages[0], protocol.BadCommand)
        self.assertEqual(messages[1]["id"], "p2")

    def test_a_payload_key_the_host_sent_is_not_taken_for_bytes(self):
        line = json.dumps({"op": "ping", "id": "p1", protocol.PAYLOAD: "x"}).encode() + b"\n"
        messages, _ = read_all(line)
        self.assertEqual(messages, [{"op": "ping", "id": "p1"}])


class DispatchTest(AgentTest):
    def test_ping_answers_pong_with_the_version_and_what_runs(self):
        request = self.send("ping")
        self.assertEqual(self.events(), [
            {"ev": "pong", "id": request, "version": protocol.VERSION, "running": []}])

    def test_an_unknown_op_is_an_error_with_its_id(self):
        from sandbox_agent.handlers import handle
        handle({"op": "teleport", "id": "x1"})
        self.assertEqual(self.events(), [
            {"ev": "error", "id": "x1", "message": "unknown op 'teleport'"}])

    def test_a_command_that_is_not_an_object_is_an_error_not_a_crash(self):
        from sandbox_agent.handlers import handle
        handle([1, 2])
        [event] = self.events()
        self.assertEqual((event["ev"], event["id"]), ("error", None))

    def test_a_handler_that_raises_answers_an_error(self):
        from sandbox_agent.handlers import handle
        handle({"op": "ack", "id": "x2"})  # no "exec": a KeyError inside
        [event] = self.events()
        self.assertEqual((event["ev"], event["id"]), ("error", "x2"))
        self.assertIn("KeyError", event["message"])

    def test_unreadable_lines_from_the_host_are_reported(self):
        reader = protocol.CommandReader()
        reader.hand_over([protocol.parse_command(b'{"op": "ping", "id": "p"}'),
                          protocol.parse_command(b"not json")])
        self.assertEqual(reader.take(), [{"op": "ping", "id": "p"}])
        [event] = self.events()
        self.assertEqual((event["ev"], event["id"]), ("error", None))
        self.assertIn("bad command", event["message"])
