"""Executions as the host sees them: started, output per stream, exit code;
stdin; kill; one at a time; the persistent Python session."""
import json
import signal
import time
import unittest

from sandbox_agent import protocol, state
from sandbox_agent.execution import alive_in_tree, processes, split_utf8

from .support import AgentTest, output


def alive_running(cmdline):
    """Pids of live (not zombie) processes whose command line is `cmdline`."""
    found = []
    for pid, state_, _, _, _ in processes():
        try:
            with open("/proc/%d/cmdline" % pid) as f:
                if f.read() == cmdline and state_ != b"Z":
                    found.append(pid)
        except OSError:
            continue
    return found


class ExecutionTest(AgentTest):
    def test_output_goes_per_stream_and_the_exit_code_through(self):
        run = self.send("exec", argv=["bash", "-c", "echo out; echo err >&2; exit 3"])
        events = self.run_to_exit(run)
        self.assertEqual(events[0]["ev"], "started")
        self.assertEqual(output(events, run, 1), b"out\n")
        self.assertEqual(output(events, run, 2), b"err\n")
        self.assertEqual(events[-1], {"ev": "exit", "id": run, "code": 3})
        self.assertNotIn("seq", events[1], "only resumable executions are numbered")

    def test_env_and_cwd_reach_the_process(self):
        run = self.send("exec", argv=["bash", "-c", 'echo "$GREETING $PWD"'],
                        env={"GREETING": "hi"}, cwd=self.dir)
        self.assertEqual(output(self.run_to_exit(run), run), ("hi %s\n" % self.dir).encode())

    def test_stdin_is_written_and_closed(self):
        run = self.send("exec", argv=["bash", "-c", "cat; echo end"])
        self.send("stdin", id=run, data="aGVsbG8K")  # "hello\n"
        self.send("stdin_close", id=run)
        self.assertEqual(output(self.run_to_exit(run), run), b"hello\nend\n")

    def test_input_a_program_does_not_read_is_bounded_and_dropped_with_a_notice(self):
        from sandbox_agent.execution import MAX_STDIN_PENDING
        run = self.send("exec", argv=["bash", "-c", "sleep 30"])
        self.events()
        chunk = protocol.b64(b"x" * (1 << 20))
        for _ in range(MAX_STDIN_PENDING // (1 << 20) + 4):
            self.send("stdin", id=run, data=chunk)
        events = self.events()
        execution = state.EXECS[run]
        self.assertLessEqual(len(execution.stdin_pending), MAX_STDIN_PENDING)
        # Once dropping, input that would fit is dropped too: one gap, no holes.
        waiting = len(execution.stdin_pending)
        self.send("stdin", id=run, data=protocol.b64(b"y"))
        self.events()
        self.assertEqual(len(execution.stdin_pending), waiting)
        notices = output(events, run, 2)
        self.assertEqual(notices.count(b"input dropped"), 1, notices)
        self.send("kill", id=run)
        self.assertEqual(self.run_to_exit(run)[-1]["code"], 137)

    def test_a_granted_stdin_window_reports_what_the_program_took(self):
        from sandbox_agent.execution import MAX_STDIN_PENDING, STDIN_REPORT_BYTES
        # More than the agent keeps is asked for: it grants its own bound.
        run = self.send("exec", argv=["python3", "-c",
                                      "import sys; print(len(sys.stdin.buffer.read()))"],
                        stdin_window=MAX_STDIN_PENDING * 2)
        [started] = self.events()
        self.assertEqual(started["stdin_window"], MAX_STDIN_PENDING)
        sent = 3 * STDIN_REPORT_BYTES + 5
        chunk = protocol.b64(b"x" * STDIN_REPORT_BYTES)
        for _ in range(3):
            self.send("stdin", id=run, data=chunk)
        self.send("stdin", id=run, data=protocol.b64(b"y" * 5))
        self.send("stdin_close", id=run)
        events = self.run_to_exit(run)
        self.assertEqual(output(events, run), b"%d\n" % sent)
        reports = [e["count"] for e in events if e["ev"] == "stdin_taken"]
        # A report a batch, never one per write; the rest waits for a batch.
        self.assertTrue(all(n >= STDIN_REPORT_BYTES for n in reports), reports)
        self.assertLessEqual(sum(reports), sent)
        self.assertGreater(sum(reports), sent - STDIN_REPORT_BYTES, reports)

    def test_without_a_stdin_window_nothing_is_reported(self):
        run = self.send("exec", argv=["bash", "-c", "cat >/dev/null"])
        [started] = self.events()
        self.assertNotIn("stdin_window", started)
        self.send("stdin", id=run, data=protocol.b64(b"x" * (2 << 20)))
        self.send("stdin_close", id=run)
        events = self.run_to_exit(run)
        self.assertEqual([e for e in events if e["ev"] == "stdin_taken"], [])

    def test_one_execution_at_a_time(self):
        first = self.send("exec", argv=["sleep", "30"])
        second = self.send("exec", argv=["true"])
        events = self.events()
        self.assertIn({"ev": "error", "id": second, "message": "another execution is running"}, events)
        self.send("kill", id=first)
        self.assertEqual(self.run_to_exit(first)[-1]["code"], 137)

    def test_a_kill_leaves_nothing_of_the_tree_alive_when_it_returns(self):
        # Background children, one in a session of its own (out of the group,
        # found by its parent link), started while the kill may be under way.
        run = self.send("exec", argv=["bash", "-c", "sleep 311 & setsid sleep 311 & sleep 311"])
        [started] = self.events()
        self.assertEqual(started["ev"], "started")
        pid = state.EXECS[run].pid
        self.send("kill", id=run)
        self.assertEqual(alive_in_tree(pid), [], "alive after the kill returned")
        # Nor anywhere else: a child forked as the kill began, missed by its
        # walk and handed on by its dying parent, is found by its marker.
        time.sleep(0.1)
        self.assertEqual(alive_running("sleep\x00311\x00"), [], "escaped the kill")
        self.assertEqual(self.run_to_exit(run)[-1]["code"], 137)

    def test_a_kill_reaches_a_process_orphaned_into_a_session_of_its_own(self):
        # The subshell exits at once: its `setsid sleep` is orphaned, in a
        # session and group of its own, linked to the execution by nothing
        # but the subreaper the execution's program is.
        run = self.send("exec", argv=["bash", "-c", "(setsid sleep 300 &); echo forked; exec sleep 300"])
        self.run_until(lambda events: b"forked" in output(events, run))
        pid = state.EXECS[run].pid

        def adopted():
            """The orphan once its subshell exited: in a session of its own,
            its parent the execution's program (the subreaper)."""
            return [p for p, _, ppid, _, session in processes() if ppid == pid and session == p]

        deadline = time.time() + 5
        while not adopted() and time.time() < deadline:
            time.sleep(0.01)
        orphans = adopted()
        self.assertEqual(len(orphans), 1, "the orphan, adopted by the execution's program")
        self.send("kill", id=run)
        self.assertEqual(alive_in_tree(pid), [], "alive after the kill returned")
        alive = [p for p, state_, _, _, _ in processes() if p in orphans and state_ != b"Z"]
        self.assertEqual(alive, [], "the orphan survived the kill")
        self.assertEqual(self.run_to_exit(run)[-1]["code"], 137)

    def test_a_program_that_cannot_start_is_an_error(self):
        run = self.send("exec", argv=["/nonexistent/program"])
        [event] = self.events()
        self.assertEqual((event["ev"], event["id"]), ("error", run))
        self.assertEqual(state.EXECS, {})

    def test_session_cells_share_their_globals(self):
        first = self.send("exec", session=True, code="x = 41")
        self.assertEqual(self.run_to_exit(first)[-1]["code"], 0)
        second = self.send("exec", session=True, code="print(x + 1)")
        self.assertEqual(output(self.run_to_exit(second), second), b"42\n")

    def test_a_session_cell_asked_for_results_reports_its_last_value_on_fd_3(self):
        cell = self.send("exec", session=True, results=True, code="z = 20\nprint('side')\nz * 2 + 2")
        events = self.run_to_exit(cell)
        self.assertEqual(events[-1]["code"], 0)
        self.assertEqual(output(events, cell), b"side\n")
        result = json.loads(output(events, cell, fd=3))
        self.assertEqual(result, {"kind": "execute_result", "data": {"text/plain": "42"}})
        # Unasked, the same cell reports nothing on fd 3; ";" hides the value.
        for fields in ({"code": "z"}, {"code": "z;", "results": True}):
            plain = self.send("exec", session=True, **fields)
            self.assertEqual(output(self.run_to_exit(plain), plain, fd=3), b"")
        failed = self.send("exec", session=True, results=True, code="1 / 0")
        events = self.run_to_exit(failed)
        self.assertEqual(events[-1]["code"], 1)
        self.assertEqual(output(events, failed, fd=3), b"")
        self.assertIn(b'File "<cell>", line 1', output(events, failed, fd=2))
        self.assertNotIn(b'File "<string>"', output(events, failed, fd=2))

    def test_a_session_cell_is_interrupted_by_kill_and_the_session_goes_on(self):
        cell = self.send("exec", session=True, code="y = 1\nprint('set')\nimport time\ntime.sleep(30)")
        self.run_until(lambda seen: output(seen, cell) == b"set\n")
        self.send("kill", id=cell)
        self.assertEqual(self.run_to_exit(cell)[-1]["code"], 130)
        after = self.send("exec", session=True, code="print(y)")
        self.assertEqual(output(self.run_to_exit(after), after), b"1\n")


class SplitUtf8Test(unittest.TestCase):
    def test_a_cut_character_is_held_back(self):
        snowman = "\u2603".encode()
        self.assertEqual(split_utf8(b"a" + snowman[:2]), (b"a", snowman[:2]))
        self.assertEqual(split_utf8(b"a" + snowman), (b"a" + snowman, b""))
        self.assertEqual(split_utf8(b""), (b"", b""))
        self.assertEqual(split_utf8(b"\xc3"), (b"", b"\xc3"))


class IgnoredSignalsTest(AgentTest):
    """The agent ignores SIGINT and SIGTERM (it is PID 1); its programs must not."""

    def setUp(self):
        super().setUp()
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.addCleanup(signal.signal, signum, signal.signal(signum, signal.SIG_IGN))

    def test_an_execution_starts_with_the_default_signals(self):
        run = self.send("exec", argv=["python3", "-c",
                                      "import signal as s; print(s.getsignal(s.SIGINT) is s.default_int_handler,"
                                      " s.getsignal(s.SIGTERM) == s.SIG_DFL)"])
        self.assertEqual(output(self.run_to_exit(run), run), b"True True\n")

    def test_ctrl_c_on_a_terminal_interrupts_its_program(self):
        # Short sleeps in a loop, not one long one: a SIGINT that lands after
        # the print but before the sleep's syscall only trips CPython's flag,
        # which one long sleep would not look at for its whole length (seen
        # under load: the signal handled, nothing pending, no exit).
        exec_id = self.send("exec", argv=["python3", "-c",
                                          "import time\n"
                                          "try:\n"
                                          "    print('sleeping', flush=True)\n"
                                          "    while True:\n"
                                          "        time.sleep(0.05)\n"
                                          "except KeyboardInterrupt:\n    print('interrupted')\n"],
                            pty={"cols": 80, "rows": 24})
        seen = self.run_until(lambda events: b"sleeping" in output(events, exec_id))
        self.send("stdin", id=exec_id, data=protocol.b64(b"\x03"))
        seen += self.run_to_exit(exec_id)
        self.assertIn(b"interrupted", output(seen, exec_id))
        self.assertEqual(seen[-1]["code"], 0)


class TerminalTest(AgentTest):
    def test_a_terminal_execution_has_a_tty_of_its_size_and_resizes(self):
        exec_id = self.send("exec", argv=["python3", "-c",
                                          "import os,sys\n"
                                          "print(os.isatty(0), os.get_terminal_size(0))\n"
                                          "sys.stdin.readline()\n"
                                          "print(os.get_terminal_size(0))\n"],
                            pty={"cols": 91, "rows": 17})
        seen = self.run_until(lambda events: b"columns=91" in output(events, exec_id))
        self.assertIn(b"True os.terminal_size(columns=91, lines=17)", output(seen, exec_id))
        self.send("resize", id=exec_id, cols=120, rows=40)
        self.send("stdin", id=exec_id, data=protocol.b64(b"go\n"))
        seen += self.run_to_exit(exec_id)
        self.assertIn(b"columns=120, lines=40", output(seen, exec_id))
