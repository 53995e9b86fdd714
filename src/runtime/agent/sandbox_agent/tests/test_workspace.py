"""Workspace sync's file operations in a temporary directory: scan, read,
write (checked md5, atomic rename), delete, the state file, and the paths
refused."""
import hashlib
import json
import os

from sandbox_agent import protocol
from sandbox_agent.workspace import STATE_NAME

from .support import AgentTest


class WorkspaceTest(AgentTest):
    def setUp(self):
        super().setUp()
        self.root = os.path.join(self.dir, "workspace")
        os.makedirs(os.path.join(self.root, "sub"))
        with open(os.path.join(self.root, "sub", "a.txt"), "wb") as f:
            f.write(b"alpha")

    def scan(self, **limits):
        fields = {"root": self.root, "max_file_bytes": None, "max_total_bytes": None,
                  "max_files": None, "stale_s": 3600}
        fields.update(limits)
        self.send("ws_scan", **fields)
        return self.events()[-1]

    def test_a_scan_lists_files_with_md5_and_refuses_symlinks(self):
        os.symlink("/etc/passwd", os.path.join(self.root, "escape"))
        done = self.scan()
        self.assertEqual([f["path"] for f in done["files"]], ["sub/a.txt"])
        self.assertEqual(done["files"][0]["checksum"], hashlib.md5(b"alpha").hexdigest())
        self.assertEqual(done["refused"], [{"path": "escape", "reason": "a symlink that escapes the workspace"}])
        self.assertEqual(done["hashed"], 1)

    def test_a_scan_over_the_file_limit_is_an_error(self):
        done = self.scan(max_files=0)
        self.assertEqual(done["ev"], "error")
        self.assertIn("file limit", done["message"])

    def test_a_scan_reply_is_bounded_whatever_user_code_plants(self):
        # Refused files were listed without limit, and the state
        # file (user-writable) was echoed back whole as `synced`.
        for i in range(1500):
            os.symlink("/etc/passwd", os.path.join(self.root, "link%04d" % i))
        entries = [{"path": "f%d" % i, "checksum": "0" * 32, "size": 1, "modified_at": 0}
                   for i in range(5000)]
        with open(os.path.join(self.root, STATE_NAME), "w") as f:
            json.dump({"last_synced_at": 0, "files": entries}, f)
        done = self.scan(max_files=10)
        self.assertEqual(done["ev"], "done")
        self.assertEqual(len(done["refused"]), 1001)
        self.assertIn("500 more", done["refused"][-1]["reason"])
        self.assertEqual(len(done["synced"]), 10)

    def test_a_write_lands_atomically_with_its_mtime_and_reads_back(self):
        request = "w1"
        self.send("ws_write_chunk", id=request, root=self.root, data=protocol.b64(b"new "))
        self.send("ws_write_chunk", id=request, root=self.root, data=protocol.b64(b"file"))
        self.send("ws_write_end", id=request, root=self.root, path="sub/deep/b.txt",
                  checksum=hashlib.md5(b"new file").hexdigest(), modified_at=1_000_000)
        self.assertEqual(self.events(), [{"ev": "done", "id": request}])
        target = os.path.join(self.root, "sub", "deep", "b.txt")
        self.assertEqual(int(os.stat(target).st_mtime), 1_000_000)
        read = self.send("ws_read", root=self.root, path="sub/deep/b.txt", max_file_bytes=100)
        events = self.events()
        data = b"".join(protocol.unb64(e["data"]) for e in events if e["ev"] == "chunk")
        self.assertEqual(data, b"new file")
        self.assertEqual(events[-1], {"ev": "done", "id": read, "size": 8,
                                      "checksum": hashlib.md5(b"new file").hexdigest()})

    def test_a_write_with_the_wrong_md5_leaves_nothing(self):
        self.send("ws_write_chunk", id="w2", root=self.root, data=protocol.b64(b"x"))
        self.send("ws_write_end", id="w2", root=self.root, path="x.txt",
                  checksum="0" * 32, modified_at=1)
        [error] = self.events()
        self.assertEqual((error["ev"], error["id"]), ("error", "w2"))
        self.assertEqual(sorted(os.listdir(self.root)), ["sub"])

    def test_paths_that_could_leave_the_root_are_refused(self):
        os.symlink(self.dir, os.path.join(self.root, "link"))
        for path in ("../x", "/etc/passwd", "sub/../../x", "link/home"):
            request = self.send("ws_read", root=self.root, path=path, max_file_bytes=10)
            [error] = self.events()
            self.assertEqual((error["ev"], error["id"]), ("error", request), path)

    def test_delete_removes_files_and_their_emptied_parents(self):
        request = self.send("ws_delete", root=self.root, paths=["sub/a.txt", "missing"])
        self.assertEqual(self.events(), [{"ev": "done", "id": request, "deleted": 1}])
        self.assertEqual(os.listdir(self.root), [])

    def test_the_state_file_is_written_and_not_scanned(self):
        content = json.dumps({"last_synced_at": 1, "files": []})
        request = self.send("ws_state", root=self.root, content=content)
        self.assertEqual(self.events(), [{"ev": "done", "id": request}])
        with open(os.path.join(self.root, STATE_NAME)) as f:
            self.assertEqual(f.read(), content)
        self.assertEqual([f["path"] for f in self.scan()["files"]], ["sub/a.txt"])

    def test_an_aborted_write_leaves_no_temporary_file(self):
        self.send("ws_write_chunk", id="w3", root=self.root, data=protocol.b64(b"x"))
        self.send("ws_write_abort", id="w3")
        self.assertEqual(self.events(), [{"ev": "done", "id": "w3"}])
        self.assertEqual(sorted(os.listdir(self.root)), ["sub"])
