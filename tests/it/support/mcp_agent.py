"""An agent's use of `sandboxctl mcp`, through the official Python SDK's
stdio client (`pip install mcp`): it spawns the server, lists the tools and
uses each, and checks what comes back. Run by tests/it/gvisor/mcp.rs as
`python3 mcp_agent.py SANDBOXCTL URL`; the last line of its stdout is a JSON
summary for the Rust side. Any failed check raises (exit status 1).
"""

import asyncio
import json
import sys
import time

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

try:
    from mcp import MCPError
except ImportError:  # the 1.x releases' name
    from mcp.shared.exceptions import McpError as MCPError

TOOLS = {
    "create_sandbox",
    "run_code",
    "read_file",
    "write_file",
    "list_files",
    "checkpoint_sandbox",
    "fork_sandbox",
    "kill_sandbox",
}
CONTENT = "hello from an agent \u2713\nsecond line\n"


def text_of(result):
    return "".join(block.text for block in result.content if block.type == "text")


def is_error(result):
    # 2.x names the fields in snake case, 1.x as on the wire.
    return getattr(result, "is_error", getattr(result, "isError", None))


def structured(result):
    return getattr(result, "structured_content", getattr(result, "structuredContent", None))


def ok(result, what):
    assert not is_error(result), f"{what}: {text_of(result)}"
    return text_of(result)


def failed(result, what):
    assert is_error(result), f"{what} should have failed: {text_of(result)}"
    return text_of(result)


async def run(session, sandbox_id, language, code, **extra):
    result = await session.call_tool(
        "run_code", {"sandbox_id": sandbox_id, "language": language, "code": code, **extra}
    )
    return result


