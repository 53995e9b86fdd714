"""Which TCP connections block a checkpoint (read from /proc/net/tcp).

close_connections itself is not run here: outside a sandbox it would kill
the host's own processes that hold connections."""
import os
import tempfile
import unittest

from sandbox_agent.checkpoint import external_tcp, is_loopback_hex

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(local, remote, state, inode):
    return "   0: %s %s %s 00000000:00000000 00:00000000 00000000  1000        0 %s 1\n" % (
        local, remote, state, inode)


class TcpTest(unittest.TestCase):
    def test_loopback_addresses_in_both_families(self):
        self.assertTrue(is_loopback_hex("0100007F:1F90"))
        self.assertFalse(is_loopback_hex("0200000A:1F90"))
        self.assertTrue(is_loopback_hex("00000000000000000000000001000000:0050"))
        self.assertTrue(is_loopback_hex("0000000000000000FFFF00000100007F:0050"))
        self.assertFalse(is_loopback_hex("0000000000000000FFFF00000200000A:0050"))

    def test_only_connections_off_loopback_count(self):
        with tempfile.NamedTemporaryFile("w", delete=False) as table:
            table.write(HEADER)
            table.write(row("0200000A:C350", "08080808:0035", "01", "111"))  # established
            table.write(row("0100007F:1F90", "0100007F:C351", "01", "222"))  # loopback
            table.write(row("00000000:1F90", "00000000:0000", "0A", "333"))  # listening
        try:
            self.assertEqual(external_tcp((table.name, "/nonexistent")), [("111", "08080808:0035")])
        finally:
            os.unlink(table.name)

