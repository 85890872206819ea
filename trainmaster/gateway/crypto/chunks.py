"""Chunked streams: payloads of any size cross every hop with bounded memory.

A stream is a run of binary chunk frames encrypted with AES-256-GCM under a fresh random 256-bit
key that only the two ends of one hop know (it travels inside a sealed, signed envelope). Chunk
``i`` uses nonce ``0^4 || i`` (the key is never reused, so a counter nonce is safe) and associated
data ``stream id || i || flags``; the last chunk carries the FINAL flag. A resumed stream starts at
a later index (``first_index``) under a new key. So a receiver that counts chunks itself detects

* reordering, dropping or duplicating a chunk (wrong index -> tag failure),
* truncation (the stream ends before a FINAL chunk), extension (a frame after FINAL),
* tampering (tag failure), and a stream spliced from another one (other id -> tag failure),

and at the end the length the sender announced must match what arrived. Whether the bytes are the
ones their author signed (a party's result, an initiator's input) is checked end to end by SHA-256
against the author's signed digest, by the final receiver only.

Because each frame is sealed and checked this way, chunk frames cross the stream port outside the
TLS records of its connection (:meth:`~trainmaster.gateway.net.streams.StreamSocket.send_chunk`):
TLS authenticates both ends and carries the sealed keys and every status; the chunk AEAD alone
protects the bulk bytes, one AES-GCM pass per hop end instead of two.

Wire format: frames, each a 4-byte big-endian length, a flags byte, then the ciphertext and tag.
"""

from __future__ import annotations

import mmap
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from trainmaster.gateway.crypto.envelope import EnvelopeError

CHUNK_BYTES = 1 << 20
"""Default plaintext bytes per chunk; results up to this size travel inline in one envelope."""
MAX_CHUNK_BYTES = 8 << 20
_FINAL = 0x01
ABORT = 0x80
"""A frame whose flags byte is this carries no chunk but the sender's reason (UTF-8) for ending
the stream early: a relay that refused what it received says why instead of just closing. It is
sealed like a chunk (the next index, this flag in the associated data), so only the other end of
the hop can end a stream with a reason."""
MAX_REASON_BYTES = 4000
TAG_BYTES = 16
HEADER = struct.Struct(">I")
FRAME_OVERHEAD = HEADER.size + 1 + TAG_BYTES
"""Bytes a frame adds to its chunk: the length, the flags byte and the tag."""
MAX_FRAME = MAX_CHUNK_BYTES + 1 + TAG_BYTES
"""No frame body may be larger: what a receiver buffers at most per stream."""


def _aad(stream_id: str, index: int, flags: int) -> bytes:
    return stream_id.encode() + index.to_bytes(8, "big") + bytes([flags])


def _nonce(index: int) -> bytes:
    return b"\x00" * 4 + index.to_bytes(8, "big")


class ChunkSealer:
    """Encrypts one stream's chunks in order under a fresh key (the caller sends the key sealed)."""

    def __init__(self, key: bytes, stream_id: str, first_index: int = 0):
        self._aead, self._id, self._index, self._done = AESGCM(key), stream_id, first_index, False

    def buffer(self, chunk_bytes: int) -> bytearray:
        """A reusable buffer for :meth:`seal_into` of chunks up to ``chunk_bytes``."""
        return bytearray(chunk_bytes + FRAME_OVERHEAD)

    def seal_into(self, chunk: bytes | memoryview, final: bool, out: bytearray) -> memoryview:
        """One whole frame (length, flags, ciphertext and tag) written into ``out``: one buffer per
        stream, one ``sendall`` per frame, no allocation per chunk."""
        if self._done:
            raise ValueError("stream already finished")
        flags = _FINAL if final else 0
        n = len(chunk) + TAG_BYTES
        HEADER.pack_into(out, 0, 1 + n)
        out[HEADER.size] = flags
        view = memoryview(out)
        self._aead.encrypt_into(
            _nonce(self._index), chunk, _aad(self._id, self._index, flags), view[HEADER.size + 1 : HEADER.size + 1 + n]
        )
        self._index += 1
        self._done = final
        return view[: HEADER.size + 1 + n]

    def abort(self, reason: str) -> bytes:
        """A whole frame ending the stream early with ``reason`` (see :data:`ABORT`), sealed at
        the next index; nothing may follow it."""
        text = reason.encode()[:MAX_REASON_BYTES]
        sealed = self._aead.encrypt(_nonce(self._index), text, _aad(self._id, self._index, ABORT))
        self._done = True
        return HEADER.pack(1 + len(sealed)) + bytes([ABORT]) + sealed

    def seal(self, chunk: bytes, final: bool) -> bytes:
        """One frame body (flags, ciphertext, tag), allocated: for tests and small streams."""
        return bytes(self.seal_into(chunk, final, self.buffer(len(chunk)))[HEADER.size :])


