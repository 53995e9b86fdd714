"""The agent runs as the same uid as user code, which can plant a
symlink or a FIFO under every name the agent uses. None of them may redirect
the agent's writes or block it: the state file's temporary, a download's
temporary, a snapshot's temporary and members, a file the host reads."""
import os
import tarfile
import threading

from sandbox_agent import protocol, snapshot
from sandbox_agent.workspace import STATE_NAME, SYNC_TEMP_PREFIX

from .support import AgentTest


class PlantedTest(AgentTest):
    def setUp(self):
        super().setUp()
        self.root = os.path.join(self.dir, "workspace")
        os.makedirs(self.root)
        self.victim = os.path.join(self.dir, "victim")
        with open(self.victim, "w") as f:
            f.write("untouched")
        self.saved = snapshot.EXTRACT_DIR, snapshot.EXTRACT_ROOT
        snapshot.EXTRACT_DIR = os.path.join(self.dir, "tmp")
        snapshot.EXTRACT_ROOT = os.path.join(self.dir, "restored")
        os.makedirs(snapshot.EXTRACT_DIR)
        os.makedirs(snapshot.EXTRACT_ROOT)

    def tearDown(self):
        snapshot.EXTRACT_DIR, snapshot.EXTRACT_ROOT = self.saved
        super().tearDown()

    def assert_victim_untouched(self):
        with open(self.victim) as f:
            self.assertEqual(f.read(), "untouched")

    def test_a_symlink_planted_as_the_state_files_temporary_is_not_followed(self):
        os.symlink(self.victim, os.path.join(self.root, STATE_NAME + ".tmp"))
        self.send("ws_state", root=self.root, content='{"files": []}')
        self.assertEqual(self.events()[-1]["ev"], "done")
        self.assert_victim_untouched()
        with open(os.path.join(self.root, STATE_NAME)) as f:
            self.assertEqual(f.read(), '{"files": []}')

    def test_a_symlink_planted_as_a_downloads_temporary_is_not_followed(self):
        os.symlink(self.victim, os.path.join(self.root, SYNC_TEMP_PREFIX + "w9"))
        self.send("ws_write_chunk", id="w9", root=self.root, data=protocol.b64(b"new"))
        import hashlib
        self.send("ws_write_end", id="w9", root=self.root, path="f.txt",
                  checksum=hashlib.md5(b"new").hexdigest(), modified_at=1_000_000)
        self.assertEqual(self.events()[-1], {"ev": "done", "id": "w9"})
        self.assert_victim_untouched()
        with open(os.path.join(self.root, "f.txt"), "rb") as f:
            self.assertEqual(f.read(), b"new")

    def test_a_fifo_in_place_of_a_file_does_not_block_a_read(self):
        os.mkfifo(os.path.join(self.root, "pipe"))
        worker = threading.Thread(
            target=lambda: self.send("ws_read", root=self.root, path="pipe", max_file_bytes=10),
            daemon=True)
        worker.start()
        worker.join(5)
        self.assertFalse(worker.is_alive(), "the agent blocked opening a FIFO")
        self.assertEqual(self.events()[-1]["ev"], "error")

    def test_a_symlink_planted_as_the_extraction_temporary_is_not_followed(self):
        os.symlink(self.victim, snapshot.extract_path("x7"))
        self.send("extract_chunk", id="x7", data=protocol.b64(b"junk"))
        self.send("extract_end", id="x7")
        self.assertEqual(self.events()[-1]["ev"], "error")
        self.assert_victim_untouched()

    def test_snapshot_members_are_never_written_through_a_symlink(self):
        outside = os.path.join(self.dir, "outside")
        os.makedirs(outside)
        # Already in the new sandbox: a symlink where a file and a directory go.
        os.symlink(self.victim, os.path.join(snapshot.EXTRACT_ROOT, "file"))
        # The archive itself: a symlink to a directory outside, then a file
        # beneath it.
        archive = os.path.join(self.dir, "a.tar.gz")
        with tarfile.open(archive, "w:gz") as tar:
            link = tarfile.TarInfo("dir")
            link.type, link.linkname = tarfile.SYMTYPE, outside
            tar.addfile(link)
            for name in ("dir/planted", "file"):
                info = tarfile.TarInfo(name)
                info.size = 5
                import io
                tar.addfile(info, io.BytesIO(b"owned"))
        with open(archive, "rb") as f:
            data = f.read()
        self.send("extract_chunk", id="x8", data=protocol.b64(data))
        self.send("extract_end", id="x8")
        self.assertEqual(self.events()[-1]["ev"], "done")
        self.assert_victim_untouched()
        self.assertEqual(os.listdir(outside), [])
        with open(os.path.join(snapshot.EXTRACT_ROOT, "file")) as f:
            self.assertEqual(f.read(), "owned")
