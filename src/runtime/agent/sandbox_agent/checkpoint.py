"""Getting the sandbox ready for `runsc checkpoint`: ops prepare_checkpoint
(no host file descriptor held by user code; executions killed, or paused
when the checkpoint keeps them) and close_connections (an `egress`
sandbox's TCP connections off loopback, which this runsc cannot save)."""
import os
import time

from . import protocol, state
from .execution import kill_tree, unregister_outputs

# TCP states in /proc/net/tcp that hold no connection: LISTEN, CLOSE.
IDLE_TCP_STATES = ("0A", "07")


def loop_once(timeout):
    from .loop import loop_once as run  # the loop imports the handlers: import late

    run(timeout)


def host_fd_holders():
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % entry):
                if os.readlink("/proc/%s/fd/%s" % (entry, fd)).startswith("host:"):
                    holders.append(int(entry))
                    break
        except OSError:
            continue
    return holders


def prepare(msg):
    for exec_id, seq in (msg.get("acked") or {}).items():
        execution = state.JOURNALS.get(exec_id)
        if execution is not None:
            execution.ack(int(seq))
    executions = state.EXECS
    if msg.get("keep") and all(e.resumable for e in executions.values()) and (
            executions or state.JOURNALS):
        # Keep them: stop reading their output (it stays in the pipes, in
        # the image) and hold back exits, until "resume".
        state.PAUSED = True
        for execution in executions.values():
            unregister_outputs(execution)
        holders = [pid for pid in host_fd_holders()
                   if pid not in {e.pid for e in executions.values()}]
        for pid in holders:
            kill_tree(pid)
        protocol.emit({"ev": "ready", "id": msg["id"], "killed_host_fd_holders": holders,
                       "running": [], "kept": list(state.JOURNALS)})
        return
    if executions and not msg.get("force"):
        protocol.error(msg["id"], "an execution is running")
        return
    for exec_id in list(executions):
        kill_tree(executions[exec_id].pid)
    deadline = time.time() + 2.0
    while state.EXECS and time.time() < deadline:
        loop_once(0.05)
    # A checkpoint that keeps nothing (a periodic one, restored in place):
    # the host's replay log has what an ended execution printed; a journal
    # kept in the image would make a later move replay it again.
    state.JOURNALS.clear()
    holders = host_fd_holders()
    for pid in holders:
        kill_tree(pid)
    protocol.emit({"ev": "ready", "id": msg["id"], "killed_host_fd_holders": holders,
                   "running": list(state.EXECS)})


def is_loopback_hex(address):
    """True for a /proc/net/tcp{,6} address on loopback (127/8, ::1, ::ffff:127/8)."""
    host = address.split(":")[0]
    if len(host) == 8:
        return host[6:8] == "7F"
    return host == "00000000000000000000000001000000" or (
        host[:24] == "0000000000000000FFFF0000" and host[30:32] == "7F")


def external_tcp(tables=("/proc/net/tcp", "/proc/net/tcp6")):
    """(inode, remote) of every TCP socket connected to something off loopback."""
    found = []
    for table in tables:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] in IDLE_TCP_STATES or is_loopback_hex(fields[2]):
                continue
            found.append((fields[9], fields[2]))
    return found


def close_connections(msg):
    """Ends every process holding a connection off loopback: this runsc cannot
    checkpoint a sandbox with one open (the host turns the closes into resets)."""
    inodes = {"socket:[%s]" % inode for inode, _ in external_tcp()}
    owners = set()
    if inodes:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                for fd in os.listdir("/proc/%s/fd" % entry):
                    if os.readlink("/proc/%s/fd/%s" % (entry, fd)) in inodes:
                        owners.add(int(entry))
                        break
            except OSError:
                continue
    for pid in owners:
        kill_tree(pid)
    deadline = time.time() + 1.0
    while owners and time.time() < deadline:
        loop_once(0.05)
        if not external_tcp():
            break
    protocol.emit({"ev": "ready", "id": msg["id"], "killed": sorted(owners),
                   "remaining": [remote for _, remote in external_tcp()]})
