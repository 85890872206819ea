"""The HTTP/1.1 pieces of the gateway's hand-rolled client for its party link
(:mod:`trainmaster.gateway.relay.partylink`: asyncio, kept-alive connections). It sends one kind
of request (a POST of a JSON envelope) and reads what uvicorn answers: a status line, headers,
and a Content-Length or chunked body. The link raises its own transport error from the
``ValueError`` raised here. (Large results and inputs do not use HTTP: they cross the stream
port, :mod:`trainmaster.gateway.net.streams`.)"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: dict[str, str]  # names lower-cased
    content_length: int | None  # None: a chunked body


def https_address(endpoint: str, whose: str) -> tuple[str, int]:
    """Host and port of an ``https://`` endpoint (``whose`` names it in the error)."""
    url = urlsplit(endpoint)
    if url.scheme != "https" or url.hostname is None:
        raise ValueError(f"{whose} endpoint {endpoint!r} is not an https URL")
    return url.hostname, url.port or 443


def post_head(path: str, host: str, port: int, body_bytes: int, close: bool) -> bytes:
    """The head of a POST of a JSON body of ``body_bytes``; ``close`` asks for no keep-alive."""
    connection = "connection: close\r\n" if close else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {body_bytes}\r\n{connection}\r\n"
    ).encode()


def parse_head(head: bytes) -> ResponseHead:
    """A response head (through its blank line) as status, headers and body framing."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"malformed status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        content_length = None
    elif length is not None and length.isdigit():
        content_length = int(length)
    else:
        raise ValueError("response with neither a Content-Length nor a chunked body")
    return ResponseHead(int(parts[1]), headers, content_length)
