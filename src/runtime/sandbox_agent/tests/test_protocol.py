"""The agent handles every op protocol.json lists, and nothing else; bad
commands are answered with an error, never a crash."""
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

    def test_whole_lines_are_split_off_and_the_rest_kept(self):
        pending = bytearray(b'{"op":"ping"}\n{"op":')
        self.assertEqual(protocol.split_lines(pending), [b'{"op":"ping"}'])
        self.assertEqual(bytes(pending), b'{"op":')


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
        reader.hand_over([b'{"op": "ping", "id": "p"}', b"not json", b"   "])
        self.assertEqual(reader.take(), [{"op": "ping", "id": "p"}])
        [event] = self.events()
        self.assertEqual((event["ev"], event["id"]), ("error", None))
        self.assertIn("bad command", event["message"])
