"""What a sandbox's parts (its files, its processes) need of the sandbox
they belong to: sending frames on its one connection, and being told when a
process ends. A typing Protocol, so `files` and `process` name no `Sandbox`
and stay below the module that defines it (`sandbox`), which uses them."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, Union


class Channel(Protocol):
    """The sending side of a sandbox's connection (`Sandbox` is one)."""

    _send_lock: asyncio.Lock

    async def _send(self, data: dict[str, Any]) -> None:
        """Sends one JSON frame."""
        ...

    async def _send_text_unlocked(self, text: str) -> None:
        """Sends one text frame; the caller holds `_send_lock`."""
        ...

    async def _send_bytes(self, data: Union[bytes, memoryview]) -> None:
        """Sends one binary frame; the caller holds `_send_lock`."""
        ...


class ProcessHost(Channel, Protocol):
    """A sandbox as one of its processes sees it."""

    def _process_ended(self, process: Any) -> None:
        """The process ended: the sandbox may run the next one."""
        ...
