"""Every op the host may send, and its handler: the one table the agent
dispatches by (`protocol.json` lists the same ops; the unit tests check both
ways).

Handlers are named, not imported: a module is imported the first time one of
its ops arrives, so a sandbox's boot compiles only what executions need
(snapshots, workspace sync and checkpoints may never come)."""
import importlib

from . import protocol, state

# op -> (module of this package, function)
HANDLERS = {
    "exec": ("execution", "start_exec"),
    "stdin": ("execution", "stdin"),
    "stdin_close": ("execution", "stdin_close"),
    "kill": ("execution", "kill"),
    "resize": ("execution", "resize"),
    "ping": ("handlers", "ping"),
    "prepare_checkpoint": ("checkpoint", "prepare"),
    "ack": ("journal", "ack"),
    "journals": ("journal", "journals"),
    "resume": ("journal", "resume"),
    "close_connections": ("checkpoint", "close_connections"),
    "archive": ("snapshot", "archive"),
    "extract_chunk": ("snapshot", "extract_chunk"),
    "extract_end": ("snapshot", "extract_end"),
    "ws_scan": ("workspace", "ws_scan"),
    "ws_read": ("workspace", "ws_read"),
    "ws_write_chunk": ("workspace", "ws_write_chunk"),
    "ws_write_end": ("workspace", "ws_write_end"),
    "ws_write_abort": ("workspace", "ws_write_abort"),
    "ws_delete": ("workspace", "ws_delete"),
    "ws_state": ("workspace", "ws_state"),
    "fs_stat": ("files", "fs_stat"),
    "fs_list": ("files", "fs_list"),
    "fs_read": ("files", "fs_read"),
    "fs_read_bytes": ("files", "fs_read_bytes"),
    "fs_write": ("files", "fs_write"),
    "fs_mkdir": ("files", "fs_mkdir"),
    "fs_remove": ("files", "fs_remove"),
    "fs_rename": ("files", "fs_rename"),
    "fs_upload_open": ("files", "fs_upload_open"),
    "fs_upload_chunk": ("files", "fs_upload_chunk"),
    "fs_upload_bytes": ("files", "fs_upload_bytes"),
    "fs_upload_commit": ("files", "fs_upload_commit"),
    "fs_upload_abort": ("files", "fs_upload_abort"),
}


def ping(msg):
    protocol.emit({"ev": "pong", "id": msg.get("id"), "version": protocol.VERSION,
                   "running": list(state.EXECS)})


def handler(op):
    """The function that handles `op`, or None."""
    target = HANDLERS.get(op)
    if target is None:
        return None
    module = importlib.import_module("%s.%s" % (__package__, target[0]))
    return getattr(module, target[1])


def handle(msg):
    """Runs one command; never lets it raise (one bad command must not kill PID 1)."""
    op = msg.get("op") if isinstance(msg, dict) else None
    run = handler(op) if isinstance(op, str) else None
    if run is None:
        protocol.error(msg.get("id") if isinstance(msg, dict) else None, "unknown op %r" % op)
        return
    try:
        run(msg)
    except Exception as err:
        if op.startswith("ws_") and isinstance(err, (OSError, workspace_error())):
            # A refused path or a failed file operation: the op's error.
            protocol.error(msg.get("id"), str(err))
        else:
            protocol.error(msg.get("id"), "%s: %s" % (type(err).__name__, err))


def workspace_error():
    from .workspace import WorkspaceError
    return WorkspaceError
