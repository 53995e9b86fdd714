"""python quickstart.py [ws://HOST:PORT]: a sandbox on the python-data image; files, code, a figure, a fork, a checkpoint."""
import sys
from sandboxd.sync import Sandbox
with Sandbox.create(sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:8080", image="python-data", enable_sandbox_checkpoint=True) as sandbox:
    sandbox.files.write("hello.txt", "hello from the quickstart\n")
    print("file:", sandbox.files.read_text("hello.txt").strip(), "| value:", sandbox.run_code("import numpy as np\nnp.arange(10).sum()").text)
    png = sandbox.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);").pngs[0]
    fork = sandbox.fork(); print(f"figure: {len(png)} bytes, {png[:8]!r}; fork {fork.sandbox_id} reads:", fork.files.read_text("hello.txt").strip())
    fork.kill(); sandbox.checkpoint("quickstart-done")
    print("checkpoints:", [(c.role, c.name) for c in sandbox.checkpoints()])
