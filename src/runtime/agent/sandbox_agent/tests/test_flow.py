"""Terminal flow control (`flow.py`): a terminal that stays full past
`HOLD_AFTER` gets its whole session stopped, and continued once drained."""
import os
import signal
import subprocess
import time
import unittest

from sandbox_agent import flow


def states(pids):
    """Each process's state letter from /proc (`T`: stopped)."""
    letters = []
    for pid in pids:
        with open("/proc/%d/stat" % pid) as stat:
            letters.append(stat.read().rsplit(")", 1)[1].split()[0])
    return letters


class TerminalFlowTest(unittest.TestCase):
    def test_a_session_full_past_the_hold_time_is_stopped_until_drained(self):
        leader = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30"], start_new_session=True)
        self.addCleanup(lambda: (os.killpg(leader.pid, signal.SIGKILL), leader.wait()))
        deadline = time.monotonic() + 5
        while len(flow.session_members(leader.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        members = flow.session_members(leader.pid)
        self.assertEqual(len(members), 3, members)
        self.assertEqual(members[0], leader.pid)
        terminal = flow.TerminalFlow(leader.pid)
        terminal.still_full()
        self.assertEqual(terminal.held, [])  # not yet: full only now
        time.sleep(flow.HOLD_AFTER * 2)
        terminal.still_full()
        self.assertEqual(sorted(terminal.held), sorted(members))
        time.sleep(0.05)
        self.assertEqual(states(members), ["T"] * 3)
        terminal.drained()
        self.assertEqual(terminal.held, [])
        time.sleep(0.05)
        self.assertNotIn("T", states(members))
        self.assertIsNone(terminal.full_since)


if __name__ == "__main__":
    unittest.main()
