"""Wire format of the aggregation fabric: one fixed binary header (``struct``) plus a payload.

Every packet between workers, forwarding nodes and the parameter node is ``Header`` (network
byte order) followed by ``count`` little-endian elements (the hosts' native order: no byte
swapping on x86 or ARM): quantised integers (int32, or int16 / int8 when the ``INT16`` /
``INT8`` flag is set: low-bit aggregation), float32 values when the ``FLOAT`` flag is set (the
exception path), or UTF-8/JSON text for control messages. The header is 36 bytes, so a payload
that follows it is 4-byte aligned. A fixed header keeps per-packet
parsing to one ``struct.unpack`` and lets a hardware forwarding node find every field at a fixed
offset.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, replace
from typing import TypedDict, Unpack

import numpy as np

VERSION = 2
# version, kind, flags, job, round, seq, bitmap, fan_in, slot, exponent, count, peak, (pad)
_HEADER = struct.Struct("!BBHIIIQHHhIbx")
HEADER_SIZE = _HEADER.size
_BITMAP = struct.Struct("!Q")
_BITMAP_AT = 16  # offset of the bitmap in _HEADER
MAX_DATAGRAM = 65507  # largest UDP payload over IPv4
# float32 elements of the default UDP slice: one 64 KiB packet (the transport cuts it into
# datagrams that fit the path's MTU, see transport.py)
MAX_ELEMENTS = (MAX_DATAGRAM - HEADER_SIZE) // 4
MAX_WORKERS = 64  # the worker bitmap is 64 bits wide
INT_SATURATED = np.int64(2**31 - 1)  # the value a forwarding node writes when a sum overflows
# ``Header.peak`` when a slice carries no magnitude (all zero, or a control packet)
NO_PEAK = -128


class Kind(enum.IntEnum):
    """What a datagram is; 'up' travels worker -> parameter node, 'down' the other way."""

    DATA = 1  # up: a slice of gradient (first packet) or a partial sum of several workers
    RESULT = 2  # down: the verified sum of a slice (second packet)
    EXCEPTION = 3  # down: exception-retransmit instruction, resend this slice as floats
    HELLO = 4  # up: a worker joins a job; forwarding nodes learn routes from it
    WELCOME = 5  # down: every worker of the job has joined; carries the smallest slot pool
    HEARTBEAT = 6  # up: the worker is alive even when it is not reducing
    ABORT = 7  # down: the job failed (a worker died); payload is the reason, slots are freed
    STATS = 8  # request/reply: counters as JSON (control plane, never fault-injected)
    BYE = 9  # up: a worker leaves cleanly
    SHUTDOWN = 10  # control: stop the process serving this socket
    # down: the parameter node received control message ``seq`` (HEARTBEAT or BYE, named in
    # ``slot``) of the workers in ``bitmap``; control messages are retransmitted until acked
    ACK = 11
    # down: the workers in ``bitmap`` fell back to the parameter node; forwarding nodes on their
    # old route stop counting them (slots that now hold every remaining worker complete)
    MOVED = 12


class Flag(enum.IntFlag):
    """Header flags; names follow the spec's packet fields."""

    NONE = 0
    AGGREGATE_AT_PS = 1  # aggregate-at = 1: forwarding nodes only forward
    # sent again after a loss: DATA by a worker, or a RESULT the parameter node sends again to
    # the workers that asked (multicast.py: how a worker judges its group membership)
    RETRANSMIT = 2
    CONFLICT = 4  # the slot was held by another slice; the parameter node aggregated it
    OVERFLOW = 8  # the sum left the int32 range (values are saturated)
    VERIFIED = 16  # the parameter node checked completeness and overflow
    FLOAT = 32  # payload is float32 (exception retransmit)
    # the payload is a reference to the values in the parameter node's shared result store
    # (same host, shared-memory transport): forwarding nodes multicast the reference, each
    # worker reads the values in place; ``count`` is still the number of values
    SHARED = 64
    # the payload is int16 / int8 (low-bit aggregation; neither: int32). A worker's int8 slice
    # is summed into int16 by the nodes, so results of an int8 job carry INT16, unless the job
    # asked for int8 results: a RESULT with INT8 is a sum the parameter node re-quantised
    # (stochastic rounding, ``quantize.requantize_int8``), at the exponent in its header
    INT16 = 128
    INT8 = 256


