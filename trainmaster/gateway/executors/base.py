"""What the party needs from a per-task executor, whatever runs it: the :class:`Executor`
interface, the reply of a rule call, and the errors an executor reports."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from trainmaster.gateway.models import RuleCall


def encode_reply(result: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """A successful rule's reply head and body: the result as compact JSON, its size and digest."""
    body = json.dumps(result, separators=(",", ":")).encode()
    return {"ok": True, "error": "", "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}, body


class RuleReply:
    """An executor's answer: ``ok``/``error`` and, when ok, ``size`` bytes of result JSON to read.

    ``read(n)`` returns the next ``n`` bytes; reading in chunks keeps a large result from being
    held whole by the party agent (the subprocess executor streams it off its socket).
    """

    def __init__(
        self, head: dict[str, Any], read: Callable[[int], Awaitable[bytes]], close: Callable[[], None] = lambda: None
    ):
        self.ok, self.error = bool(head.get("ok")), str(head.get("error", ""))
        self.size, self.sha256 = int(head.get("size", 0)), str(head.get("sha256", ""))
        self._read, self._close, self._left = read, close, self.size

    async def chunks(self, chunk_bytes: int) -> AsyncIterator[tuple[bytes, bool]]:
        """The result in order, each piece with whether it is the last (an empty result is one piece)."""
        while True:
            piece = await self._read(min(chunk_bytes, self._left)) if self._left else b""
            self._left -= len(piece)
            yield piece, self._left == 0
            if self._left == 0:
                return

    async def read_all(self) -> bytes:
        return b"".join([piece async for piece, _last in self.chunks(max(1, self.size))])

    def close(self) -> None:
        self._close()


class Executor(Protocol):
    """What the party needs from a per-task isolated executor, whatever runs it."""

    address: str

    @property
    def alive(self) -> bool: ...

    async def call(self, call: RuleCall, timeout_s: float) -> RuleReply: ...

    def kill(self) -> None: ...


class ExecutorStartError(RuntimeError):
    """The executor could not be set up at all (its sandbox or cgroups refused); the message says why."""


class ExecutorDied(OSError):
    """The executor ended while serving a call; the message says why (e.g. its memory limit)."""
