"""Packets larger than the path's MTU: cut into datagrams, sent with UDP segmentation offload,
received with UDP receive offload, put back together without a copy per datagram in Python.

A packet that does not fit one datagram of the path (MTU minus 28 bytes of IP and UDP
headers) is cut into *segments*: each is a datagram of its own, a 16-byte segment header
(``_SEG``: magic, index, count, bytes per segment, message id, packet length) and a piece of
the packet. Every segment names its packet, so one that arrives alone can be placed.

Sending (``Segmenter``): the segments are laid out in one staging buffer, every datagram
``stride`` bytes apart (the last may be shorter), with a few vectorised copies, and handed to the
kernel with one ``sendmsg`` per 64 KiB carrying a ``UDP_SEGMENT`` control message (GSO): the
kernel (or the NIC) cuts the buffer into the datagrams at ``stride``. The same payload sent to
several destinations (a forwarding node's multicast) is laid out once; only the first segment,
which holds the protocol header, is rewritten per copy.

Receiving (``Reassembler``): the socket has ``UDP_GRO`` on, so a run of datagrams of one flow
can arrive as one buffer whose control message gives the datagram size. When such a buffer holds
exactly one packet's segments in order (the common case: on a veth or loopback the GSO buffer
travels whole, and a NIC's GRO coalesces back-to-back datagrams) the packet comes out with one
strided copy into a buffer from a pool. Anything else (single datagrams, segments out of order,
duplicates, several packets in one buffer, a lost segment) goes through a table of partial
packets, segment by segment: a lost segment leaves its packet incomplete (the protocol's
retransmission recovers it, as with a lost datagram) and the oldest partials are dropped when
the table is full.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

SOL_UDP = 17
UDP_SEGMENT = 103  # setsockopt / cmsg: the GSO segment size of a send
UDP_GRO = 104  # setsockopt: deliver coalesced datagrams; cmsg: their segment size
UDP_MAX_DATAGRAM = 65507  # largest UDP payload over IPv4: also the most one GSO send may carry
GSO_MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS
SEG_MAGIC = 0xA8  # never a protocol version byte, nor a shared-memory descriptor's magic
_SEG = struct.Struct("!BxHHHII")  # magic, (pad), index, count, piece size, message id, packet length
SEG_HEADER = _SEG.size
# a segment header as two big-endian 64-bit words: (magic, pad, index, count, size) and
# (message id, packet length). Within one packet the second word is the same in every
# segment and the first grows by 1 << 32 from one segment to the next: checked and written
# for a whole run of segments with two vectorised operations
_STEP = np.arange(1 << 16, dtype=np.uint64) << np.uint64(32)
_U64 = np.dtype(">u8")
# the same steps as (first word, second word) pairs: a run's headers, less its first one, must
# equal the first rows of this, checked in one comparison (``Reassembler._run``)
_STEP_PAIRS = np.stack([_STEP, np.zeros_like(_STEP)], axis=1)
_UINT8 = np.dtype(np.uint8)
MAX_PARTIALS = 256  # packets being put together at once, per socket
RECENT = 4096  # packets put together lately: a late duplicate of one of their segments is ignored
MAX_PARTIAL_BYTES = 64 << 20


def segment_cmsg(stride: int) -> list[tuple[int, int, bytes]]:
    return [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", stride))]


def _bytes(part: Any) -> np.ndarray:
    return np.frombuffer(part, np.uint8)


@dataclass
class SegmentCounters:
    packets_segmented: int = 0  # packets sent as several datagrams
    segments_sent: int = 0
    gso_sends: int = 0  # sendmsg calls that carried several datagrams
    segments_received: int = 0
    gro_batches: int = 0  # receives that delivered several datagrams at once
    reassembled: int = 0  # packets put back together
    reassembled_whole: int = 0  # ... of which from one receive, in one copy
    segment_duplicates: int = 0
    segments_malformed: int = 0
    partials_dropped: int = 0  # incomplete packets dropped (a segment was lost)


class Segmenter:
    """The sending side: lays a packet out as segments in a staging buffer (see the module
    docstring); ``send(sock, addr, ...)`` hands them to the kernel."""

    def __init__(self, counters: SegmentCounters):
        self.counters = counters
        self._stage = bytearray(0)
        self._msg = 0
        self._key: tuple[int, int, int] | None = None
        self._body: Any = None  # the payload laid out last (kept: its identity is the key)
        self._length = 0

    def layout(self, parts: list[Any], size: int, stride: int) -> int:
        """Lay ``parts`` (one packet of ``size`` bytes) out as segments of ``stride`` bytes;
        returns the number of segments. A packet whose payload (its last part) is the very
        object laid out last, at the same sizes, only has its other parts rewritten."""
        piece = stride - SEG_HEADER
        count = -(-size // piece)
        if count > 0xFFFF:
            raise ValueError(f"a packet of {size} bytes needs more than 65535 segments of {piece} bytes")
        length = (count - 1) * stride + SEG_HEADER + size - (count - 1) * piece
        if len(self._stage) < length:
            self._stage = bytearray(max(length, 2 * len(self._stage)))
            self._key = None
        stage = np.frombuffer(self._stage, np.uint8)
        key = (stride, size, len(parts))
        same = len(parts) > 1 and key == self._key and parts[-1] is self._body
        pos = 0
        for i, part in enumerate(parts):
            src = _bytes(part)
            if not same or i < len(parts) - 1:
                _scatter(stage, stride, piece, src, pos)
            pos += src.size
        if not same:
            first = np.ndarray((count,), _U64, buffer=self._stage, strides=(stride,))
            np.add(_STEP[:count], (SEG_MAGIC << 56) | (count << 16) | piece, out=first, casting="unsafe")
        self._key, self._body, self._length = key, parts[-1], length
        self._msg = (self._msg + 1) & 0xFFFFFFFF
        # the message id of every segment: a fresh one per packet sent, so that a receiver
        # never mixes two sends of the same payload
        second = np.ndarray((count,), _U64, buffer=self._stage, offset=8, strides=(stride,))
        second[...] = self._msg << 32 | size
        self.counters.packets_segmented += 1
        self.counters.segments_sent += count
        return count

    def batches(self, count: int, stride: int) -> list[tuple[memoryview, bool]]:
        """The staged segments as (buffer, several datagrams?) per send: at most
        ``GSO_MAX_SEGMENTS`` and 64 KiB each."""
        per = max(1, min(GSO_MAX_SEGMENTS, UDP_MAX_DATAGRAM // stride))
        view = memoryview(self._stage)
        out = []
        for first in range(0, count, per):
            last = min(count, first + per)
            stop = self._length if last == count else last * stride
            out.append((view[first * stride : stop], last - first > 1))
        return out

    def segment(self, index: int, stride: int, count: int) -> memoryview:
        """One staged segment (to send it alone, e.g. with faults injected per datagram)."""
        stop = self._length if index == count - 1 else (index + 1) * stride
        return memoryview(self._stage)[index * stride : stop]


def _scatter(stage: np.ndarray, stride: int, piece: int, src: np.ndarray, pos: int) -> None:
    """Copy ``src`` to stream position ``pos`` of the segment layout: a partial first row, a
    block of whole rows (one strided copy), a partial last row."""
    n, i = src.size, 0
    row, col = divmod(pos, piece)
    if col:
        take = min(piece - col, n)
        at = row * stride + SEG_HEADER + col
        stage[at : at + take] = src[:take]
        i, row = take, row + 1
    whole = (n - i) // piece
    if whole:
        rows = stage[row * stride : (row + whole) * stride].reshape(whole, stride)
        rows[:, SEG_HEADER:] = src[i : i + whole * piece].reshape(whole, piece)
        i, row = i + whole * piece, row + whole
    if i < n:
        at = row * stride + SEG_HEADER
        stage[at : at + n - i] = src[i:]


@dataclass
class _Partial:
    buffer: bytearray
    total: int
    piece: int
    count: int
    got: int = 0  # bitmap of the segments in


class Reassembler:
    """The receiving side: segments in, whole packets out (``ready``: (view, sender, buffer)).

    Packets are put together in buffers from a pool (by size class), handed back with
    ``give_back`` once the packet is no longer read (``UdpTransport`` does so at the next
    ``recv`` unless the packet was retained)."""

    def __init__(self, counters: SegmentCounters, max_packet: int):
        self.counters = counters
        self.max_packet = max_packet
        self.ready: deque[tuple[memoryview, Any, bytearray]] = deque()
        self._partials: dict[tuple[Any, int], _Partial] = {}
        self._partial_bytes = 0
        self._done: dict[tuple[Any, int], None] = {}  # insertion-ordered, at most RECENT
        self._pool: dict[int, list[bytearray]] = {}

    # ---- buffers ----------------------------------------------------------------------
    def take(self, size: int) -> bytearray:
        cls = max(1 << 16, 1 << (size - 1).bit_length())
        free = self._pool.get(cls)
        return free.pop() if free else bytearray(cls)

    def give_back(self, buffer: bytearray) -> None:
        self._pool.setdefault(len(buffer), []).append(buffer)

    # ---- receiving ----------------------------------------------------------------------
    def feed(self, data: bytearray, n: int, stride: int, sender: Any) -> None:
        """``n`` bytes of ``data`` hold datagrams ``stride`` bytes apart (one datagram when
        ``stride >= n``), each of them a segment; complete packets go to ``ready``."""
        count = -(-n // stride) if stride < n else 1
        if count > 1:
            self.counters.gro_batches += 1
            if self._run(data, n, stride, count, sender):
                return
        for i in range(count):
            start = i * stride
            self._segment(data, start, min(n, start + stride), sender)

    def _run(self, data: bytearray, n: int, stride: int, count: int, sender: Any) -> bool:
        """The fast path: the buffer is a run of consecutive segments of one packet (all of
        them, or those one GSO send carried), placed with one strided copy. False: anything
        else, left to the segment-by-segment path."""
        magic, start, parts, piece, msg, total = _SEG.unpack_from(data, 0)
        last = n - (count - 1) * stride - SEG_HEADER  # bytes of the run's last piece
        if (
            magic != SEG_MAGIC
            or piece != stride - SEG_HEADER
            or not 0 < total <= self.max_packet
            or parts != -(-total // piece)
            or start + count > parts
            or last != (piece if start + count < parts else total - (parts - 1) * piece)
        ):
            return False
        # every segment header of the run, as (first word, second word): consecutive indices
        # of one packet's shape, one message (see _STEP); one comparison for the whole run
        heads = np.ndarray((count, 2), _U64, data, 0, (stride, 8))
        if not (heads - heads[0] == _STEP_PAIRS[:count]).all():
            return False
        whole = count == parts
        key = (sender, msg)
        if key in self._done:
            return False  # duplicates: counted segment by segment
        partial = None if whole else self._partials.get(key)
        mask = ((1 << count) - 1) << start
        if partial is not None and (partial.total != total or partial.piece != piece or partial.got & mask):
            return False  # duplicates or an inconsistent packet: segment by segment
        if partial is None:
            buffer = self.take(total)
            if not whole:
                self._make_room(total)
                partial = self._partials[key] = _Partial(buffer, total, piece, parts)
                self._partial_bytes += total
        else:
            buffer = partial.buffer
        # the run's pieces but the last: one strided copy, views made straight from the buffers
        at, full = start * piece, count - 1
        np.copyto(
            np.ndarray((full, piece), _UINT8, buffer, at, (piece, 1)),
            np.ndarray((full, piece), _UINT8, data, SEG_HEADER, (stride, 1)),
        )
        at += full * piece
        memoryview(buffer)[at : at + last] = memoryview(data)[full * stride + SEG_HEADER : n]
        self.counters.segments_received += count
        if partial is not None:
            partial.got |= mask
            if partial.got != (1 << parts) - 1:
                return True
            del self._partials[key]
            self._partial_bytes -= total
        self._completed(key)
        self.counters.reassembled_whole += int(whole)
        self.ready.append((memoryview(buffer)[:total], sender, buffer))
        return True

    def _completed(self, key: tuple[Any, int]) -> None:
        self.counters.reassembled += 1
        self._done[key] = None
        if len(self._done) > RECENT:
            del self._done[next(iter(self._done))]

    def _segment(self, data: bytearray, start: int, stop: int, sender: Any) -> None:
        """One segment, placed into its packet's partial buffer."""
        self.counters.segments_received += 1
        if stop - start <= SEG_HEADER:
            self.counters.segments_malformed += 1
            return
        magic, index, count, piece, msg, total = _SEG.unpack_from(data, start)
        size = stop - start - SEG_HEADER
        if (
            magic != SEG_MAGIC
            or not 0 < total <= self.max_packet
            or piece == 0
            or count != -(-total // piece)
            or index >= count
            or size != (piece if index < count - 1 else total - (count - 1) * piece)
        ):
            self.counters.segments_malformed += 1
            return
        key = (sender, msg)
        if key in self._done:
            self.counters.segment_duplicates += 1
            return
        partial = self._partials.get(key)
        if partial is None:
            self._make_room(total)
            partial = self._partials[key] = _Partial(self.take(total), total, piece, count)
            self._partial_bytes += total
        elif partial.total != total or partial.piece != piece:
            self.counters.segments_malformed += 1
            return
        bit = 1 << index
        if partial.got & bit:
            self.counters.segment_duplicates += 1
            return
        at = index * piece
        partial.buffer[at : at + size] = memoryview(data)[start + SEG_HEADER : stop]
        partial.got |= bit
        if partial.got == (1 << count) - 1:
            del self._partials[key]
            self._partial_bytes -= total
            self._completed(key)
            self.ready.append((memoryview(partial.buffer)[:total], sender, partial.buffer))

    def _make_room(self, total: int) -> None:
        """Drop the oldest partial packets (a segment of each was lost, or is very late)."""
        while self._partials and (
            len(self._partials) >= MAX_PARTIALS or self._partial_bytes + total > MAX_PARTIAL_BYTES
        ):
            key = next(iter(self._partials))
            partial = self._partials.pop(key)
            self._partial_bytes -= partial.total
            self.give_back(partial.buffer)
            self.counters.partials_dropped += 1
