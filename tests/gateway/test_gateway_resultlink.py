"""The initiator's result-stream download (`resultlink.py`): HTTP/1.1 chunked bodies decoded straight
into the caller's buffers, and the frame loop on top of it, over a socket that hands out the bytes in
arbitrary pieces (as TLS records and TCP segments do)."""

from __future__ import annotations

import hashlib
import io
import os
import random

import pytest


from trainmaster.gateway.initiator.client import _receive_frames
from trainmaster.gateway.crypto.envelope import EnvelopeError, b64e
from trainmaster.gateway.initiator.resultlink import ResultLinkError, _parse_head, _Socket
from trainmaster.gateway.crypto.chunks import ChunkOpener, ChunkSealer, StreamInfo, frame

SID = "ab" * 16


class PieceSocket:
    """Stands in for the TLS socket: ``recv_into`` returns at most a random few bytes at a time."""

    def __init__(self, data: bytes, seed: int = 0, most: int = 7000):
        self._data, self._at, self._rng, self._most = data, 0, random.Random(seed), most

    def recv_into(self, view: memoryview) -> int:
        n = min(len(view), len(self._data) - self._at, self._rng.randint(1, self._most))
        view[:n] = self._data[self._at : self._at + n]
        self._at += n
        return n


def _chunked(body: bytes, seed: int = 1) -> bytes:
    rng, out, at = random.Random(seed), [], 0
    while at < len(body):
        n = rng.randint(1, 50_000)
        out.append(b"%x\r\n" % len(body[at : at + n]) + body[at : at + n] + b"\r\n")
        at += n
    return b"".join(out) + b"0\r\n\r\n"


def _response(body: bytes, chunked: bool = True) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.trainmaster.stream\r\n"
    if chunked:
        return head + b"transfer-encoding: chunked\r\n\r\n" + _chunked(body)
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def _stream(data: bytes, chunk: int = 10_000) -> tuple[StreamInfo, bytes]:
    key = os.urandom(32)
    info = StreamInfo(
        key=b64e(key), total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), chunk_bytes=chunk, stream_id=SID
    )
    sealer = ChunkSealer(key, SID)
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    return info, b"".join(frame(sealer.seal(p, i == len(pieces) - 1)) for i, p in enumerate(pieces))


def _receive(raw: bytes, info: StreamInfo, seed: int = 0) -> bytes:
    conn = _Socket(PieceSocket(raw, seed))  # type: ignore[arg-type]
    resp = _parse_head(conn.read_until(b"\r\n\r\n"), conn)
    out = io.BytesIO()
    opener = ChunkOpener(info, SID, 1 << 30)
    _receive_frames(resp.body, opener, out)
    opener.finish()
    return out.getvalue()


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_result_stream_decodes_whole_from_arbitrary_pieces(chunked: bool, seed: int) -> None:
    """Large payloads in chunks, initiator side: frames split across HTTP chunks, TLS records and
    reads at random arrive whole and equal, chunked or with a Content-Length."""
    data = os.urandom(123_457)
    info, frames = _stream(data)
    assert _receive(_response(frames, chunked), info, seed) == data


def test_result_stream_cut_or_garbled_is_refused() -> None:
    """A stream cut inside a frame, a chunk cut by the connection closing, a garbled chunk size line
    or a frame over the stream's chunk size are refused with a clear error, never a partial result."""
    data = os.urandom(50_000)
    info, frames = _stream(data)
    with pytest.raises(EnvelopeError, match="truncated inside a frame"):
        _receive(_response(frames[:-100]), info)
    with pytest.raises(EnvelopeError, match="without a final chunk"):
        _receive(_response(frames[: 4 + 1 + 16 + 10_000]), info)
    with pytest.raises(ResultLinkError, match="closed the connection"):
        _receive(_response(frames)[:-500], info)
    with pytest.raises(ResultLinkError, match="chunk size line"):
        _receive(_response(frames).replace(b"\r\n\r\n", b"\r\n\r\nzz", 1), info)
    big = ChunkSealer(os.urandom(32), SID).seal(b"x" * 20_000, True)
    with pytest.raises(EnvelopeError, match="over the stream"):
        _receive(_response(frame(big)), info)