class HeaderChanges(TypedDict, total=False):
    """The fields ``Header.with_`` may change (a forwarded packet's new bitmap, kind, flags...)."""

    kind: Kind
    job: int
    round: int
    seq: int
    bitmap: int
    fan_in: int
    slot: int
    exponent: int
    count: int
    flags: Flag
    peak: int


@dataclass(frozen=True, slots=True)
class Header:
    """``peak``: the slice's magnitude as a power of two (every value below ``2**peak``;
    ``NO_PEAK``: none). Workers put their own in DATA, nodes keep the largest, and the RESULT
    carries the largest of the job's workers: that is how the workers agree on the next
    round's shared scale without a round trip of their own (low-bit aggregation)."""

    kind: Kind
    job: int
    round: int = 0
    seq: int = 0
    bitmap: int = 0
    fan_in: int = 0
    slot: int = 0
    exponent: int = 0
    count: int = 0
    flags: Flag = Flag.NONE
    version: int = VERSION
    peak: int = NO_PEAK

    def has(self, flag: Flag) -> bool:
        # int's own ``&``: IntFlag's operator builds a new enum member per call (~2 us)
        return int.__and__(self.flags, flag) != 0

    def with_(self, **changes: Unpack[HeaderChanges]) -> Header:
        return replace(self, **changes)

    @property
    def key(self) -> tuple[int, int, int]:
        """The slice this packet belongs to: (job, round, seq)."""
        return (self.job, self.round, self.seq)


class ProtocolError(ValueError):
    """A datagram that is not a valid packet of this protocol version."""


def encode_parts(header: Header, payload: bytes | memoryview | np.ndarray = b"") -> list:
    """Header bytes and the payload as a byte view: what ``Transport.send`` takes, no copy of
    the payload (a numeric array is only converted when it is not already int32/float32)."""
    if isinstance(payload, np.ndarray):
        wire = np.ascontiguousarray(payload, dtype=payload_dtype(header.flags))
        body: bytes | memoryview = wire.data.cast("B")
        count = payload.size
    elif header.kind in (Kind.DATA, Kind.RESULT):
        body = payload  # an already-encoded numeric payload being forwarded
        count = header.count
    else:
        body = payload
        count = len(payload)
    head = bytearray(HEADER_SIZE)
    encode_header_into(memoryview(head), header, count)
    return [head, body]


def set_bitmap(head: bytearray, bitmap: int) -> None:
    """Rewrite the bitmap of an encoded header (``encode_parts``'s first part): a packet sent
    down once per next hop differs only there, so it is encoded once."""
    _BITMAP.pack_into(head, _BITMAP_AT, bitmap)


def encode_header_into(buffer: memoryview, header: Header, count: int) -> None:
    """Write the header at the start of ``buffer`` (a packet whose payload is built in place,
    see ``Transport.packet``)."""
    _HEADER.pack_into(
        buffer,
        0,
        header.version,
        int(header.kind),
        int(header.flags),
        header.job,
        header.round,
        header.seq,
        header.bitmap,
        header.fan_in,
        header.slot & 0xFFFF,
        header.exponent,
        count,
        header.peak,
    )


def encode(header: Header, payload: bytes | memoryview | np.ndarray = b"") -> bytes:
    """One datagram as bytes (control messages, tests); the data path uses ``encode_parts``."""
    return b"".join(encode_parts(header, payload))


_KINDS = {int(k): k for k in Kind}
_FLAGS = [Flag(i) for i in range(int(max(Flag)) * 2)]  # every combination, made once
_PAYLOAD_FLAGS = int(Flag.FLOAT | Flag.INT16 | Flag.INT8)
_DTYPES: dict[int, np.dtype] = {
    int(Flag.NONE): np.dtype("<i4"),
    int(Flag.FLOAT): np.dtype("<f4"),
    int(Flag.INT16): np.dtype("<i2"),
    int(Flag.INT8): np.dtype("i1"),
}


