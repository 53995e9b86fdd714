"""sandboxd's agent: PID 1 inside every sandbox.

The host talks to it over the agent's own stdin/stdout, one JSON object per
line. Those are the init process's stdio, which runsc hands over to the
restoring caller on `runsc restore`, so the channel survives checkpoint and
restore with no socket, no bind mount and no `runsc exec` on the hot path.

User code never holds a host file descriptor: every execution gets pipes made
here, inside the sandbox, and the agent relays their bytes. (An exec'd process
holding host pipes at checkpoint time makes every later restore fail.) As PID 1
the agent also reaps every orphan.

host -> agent: {"op": ...}   agent -> host: {"ev": ...}   bytes are base64,
except file chunks (version 2): raw, right after a line that says
`"bytes": N` (see `protocol`).
Every message is listed in `protocol.json` beside this package; the host's
`src/runtime/agent/protocol.rs` and the tests of both sides check against it.

Modules, one concern each:
  protocol    the channel: the protocol version, writing events, reading commands
  config      what the host passes in argv[1]; dropping to the sandbox's user
  state       what the modules share: the selector, the running executions
  execution   executions and the persistent Python session; exec, stdin, kill
  journal     resumable executions' journals: ack, journals, resume
  checkpoint  preparing a checkpoint: prepare_checkpoint, close_connections
  snapshot    filesystem snapshots: archive, extract_chunk, extract_end
  workspace   workspace sync's file operations (ws_*)
  handlers    every op -> its handler
  loop        the main loop: commands, pipes, reaping; `main`

The host runs it inline (`python3 -S -c <bootstrap>`, no file in the sandbox):
`src/runtime/agent/program.rs` embeds these files and a loader that imports
them from memory.
"""