class ChunkOpener:
    """Decrypts and checks one stream's chunk frames; :meth:`finish` checks the announced length."""

    def __init__(
        self, key: bytes, stream_id: str, total_bytes: int, chunk_bytes: int, first_index: int = 0, offset: int = 0
    ):
        """``total_bytes``: the whole payload's length; ``offset``: where this (resumed) stream starts
        in it, at chunk ``first_index``."""
        if len(key) != 32:
            raise EnvelopeError(400, "stream key must be 32 bytes")
        self.total_bytes, self.chunk_bytes = total_bytes, chunk_bytes
        self._aead, self._id = AESGCM(key), stream_id
        self._index, self._seen, self._final = first_index, offset, False

    @property
    def max_frame(self) -> int:
        """The largest frame body this stream may carry (one chunk, its flags byte and tag)."""
        return self.chunk_bytes + 1 + TAG_BYTES

    @property
    def received(self) -> int:
        """Payload bytes up to the end of the last chunk opened (the offset to resume from)."""
        return self._seen

    def aborted(self, body: bytes | memoryview) -> str | None:
        """The sender's reason if ``body`` is its abort frame (checked like a chunk: its key, the
        next index), None for a chunk frame."""
        if not len(body) or body[0] != ABORT:
            return None
        if self._final:
            raise EnvelopeError(400, "stream has data after its final chunk")
        try:
            text = self._aead.decrypt(_nonce(self._index), memoryview(body)[1:], _aad(self._id, self._index, ABORT))
        except InvalidTag as exc:
            raise self._bad_tag() from exc
        self._final = True
        return text.decode(errors="replace")

    def _flags(self, body: bytes | memoryview) -> int:
        if self._final:
            raise EnvelopeError(400, "stream has data after its final chunk")
        if len(body) < 1 + TAG_BYTES or body[0] not in (0, _FINAL):
            raise EnvelopeError(400, f"malformed stream chunk {self._index}")
        if len(body) - 1 - TAG_BYTES > self.chunk_bytes:
            raise EnvelopeError(400, "stream chunk is longer than the announced chunk size")
        if self._seen + len(body) - 1 - TAG_BYTES > self.total_bytes:
            raise EnvelopeError(400, "stream is longer than its announced length")
        return body[0]

    def _opened(self, plain: bytes | memoryview, flags: int) -> bool:
        self._seen += len(plain)
        self._index += 1
        self._final = bool(flags & _FINAL)
        return self._final

    def open(self, body: bytes | memoryview) -> tuple[bytes, bool]:
        """The next chunk's plaintext and whether it was the last; refuses anything out of order."""
        flags = self._flags(body)
        try:
            plain = self._aead.decrypt(_nonce(self._index), memoryview(body)[1:], _aad(self._id, self._index, flags))
        except InvalidTag as exc:
            raise self._bad_tag() from exc
        return plain, self._opened(plain, flags)

    def open_into(self, body: bytes | memoryview, out: bytearray | mmap.mmap) -> tuple[memoryview, bool]:
        """:meth:`open` into a reused buffer of at least ``chunk_bytes`` bytes: the plaintext is a
        view of ``out``, valid until the next call."""
        flags = self._flags(body)
        plain = memoryview(out)[: len(body) - 1 - TAG_BYTES]
        try:
            self._aead.decrypt_into(
                _nonce(self._index), memoryview(body)[1:], _aad(self._id, self._index, flags), plain
            )
        except InvalidTag as exc:
            raise self._bad_tag() from exc
        return plain, self._opened(plain, flags)

    def _bad_tag(self) -> EnvelopeError:
        return EnvelopeError(
            422, f"stream chunk {self._index} does not decrypt (tampered, reordered or from another stream)"
        )

    def finish(self) -> None:
        if not self._final:
            raise EnvelopeError(400, f"stream truncated: ended after chunk {self._index - 1} without a final chunk")
        if self._seen != self.total_bytes:
            raise EnvelopeError(400, f"stream carried {self._seen} bytes, its opening announced {self.total_bytes}")