def payload_dtype(flags: Flag) -> np.dtype:
    """The element type of a numeric payload with these flags."""
    dtype = _DTYPES.get(int.__and__(flags, _PAYLOAD_FLAGS))
    if dtype is None:
        raise ProtocolError(f"flags {int(flags):#x} name more than one payload type")
    return dtype


def dtype_flag(dtype: np.dtype) -> Flag:
    """The flag that announces a payload of ``dtype`` (the reverse of ``payload_dtype``)."""
    for flag, known in _DTYPES.items():
        if known == dtype:
            return Flag(flag)
    raise ValueError(f"no payload type {dtype}")


def decode(datagram: bytes | bytearray | memoryview) -> tuple[Header, memoryview]:
    """Header and payload; the payload is a view of ``datagram`` (no copy of the values)."""
    if len(datagram) < HEADER_SIZE:
        raise ProtocolError(f"datagram of {len(datagram)} bytes is shorter than the header")
    version, kind, flags, job, rnd, seq, bitmap, fan_in, slot, exponent, count, peak = _HEADER.unpack_from(datagram)
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, expected {VERSION}")
    try:
        header = Header(
            _KINDS[kind], job, rnd, seq, bitmap, fan_in, slot, exponent, count, _FLAGS[flags], version, peak
        )
    except (KeyError, IndexError):
        raise ProtocolError(f"unknown packet kind {kind} or flags {flags:#x}") from None
    return header, memoryview(datagram)[HEADER_SIZE:]


def values(header: Header, body: bytes | memoryview) -> np.ndarray:
    """The numeric payload as a read-only view (int32, int16 or int8 by the flags, or float32
    with the FLOAT flag).

    No copy: the view lives as long as the received buffer, so whoever keeps values copies
    them (or retains the buffer, see ``Transport.retain``)."""
    dtype = payload_dtype(header.flags)
    if len(body) < dtype.itemsize * header.count:
        raise ProtocolError(f"payload of {len(body)} bytes, header says {header.count} elements of {dtype}")
    return np.frombuffer(body, dtype=dtype, count=header.count)


def peak_exponent(peak: float) -> int:
    """The smallest ``p`` with ``peak < 2**p`` (``NO_PEAK`` for 0), clamped to a signed byte."""
    if peak <= 0.0 or not math.isfinite(peak):
        return NO_PEAK
    return max(NO_PEAK + 1, min(127, math.frexp(peak)[1]))


def full_mask(fan_in: int) -> int:
    return (1 << fan_in) - 1


def bits(bitmap: int) -> list[int]:
    """Worker ranks present in a bitmap."""
    return [i for i in range(MAX_WORKERS) if bitmap >> i & 1]


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: every input bit flips about half of the output bits."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def slot_id(job: int, seq: int) -> int:
    """Resource id for a slice: the job id and the slice index hashed *together* (the spec).

    Every worker of a job computes the same id for the same slice. Hashing the pair (instead
    of the job's hashed offset plus the index, ``legacy_slot_id``) spreads one job's slices
    over the whole pool, so two tenants whose offsets happen to be close do not collide on a
    whole run of consecutive slots; the price is that a job's own window can now collide with
    itself (a conflict, aggregated by the parameter node, which returns an updated id).
    ``bench/aggregation_slots.py`` measures both rules with many tenants (docs/aggregation.md).
    """
    return _mix64((job & 0xFFFFFFFF) << 32 | (seq & 0xFFFFFFFF)) & 0xFFFF


def legacy_slot_id(job: int, seq: int) -> int:
    """The former rule, ``hash(job) + index``: kept only so the collision benchmark can
    compare both rules."""
    h = (job * 0x9E3779B1) & 0xFFFFFFFF
    h ^= h >> 15
    return (h + seq) & 0xFFFF
