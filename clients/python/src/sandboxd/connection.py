"""The WebSocket under a sandbox: opening it (affinity cookie, bearer token),
and reading its frames."""

from __future__ import annotations

import json
import ssl as ssl_module
from typing import Any, Optional, Union

import websockets
from websockets.asyncio.client import ClientConnection, connect

from .errors import SandboxConnectionError

#: The largest frame accepted from the server (rich results carry images).
MAX_FRAME_BYTES = 64 << 20

Frame = Union[dict[str, Any], bytes]


class CookieJar:
    """The affinity cookie (Cloud Run's `GAESA`): the `name=value` of the
    last `Set-Cookie` an upgrade response carried, sent back on every later
    connection of the sandbox, so reconnects reach the same instance."""

    def __init__(self) -> None:
        self.cookie: Optional[str] = None

    def keep(self, headers: Any) -> None:
        value = headers.get("Set-Cookie") if headers is not None else None
        if value:
            self.cookie = value.split(";", 1)[0].strip()


async def open_socket(
    url: str,
    jar: CookieJar,
    *,
    bearer: Optional[str] = None,
    ssl: Optional[ssl_module.SSLContext] = None,
    open_timeout: float = 30.0,
) -> ClientConnection:
    """Opens a WebSocket to `url` with the jar's cookie and `Authorization:
    Bearer` (the Cloud Run ID token) when given."""
    headers: dict[str, str] = {}
    if jar.cookie:
        headers["Cookie"] = jar.cookie
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    options: dict[str, Any] = {}
    if ssl is not None:
        options["ssl"] = ssl
    try:
        socket = await connect(
            url,
            additional_headers=headers,
            max_size=MAX_FRAME_BYTES,
            compression=None,
            open_timeout=open_timeout,
            ping_interval=20,
            ping_timeout=60,
            **options,
        )
    except (OSError, websockets.exceptions.WebSocketException, TimeoutError) as err:
        raise SandboxConnectionError(f"Failed to connect to {redact(url)}: {err}") from err
    jar.keep(socket.response.headers if socket.response is not None else None)
    return socket


def redact(url: str) -> str:
    """`url` without its sandbox token (for messages)."""
    head, sep, _ = url.partition("sandbox_token=")
    return head + ("sandbox_token=…" if sep else "")


def decode(message: Union[str, bytes]) -> Frame:
    """A server frame: a JSON object (text) or bytes (a download's)."""
    if isinstance(message, bytes):
        return message
    frame = json.loads(message)
    if not isinstance(frame, dict):
        raise ValueError(f"a server frame is not a JSON object: {message[:200]!r}")
    return frame
