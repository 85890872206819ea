"""Chunked result streams: tens of MB cross every hop with bounded memory.

A stream is an ordinary sealed and signed envelope (the *opening*) whose payload carries a fresh
random 256-bit stream key, the total plaintext length and its SHA-256, followed by binary chunk
frames encrypted with AES-256-GCM under that key. Chunk ``i`` uses nonce ``0^4 || i`` (the key is
never reused, so a counter nonce is safe) and associated data ``opening msg_id || i || flags``; the
last chunk carries the FINAL flag. So a receiver that counts chunks itself detects

* reordering, dropping or duplicating a chunk (wrong index -> tag failure),
* truncation (the byte stream ends before a FINAL chunk), extension (a frame after FINAL),
* tampering (tag failure), and a stream spliced from another one (other msg_id -> tag failure),

and at the end the length and digest the sender signed in the opening must match what arrived.

Wire format (one HTTP body): frames, each a 4-byte big-endian length and the frame body. Party ->
gateway: frame 0 is the opening envelope's JSON, the rest are chunks. Gateway -> initiator: the
opening travels in the task result; ``/v1/results`` serves the chunk frames.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import AsyncIterator, Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import Field

from trainmaster.gateway.crypto import EnvelopeError, b64d
from trainmaster.gateway.models import Strict

MEDIA_TYPE = "application/vnd.trainmaster.stream"
CHUNK_BYTES = 1 << 20
"""Default plaintext bytes per chunk; results up to this size travel inline in one envelope."""
MAX_CHUNK_BYTES = 8 << 20
_FINAL = 0x01
_TAG = 16
_HEADER = struct.Struct(">I")
MAX_FRAME = MAX_CHUNK_BYTES + 1 + _TAG
"""No frame (opening or chunk) may be larger: what a receiver buffers at most per stream."""


class StreamInfo(Strict):
    """What the signed opening envelope says about the chunks that follow."""

    key: str = Field(pattern=r"^[A-Za-z0-9_=-]{43,44}$")
    total_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    chunk_bytes: int = Field(ge=1, le=MAX_CHUNK_BYTES)
    stream_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    """The chunks' associated-data id when it is not the opening envelope's msg id (gateway -> initiator:
    the opening is the leg's sealed outcome, written after the chunks)."""


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


def _aad(stream_id: str, index: int, flags: int) -> bytes:
    return stream_id.encode() + index.to_bytes(8, "big") + bytes([flags])


def _nonce(index: int) -> bytes:
    return b"\x00" * 4 + index.to_bytes(8, "big")


class ChunkSealer:
    """Encrypts one stream's chunks in order under a fresh key (the caller puts the key in the opening)."""

    def __init__(self, key: bytes, stream_id: str):
        self._aead, self._id, self._index, self._done = AESGCM(key), stream_id, 0, False

    def seal(self, chunk: bytes, final: bool) -> bytes:
        """One frame body: a flags byte, then the AES-GCM ciphertext and tag."""
        if self._done:
            raise ValueError("stream already finished")
        flags = _FINAL if final else 0
        body = bytes([flags]) + self._aead.encrypt(_nonce(self._index), chunk, _aad(self._id, self._index, flags))
        self._index += 1
        self._done = final
        return body


class ChunkOpener:
    """Decrypts and checks one stream's chunk frames; :meth:`finish` checks the signed totals."""

    def __init__(self, info: StreamInfo, stream_id: str, max_total_bytes: int):
        key = b64d(info.key)
        if len(key) != 32:
            raise EnvelopeError(400, "stream key must be 32 bytes")
        if info.total_bytes > max_total_bytes:
            raise EnvelopeError(413, f"stream of {info.total_bytes} bytes is over the {max_total_bytes}-byte cap")
        self.info, self._aead, self._id = info, AESGCM(key), stream_id
        self._index, self._seen, self._final = 0, 0, False
        self._sha = hashlib.sha256()

    def open(self, body: bytes) -> tuple[bytes, bool]:
        """The next chunk's plaintext and whether it was the last; refuses anything out of order."""
        if self._final:
            raise EnvelopeError(400, "stream has data after its final chunk")
        if len(body) < 1 + _TAG or body[0] not in (0, _FINAL):
            raise EnvelopeError(400, f"malformed stream chunk {self._index}")
        flags = body[0]
        try:
            plain = self._aead.decrypt(_nonce(self._index), body[1:], _aad(self._id, self._index, flags))
        except InvalidTag as exc:
            raise EnvelopeError(422, f"stream chunk {self._index} does not decrypt (tampered, reordered or "
                                     "from another stream)") from exc
        self._seen += len(plain)
        if self._seen > self.info.total_bytes or len(plain) > self.info.chunk_bytes:
            raise EnvelopeError(400, "stream is longer than its signed length")
        self._sha.update(plain)
        self._index += 1
        self._final = bool(flags & _FINAL)
        return plain, self._final

    def finish(self) -> None:
        if not self._final:
            raise EnvelopeError(400, f"stream truncated: ended after {self._index} chunk(s) without a final chunk")
        if self._seen != self.info.total_bytes:
            raise EnvelopeError(400, f"stream carried {self._seen} bytes, its opening signed {self.info.total_bytes}")
        if self._sha.hexdigest() != self.info.sha256:
            raise EnvelopeError(422, "stream content does not match the digest its sender signed")


class FrameSplitter:
    """Cuts an arbitrary byte stream into frames; holds at most one frame plus one read block."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self._buf, self._max = bytearray(), max_frame

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buf += data
        while len(self._buf) >= 4:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > self._max:
                raise EnvelopeError(413, f"stream frame of {size} bytes is over the {self._max}-byte cap")
            if len(self._buf) < 4 + size:
                return
            body = bytes(self._buf[4:4 + size])
            del self._buf[:4 + size]
            yield body

    def close(self) -> None:
        if self._buf:
            raise EnvelopeError(400, "stream truncated inside a frame")


async def aframes(chunks: AsyncIterator[bytes], max_frame: int = MAX_FRAME) -> AsyncIterator[bytes]:
    """Frames out of an async byte iterator (an HTTP response body)."""
    splitter = FrameSplitter(max_frame)
    async for data in chunks:
        for body in splitter.feed(data):
            yield body
    splitter.close()