async def main(sandboxctl, url):
    server = StdioServerParameters(command=sandboxctl, args=["mcp", "--url", url])
    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()

            listed = await session.list_tools()
            names = {tool.name for tool in listed.tools}
            assert names == TOOLS, f"tools: {sorted(names)}"
            schemas = {
                tool.name: getattr(tool, "input_schema", getattr(tool, "inputSchema", None))
                for tool in listed.tools
            }
            run_schema = schemas["run_code"]
            assert set(run_schema["required"]) >= {"sandbox_id", "language", "code"}, run_schema
            assert "timeout" in run_schema["properties"], run_schema
            assert "python" in json.dumps(run_schema) and "bash" in json.dumps(run_schema)
            for name in TOOLS - {"create_sandbox"}:
                assert "sandbox_id" in schemas[name]["required"], (name, schemas[name])
            assert all(tool.description for tool in listed.tools)

            created = await session.call_tool("create_sandbox", {})
            sandbox = json.loads(ok(created, "create_sandbox"))["sandbox_id"]
            assert structured(created) == {"sandbox_id": sandbox}

            wrote = await session.call_tool(
                "write_file",
                {"sandbox_id": sandbox, "path": "notes/hello.txt", "content": CONTENT},
            )
            assert "/home/sandbox/notes/hello.txt" in ok(wrote, "write_file")

            # Code that reads the file: its content comes back.
            out = ok(
                await run(
                    session,
                    sandbox,
                    "python",
                    "print(open('/home/sandbox/notes/hello.txt').read(), end='')",
                ),
                "run_code",
            )
            assert out == CONTENT + "[exit code 0]", repr(out)

            read = ok(
                await session.call_tool(
                    "read_file", {"sandbox_id": sandbox, "path": "notes/hello.txt"}
                ),
                "read_file",
            )
            assert read == CONTENT, repr(read)
            part = ok(
                await session.call_tool(
                    "read_file",
                    {"sandbox_id": sandbox, "path": "notes/hello.txt", "offset": 6, "length": 4},
                ),
                "read_file (a range)",
            )
            assert part.startswith("from\n[... the file is"), repr(part)
            listing = ok(
                await session.call_tool("list_files", {"sandbox_id": sandbox, "path": "notes"}),
                "list_files",
            )
            assert "hello.txt" in listing and listing.startswith("- 0644"), listing

            # Output streams as progress while it runs.
            seen = []

            async def on_progress(progress, total, message):
                seen.append((progress, message))

            streamed = await session.call_tool(
                "run_code",
                {
                    "sandbox_id": sandbox,
                    "language": "bash",
                    "code": "for i in 1 2 3 4; do echo line$i; echo oops$i >&2; sleep 0.4; done; exit 3",
                },
                progress_callback=on_progress,
            )
            out = ok(streamed, "run_code (streamed)")
            assert out.startswith("line1\nline2\nline3\nline4\n[stderr]\noops1\n"), repr(out)
            assert out.endswith("[exit code 3]"), repr(out)
            assert len(seen) >= 2, f"progress notifications: {seen}"
            assert [p for p, _ in seen] == sorted(p for p, _ in seen)
            joined = "".join(message for _, message in seen)
            for i in range(1, 5):
                assert f"line{i}\n" in joined and f"[stderr] oops{i}\n" in joined, joined

            # Calls share the sandbox's connection: a file is read while a
            # program runs; a second program at once is refused.
            running = asyncio.create_task(
                run(session, sandbox, "bash", "echo begun > /tmp/begun; sleep 3; echo finished")
            )
            # `echo begun > /tmp/begun` creates the file empty, then writes
            # it: a read between the two (a loaded machine) finds it empty.
            for _ in range(100):
                begun = await session.call_tool(
                    "read_file", {"sandbox_id": sandbox, "path": "/tmp/begun"}
                )
                if not is_error(begun) and text_of(begun) != "":
                    break
                await asyncio.sleep(0.1)
            assert text_of(begun) == "begun\n", text_of(begun)
            assert not running.done(), "the program should still run"
            busy = failed(await run(session, sandbox, "bash", "true"), "a second program at once")
            assert "in progress" in busy, busy
            out = ok(await running, "the first program")
            assert out == "finished\n[exit code 0]", repr(out)

            # A flood is bounded, with a marker; a timeout kills.
            big = ok(
                await run(session, sandbox, "python", "print('x' * (3 << 20))"),
                "run_code (3 MiB)",
            )
            assert "bytes of output left out" in big and len(big) < (1 << 20) + 4096, len(big)
            slow = ok(
                await run(session, sandbox, "bash", "echo started; sleep 60", timeout=2),
                "run_code (timeout)",
            )
            assert slow.startswith("started\n") and "timed out after 2 s" in slow, slow

            # Errors are tool errors, and the server serves on.
            missing = failed(
                await session.call_tool("read_file", {"sandbox_id": sandbox, "path": "nope.txt"}),
                "read_file of a missing file",
            )
            assert missing.startswith("ENOENT"), missing
            unknown = failed(
                await run(session, "0" * 32, "bash", "true"), "run_code in an unknown sandbox"
            )
            assert "unknown sandbox id" in unknown and sandbox in unknown, unknown
            # Arguments outside the schema: a tool error (or, from older
            # SDKs, a JSON-RPC invalid-params error) naming the value.
            try:
                bad = failed(
                    await run(session, sandbox, "ruby", "puts 1"), "run_code in ruby"
                )
            except MCPError as err:
                bad = str(err)
            assert "ruby" in bad, bad
            again = await session.list_tools()
            assert {tool.name for tool in again.tools} == TOOLS

            # A fork: another id, the same files; then each goes its own way.
            forked = await session.call_tool("fork_sandbox", {"sandbox_id": sandbox})
            fork = json.loads(ok(forked, "fork_sandbox"))["sandbox_id"]
            assert fork != sandbox
            out = ok(await run(session, fork, "bash", "cat /home/sandbox/notes/hello.txt"), "run_code in the fork")
            assert out == CONTENT + "[exit code 0]", repr(out)
            ok(
                await session.call_tool(
                    "write_file", {"sandbox_id": fork, "path": "notes/hello.txt", "content": "fork\n"}
                ),
                "write_file in the fork",
            )
            read = ok(
                await session.call_tool(
                    "read_file", {"sandbox_id": sandbox, "path": "notes/hello.txt"}
                ),
                "read_file after the fork",
            )
            assert read == CONTENT, repr(read)

            named = ok(
                await session.call_tool(
                    "checkpoint_sandbox", {"sandbox_id": sandbox, "name": "before-cleanup"}
                ),
                "checkpoint_sandbox",
            )
            assert "before-cleanup" in named, named
            out = ok(
                await run(session, sandbox, "bash", "cat /home/sandbox/notes/hello.txt"),
                "run_code after a checkpoint",
            )
            assert out == CONTENT + "[exit code 0]", repr(out)

            # A fork of the named checkpoint; an unknown name is a tool error.
            named_fork = json.loads(
                ok(
                    await session.call_tool(
                        "fork_sandbox", {"sandbox_id": sandbox, "checkpoint": "before-cleanup"}
                    ),
                    "fork_sandbox of a named checkpoint",
                )
            )["sandbox_id"]
            assert named_fork not in (sandbox, fork)
            out = ok(
                await run(session, named_fork, "bash", "cat /home/sandbox/notes/hello.txt"),
                "run_code in the named fork",
            )
            assert out == CONTENT + "[exit code 0]", repr(out)
            ok(await session.call_tool("kill_sandbox", {"sandbox_id": named_fork}), "kill_sandbox")
            no_such = failed(
                await session.call_tool(
                    "fork_sandbox", {"sandbox_id": sandbox, "checkpoint": "no-such-name"}
                ),
                "fork_sandbox of an unknown checkpoint",
            )
            assert "no-such-name" in no_such, no_such

            ok(await session.call_tool("kill_sandbox", {"sandbox_id": fork}), "kill_sandbox")
            gone = failed(await run(session, fork, "bash", "true"), "run_code in a killed sandbox")
            assert "unknown sandbox id" in gone, gone
            leaving = time.monotonic()

    # The server was told to stop (stdin closed): it kills what it made.
    summary = {
        "sandbox": sandbox,
        "fork": fork,
        "named_fork": named_fork,
        "progress_notifications": len(seen),
        # The client waits 2 s after closing stdin, then SIGTERM, then SIGKILL.
        "shutdown_s": round(time.monotonic() - leaving, 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
