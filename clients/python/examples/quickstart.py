"""Quick start: python quickstart.py [ws://127.0.0.1:8080] (needs the python-data image)."""
import asyncio, sys
from sandboxd import Sandbox

async def main(url: str) -> None:
    async with await Sandbox.create(url, image="python-data", enable_sandbox_checkpoint=True) as sandbox:
        await sandbox.files.write("hello.txt", "hello from the quickstart\n")
        print("file:", (await sandbox.files.read_text("hello.txt")).strip())
        print("value:", (await sandbox.run_code("import numpy as np\nnp.arange(10).sum()")).text)
        plot = await sandbox.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);")
        print(f"figure: {len(plot.pngs[0])} bytes of PNG, header {plot.pngs[0][:8]!r}")
        fork = await sandbox.fork()
        print("fork:", fork.sandbox_id, "reads", (await fork.files.read_text("hello.txt")).strip()); await fork.kill()
        await sandbox.checkpoint("quickstart-done")
        print("checkpointed:", sandbox.sandbox_id, "as quickstart-done")

asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:8080"))
