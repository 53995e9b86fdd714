"""A filesystem snapshot's archive unpacks into another directory with the
same files; an archive that is not one is an error."""
import os

from sandbox_agent import protocol, snapshot

from .support import AgentTest


class SnapshotTest(AgentTest):
    def setUp(self):
        super().setUp()
        self.saved = snapshot.EXTRACT_DIR, snapshot.EXTRACT_ROOT
        snapshot.EXTRACT_DIR = self.dir
        snapshot.EXTRACT_ROOT = os.path.join(self.dir, "restored")

    def tearDown(self):
        snapshot.EXTRACT_DIR, snapshot.EXTRACT_ROOT = self.saved
        super().tearDown()

    def test_an_archive_extracts_to_the_same_files(self):
        source = os.path.join(self.dir, "home")
        os.makedirs(os.path.join(source, "d"))
        with open(os.path.join(source, "d", "f"), "w") as f:
            f.write("content")
        os.symlink("d/f", os.path.join(source, "link"))
        archive = self.send("archive", paths=[source], since=0)
        events = self.events()
        chunks = [e["data"] for e in events if e["ev"] == "chunk"]
        self.assertEqual(events[-1]["id"], archive)
        self.assertEqual(events[-1]["entries"], 3)
        self.assertEqual(events[-1]["size"], sum(len(protocol.unb64(c)) for c in chunks))
        for data in chunks:
            self.send("extract_chunk", id="x1", data=data)
        self.send("extract_end", id="x1")
        self.assertEqual(self.events(), [{"ev": "done", "id": "x1", "entries": 3}])
        restored = os.path.join(snapshot.EXTRACT_ROOT, source.lstrip("/"))
        with open(os.path.join(restored, "d", "f")) as f:
            self.assertEqual(f.read(), "content")
        self.assertEqual(os.readlink(os.path.join(restored, "link")), "d/f")

    def test_a_broken_archive_is_an_error(self):
        self.send("extract_chunk", id="x2", data=protocol.b64(b"not a tarball"))
        self.send("extract_end", id="x2")
        [error] = self.events()
        self.assertEqual((error["ev"], error["id"]), ("error", "x2"))
        self.assertFalse(os.path.exists(snapshot.extract_path("x2")))
