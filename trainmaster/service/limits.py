"""Request limits of the controller service, enforced before any route reads a body.

A job document is a few KB; the service refuses bodies over :attr:`RequestLimits.max_body_bytes`
with ``413`` as soon as the count passes the limit, whether the client announced a
``Content-Length`` or streams a chunked body (the bytes are counted as they arrive, so a client
cannot lie its way past the check), and refuses JSON nested deeper than
:attr:`RequestLimits.max_json_depth` with ``413`` too: deep nesting is what exhausts a parser's
or encoder's recursion, never a real job.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from trainmaster.spec.load import MAX_DOCUMENT_BYTES, MAX_DOCUMENT_DEPTH

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = MAX_DOCUMENT_BYTES
    max_json_depth: int = MAX_DOCUMENT_DEPTH


def json_depth(body: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON text, brackets inside strings not counted."""
    depth = deepest = 0
    for match in _TOKENS.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


class BodyLimit:
    """ASGI middleware: read the whole body (at most the limit), check it, replay it to the app."""

    def __init__(self, app: ASGIApp, limits: RequestLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or len(declared) > 18 or int(declared) > limit):
            await _refuse(
                send,
                413,
                f"request body over {limit} bytes (Content-Length {declared[:20].decode(errors='replace')}); "
                "a job document is a few KB",
            )
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, 413, f"request body over {limit} bytes; a job document is a few KB")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and json_depth(body) > self.limits.max_json_depth:
            await _refuse(
                send,
                413,
                f"JSON nested more than {self.limits.max_json_depth} levels deep; "
                "a job document is a few levels of mappings and lists",
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(send: Send, status: int, message: str) -> None:
    payload = json.dumps({"error": message, "details": []}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
