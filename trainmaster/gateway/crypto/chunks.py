"""Chunked streams: payloads of any size cross every hop with bounded memory.

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

from trainmaster.gateway.crypto.envelope import EnvelopeError, b64d
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
        head, sealed = self.seal_frame(chunk, final)
        return head[_HEADER.size :] + sealed

    def seal_frame(self, chunk: bytes, final: bool) -> tuple[bytes, bytes]:
        """One whole frame as two pieces, its length header with the flags byte and the ciphertext
        with its tag, for a vectored write: joining them would copy every streamed byte twice more."""
        if self._done:
            raise ValueError("stream already finished")
        flags = _FINAL if final else 0
        sealed = self._aead.encrypt(_nonce(self._index), chunk, _aad(self._id, self._index, flags))
        self._index += 1
        self._done = final
        return _HEADER.pack(1 + len(sealed)) + bytes([flags]), sealed

    def seal_frame_into(self, chunk: bytes | memoryview, final: bool, out: bytearray) -> tuple[bytes, memoryview]:
        """:meth:`seal_frame` into a reused buffer (at least ``len(chunk) + 16`` bytes): a relay that
        seals every MB into a fresh allocation pays page faults for each one."""
        if self._done:
            raise ValueError("stream already finished")
        flags = _FINAL if final else 0
        n = len(chunk) + _TAG
        sealed = memoryview(out)[:n]
        self._aead.encrypt_into(_nonce(self._index), chunk, _aad(self._id, self._index, flags), sealed)
        self._index += 1
        self._done = final
        return _HEADER.pack(1 + n) + bytes([flags]), sealed


class ChunkOpener:
    """Decrypts and checks one stream's chunk frames; :meth:`finish` checks the signed totals."""

    def __init__(self, info: StreamInfo, stream_id: str, max_total_bytes: int, check_digest: bool = True):
        """``check_digest=False`` (the gateway's relay) still refuses any tampered, reordered,
        truncated or extended chunk and a length other than the signed one; only the SHA-256 of
        the plaintext against the signed digest is left to the receiver at the end of the path (the
        initiator), which checks it anyway (docs/gateway.md, threat model)."""
        key = b64d(info.key)
        if len(key) != 32:
            raise EnvelopeError(400, "stream key must be 32 bytes")
        if info.total_bytes > max_total_bytes:
            raise EnvelopeError(413, f"stream of {info.total_bytes} bytes is over the {max_total_bytes}-byte cap")
        self.info, self._aead, self._id = info, AESGCM(key), stream_id
        self._index, self._seen, self._final = 0, 0, False
        self._sha = hashlib.sha256() if check_digest else None

    @property
    def max_frame(self) -> int:
        """The largest frame this stream may carry (one chunk, its flags byte and tag)."""
        return self.info.chunk_bytes + 1 + _TAG

    def _flags(self, body: bytes | memoryview) -> int:
        if self._final:
            raise EnvelopeError(400, "stream has data after its final chunk")
        if len(body) < 1 + _TAG or body[0] not in (0, _FINAL):
            raise EnvelopeError(400, f"malformed stream chunk {self._index}")
        if len(body) - 1 - _TAG > self.info.chunk_bytes:
            raise EnvelopeError(400, "stream chunk is longer than the signed chunk size")
        if self._seen + len(body) - 1 - _TAG > self.info.total_bytes:
            raise EnvelopeError(400, "stream is longer than its signed length")
        return body[0]

    def _bad_tag(self, exc: InvalidTag) -> EnvelopeError:
        return EnvelopeError(
            422, f"stream chunk {self._index} does not decrypt (tampered, reordered or from another stream)"
        )

    def _opened(self, plain: bytes | memoryview, flags: int) -> bool:
        self._seen += len(plain)
        if self._sha is not None:
            self._sha.update(plain)
        self._index += 1
        self._final = bool(flags & _FINAL)
        return self._final

    def open(self, body: bytes | memoryview) -> tuple[bytes, bool]:
        """The next chunk's plaintext and whether it was the last; refuses anything out of order."""
        flags = self._flags(body)
        try:
            plain = self._aead.decrypt(_nonce(self._index), memoryview(body)[1:], _aad(self._id, self._index, flags))
        except InvalidTag as exc:
            raise self._bad_tag(exc) from exc
        return plain, self._opened(plain, flags)

    def open_into(self, body: bytes | memoryview, out: bytearray) -> tuple[memoryview, bool]:
        """:meth:`open` into a reused buffer of at least ``info.chunk_bytes`` bytes: the plaintext
        is a view of ``out``, valid until the next call."""
        flags = self._flags(body)
        plain = memoryview(out)[: len(body) - 1 - _TAG]
        try:
            self._aead.decrypt_into(
                _nonce(self._index), memoryview(body)[1:], _aad(self._id, self._index, flags), plain
            )
        except InvalidTag as exc:
            raise self._bad_tag(exc) from exc
        return plain, self._opened(plain, flags)

    def finish(self) -> None:
        if not self._final:
            raise EnvelopeError(400, f"stream truncated: ended after {self._index} chunk(s) without a final chunk")
        if self._seen != self.info.total_bytes:
            raise EnvelopeError(400, f"stream carried {self._seen} bytes, its opening signed {self.info.total_bytes}")
        if self._sha is not None and self._sha.hexdigest() != self.info.sha256:
            raise EnvelopeError(422, "stream content does not match the digest its sender signed")


class FrameSplitter:
    """Cuts an arbitrary byte stream into frames; holds at most one frame plus one read block.

    Pieces are kept as they arrive and joined once per frame (one copy of each byte): cutting
    frames out of the front of one growing bytearray re-copied or re-allocated the buffer per
    piece and was the gateway's largest cost per streamed byte.
    """

    def __init__(self, max_frame: int = MAX_FRAME):
        self._pieces: list[bytes] = []
        self._have = 0
        self._size: int | None = None
        self._max = max_frame

    def _take(self, n: int) -> bytes:
        """The next ``n`` buffered bytes (the caller checked there are that many)."""
        if n == 0:
            return b""
        if len(self._pieces[0]) >= n:
            first = self._pieces[0]
            out = first[:n] if len(first) > n else first
            rest = first[n:]
        else:
            joined = b"".join(self._pieces)
            self._pieces.clear()
            out, rest = joined[:n], joined[n:]
            self._pieces.append(rest)
            self._have -= n
            if not rest:
                self._pieces.clear()
            return out
        self._pieces.pop(0)
        if rest:
            self._pieces.insert(0, rest)
        self._have -= n
        return out

    def feed(self, data: bytes) -> Iterator[bytes]:
        if data:
            self._pieces.append(bytes(data))
            self._have += len(data)
        while True:
            if self._size is None:
                if self._have < 4:
                    return
                (size,) = _HEADER.unpack(self._take(4))
                if size > self._max:
                    raise EnvelopeError(413, f"stream frame of {size} bytes is over the {self._max}-byte cap")
                self._size = size
            if self._have < self._size:
                return
            body = self._take(self._size)
            self._size = None
            yield body

    def close(self) -> None:
        if self._have or self._size is not None:
            raise EnvelopeError(400, "stream truncated inside a frame")


async def aframes(chunks: AsyncIterator[bytes], max_frame: int = MAX_FRAME) -> AsyncIterator[bytes]:
    """Frames out of an async byte iterator (an HTTP response body)."""
    splitter = FrameSplitter(max_frame)
    async for data in chunks:
        for body in splitter.feed(data):
            yield body
    splitter.close()
