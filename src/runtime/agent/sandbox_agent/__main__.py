"""`python3 -m sandbox_agent CONFIG_JSON` (the host runs the same through
the inline loader of `src/runtime/agent/program.rs`)."""
from sandbox_agent.loop import main

main()
