"""Resumable executions across a checkpoint: numbered events, a pause that
holds back the exit, journals, and a resume that replays what was not
acknowledged (decision 0012)."""
from sandbox_agent import state

from .support import AgentTest, output


class JournalTest(AgentTest):
    def start_kept(self, script):
        run = self.send("exec", argv=["bash", "-c", script], resumable=True)
        return run

    def test_events_are_numbered_and_acks_trim_the_journal(self):
        run = self.start_kept("echo one; echo two >&2")
        events = self.run_to_exit(run)
        numbered = [e["seq"] for e in events if e["ev"] in ("out", "exit")]
        self.assertEqual(numbered, list(range(1, len(numbered) + 1)))
        self.assertIn(run, state.JOURNALS, "kept until acknowledged")
        self.send("ack", exec=run, seq=numbered[-1])
        self.assertNotIn(run, state.JOURNALS)

    def test_a_kept_checkpoint_pauses_holds_the_exit_and_replays_from_the_ack(self):
        run = self.start_kept("echo one; read line; echo \"$line\"; exit 4")
        first = self.run_until(lambda seen: any(e["ev"] == "out" for e in seen))
        self.assertEqual(output(first, run), b"one\n")
        prepare = self.send("prepare_checkpoint", force=False, keep=True, acked={run: 1})
        ready = self.events()[-1]
        self.assertEqual(ready, {"ev": "ready", "id": prepare, "killed_host_fd_holders": [],
                                 "running": [], "kept": [run]})
        self.send("stdin", id=run, data="dHdvCg==")  # "two\n"
        paused = self.run_until(lambda seen: True, timeout=1)
        for _ in range(20):  # the process ends, its output and exit wait
            paused += self.run_until(lambda seen: True)
        self.assertFalse(any(e.get("id") == run for e in paused), paused)
        journals = self.send("journals")
        self.assertEqual(self.events(), [{"ev": "journals", "id": journals, "paused": True,
                                          "executions": [{"id": run, "acked": 1, "running": True}]}])
        resume = self.send("resume", replay=True)
        events = self.run_to_exit(run)
        self.assertIn({"ev": "resumed", "id": resume}, events)
        self.assertEqual(output(events, run), b"two\n")
        self.assertEqual(events[-1], {"ev": "exit", "id": run, "code": 4, "seq": 3})

    def test_the_journal_tells_the_next_host_the_room_left_in_the_stdin_window(self):
        # A program that reads nothing: its input waits in the agent.
        run = self.send("exec", argv=["bash", "-c", "sleep 30"], resumable=True,
                        stdin_window=1 << 20)
        [started] = self.events()
        self.assertEqual(started["stdin_window"], 1 << 20)
        self.send("stdin", id=run, data="eHh4" * 70000)  # 210,000 bytes: more than a pipe holds
        self.events()
        waiting = len(state.EXECS[run].stdin_pending)
        self.assertGreater(waiting, 0, "the pipe took it all: nothing to count")
        self.send("prepare_checkpoint", force=False, keep=True, acked={})
        self.events()
        journals = self.send("journals")
        [reply] = self.events()
        self.assertEqual(reply["id"], journals)
        self.assertEqual(reply["executions"], [{
            "id": run, "acked": 0, "running": True,
            "stdin_window": 1 << 20, "stdin_room": (1 << 20) - waiting}])
        self.send("resume", replay=True)
        self.send("kill", id=run)
        self.assertEqual(self.run_to_exit(run)[-1]["code"], 137)

    def test_a_checkpoint_that_keeps_nothing_refuses_a_running_execution_unless_forced(self):
        run = self.send("exec", argv=["sleep", "30"])
        refused = self.send("prepare_checkpoint", force=False, keep=False)
        self.assertEqual(self.events()[-1], {"ev": "error", "id": refused,
                                             "message": "an execution is running"})
        forced = self.send("prepare_checkpoint", force=True, keep=False)
        events = self.run_until(lambda seen: any(e["ev"] == "ready" for e in seen))
        self.assertIn({"ev": "exit", "id": run, "code": 137}, events)
        self.assertEqual(events[-1], {"ev": "ready", "id": forced,
                                      "killed_host_fd_holders": [], "running": []})
