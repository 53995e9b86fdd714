"""The filesystem API's ops in a temporary home: each call, its POSIX-named
errors, the bounds, and the paths refused (/proc, /sys, /dev, also through
a symlink)."""
import os

from sandbox_agent import protocol

from .support import AgentTest


class FilesTest(AgentTest):
    def call(self, op, **fields):
        self.send(op, **fields)
        events = self.events()
        self.assertEqual(len(events), 1, events)
        return events[0]

    def ok(self, op, **fields):
        event = self.call(op, **fields)
        self.assertEqual(event["ev"], "done", event)
        return event

    def error(self, op, **fields):
        event = self.call(op, **fields)
        self.assertEqual(event["ev"], "error", event)
        return event["message"].split(":")[0]

    def test_write_read_stat_list_round_trip(self):
        written = self.ok("fs_write", path="a/b/c.txt", data=protocol.b64(b"hello"), parents=True, mode=0o640)
        self.assertEqual(written["entry"]["size"], 5)
        self.assertEqual(written["entry"]["mode"], 0o640)
        read = self.ok("fs_read", path="a/b/c.txt", offset=1, length=3)
        self.assertEqual(protocol.unb64(read["data"]), b"ell")
        self.assertEqual((read["size"], read["eof"]), (5, False))
        stat = self.ok("fs_stat", path="a/b/c.txt")["entry"]
        self.assertEqual((stat["type"], stat["size"]), ("file", 5))
        listed = self.ok("fs_list", path="a", depth=2, max_entries=100)
        self.assertEqual([e["name"] for e in listed["entries"]], ["b", "b/c.txt"])
        self.assertEqual(self.ok("fs_list", path="a", depth=1, max_entries=100)["entries"][0]["type"], "directory")
        limited = self.ok("fs_list", path="a", depth=2, max_entries=1)
        self.assertTrue(limited["truncated"])

    def test_errors_are_named(self):
        self.assertEqual(self.error("fs_read", path="missing", offset=0, length=10), "ENOENT")
        os.makedirs(os.path.join(self.dir, "home", "d", "e"))
        self.assertEqual(self.error("fs_read", path="d", offset=0, length=10), "EISDIR")
        self.assertEqual(self.error("fs_remove", path="d", recursive=False), "ENOTEMPTY")
        self.assertEqual(self.error("fs_mkdir", path="d", parents=False), "EEXIST")
        self.assertEqual(self.error("fs_list", path="missing", depth=1, max_entries=10), "ENOENT")
        self.assertEqual(self.error("fs_write", path="x/y", data=protocol.b64(b""), parents=False), "ENOENT")
        self.ok("fs_remove", path="d", recursive=True)
        self.assertEqual(self.error("fs_stat", path="d"), "ENOENT")

    def test_proc_sys_and_dev_are_refused_also_through_links(self):
        self.assertEqual(self.error("fs_read", path="/proc/self/environ", offset=0, length=10), "EACCES")
        self.assertEqual(self.error("fs_read", path="/dev/zero", offset=0, length=10), "EACCES")
        os.symlink("/proc/self/fd/0", os.path.join(self.dir, "home", "sneaky"))
        self.assertEqual(self.error("fs_read", path="sneaky", offset=0, length=10), "EACCES")

    def test_a_fifo_is_not_read(self):
        os.mkfifo(os.path.join(self.dir, "home", "fifo"))
        self.assertEqual(self.error("fs_read", path="fifo", offset=0, length=10), "EINVAL")

    def test_rename_and_mkdir(self):
        self.ok("fs_mkdir", path="p/q", parents=True, mode=0o700)
        self.ok("fs_write", path="p/q/f", data=protocol.b64(b"x"), parents=False)
        moved = self.ok("fs_rename", path="p/q/f", to="p/g", overwrite=True)
        self.assertTrue(moved["entry"]["path"].endswith("/p/g"))
        self.ok("fs_write", path="p/h", data=protocol.b64(b"y"), parents=False)
        self.assertEqual(self.error("fs_rename", path="p/g", to="p/h", overwrite=False), "EEXIST")

    def test_an_upload_lands_whole_or_not_at_all(self):
        self.ok("fs_upload_open", upload="u1", path="big/file.bin", parents=True, mode=0o755)
        self.assertEqual(self.ok("fs_upload_chunk", upload="u1", data=protocol.b64(b"a" * 1000))["size"], 1000)
        self.ok("fs_upload_chunk", upload="u1", data=protocol.b64(b"b" * 24))
        target = os.path.join(self.dir, "home", "big", "file.bin")
        self.assertFalse(os.path.exists(target))
        done = self.ok("fs_upload_commit", upload="u1", size=1024)
        self.assertEqual((done["entry"]["size"], done["entry"]["mode"]), (1024, 0o755))
        with open(target, "rb") as f:
            self.assertEqual(f.read(), b"a" * 1000 + b"b" * 24)
        self.ok("fs_upload_open", upload="u2", path="big/file.bin", parents=True)
        self.ok("fs_upload_chunk", upload="u2", data=protocol.b64(b"short"))
        self.assertEqual(self.error("fs_upload_commit", upload="u2", size=6), "EIO")
        self.assertEqual(os.listdir(os.path.dirname(target)), ["file.bin"])
        self.assertEqual(self.error("fs_upload_chunk", upload="u2", data=""), "EBADF")
        self.ok("fs_upload_open", upload="u3", path="big/other", parents=True)
        self.ok("fs_upload_abort", upload="u3")
        self.assertEqual(os.listdir(os.path.dirname(target)), ["file.bin"])

    def test_reads_are_bounded(self):
        self.ok("fs_write", path="f", data=protocol.b64(b"z" * 100), parents=True)
        read = self.ok("fs_read", path="f", offset=0, length=10 << 20)
        self.assertEqual(len(protocol.unb64(read["data"])), 100)
        self.assertTrue(read["eof"])

    def test_raw_bytes_go_up_and_come_back_unencoded(self):
        data = bytes(range(256)) * 4096 + b"\n{tail"
        self.ok("fs_upload_open", upload="r1", path="raw/file.bin", parents=True)
        self.assertEqual(self.ok("fs_upload_bytes", upload="r1", payload=data[:1000])["size"], 1000)
        self.assertEqual(self.ok("fs_upload_bytes", upload="r1", payload=data[1000:])["size"], len(data))
        self.ok("fs_upload_commit", upload="r1", size=len(data))
        read = self.ok("fs_read_bytes", path="raw/file.bin", offset=0, length=1 << 20)
        self.assertEqual(bytes(read[protocol.PAYLOAD]), data[:1 << 20])
        self.assertEqual((read["bytes"], read["size"], read["eof"]), (1 << 20, len(data), False))
        tail = self.ok("fs_read_bytes", path="raw/file.bin", offset=1 << 20, length=1 << 20)
        self.assertEqual(bytes(tail[protocol.PAYLOAD]), data[1 << 20:])
        self.assertTrue(tail["eof"])
        empty = self.ok("fs_read_bytes", path="raw/file.bin", offset=len(data), length=10)
        self.assertEqual((empty["bytes"], empty[protocol.PAYLOAD]), (0, b""))

    def test_a_raw_chunk_without_its_bytes_is_refused(self):
        self.ok("fs_upload_open", upload="r2", path="raw2", parents=True)
        self.assertEqual(self.error("fs_upload_bytes", upload="r2", bytes=0), "EINVAL")
        self.assertEqual(self.error("fs_upload_bytes", upload="nope", payload=b"x"), "EBADF")
