"""Transports: UDP datagrams, and UDP plus shared-memory rings for large payloads on one host.

Both implement the same ``Transport`` protocol, so every node and the worker client run on
either. ``send`` takes one buffer or a sequence of buffers (header + payload, sent with one
scatter-gather call, no concatenation copy). ``recv`` returns a buffer that stays valid until
the next ``recv`` (for shared memory it is a view into the sender's ring; consumers copy what
they keep).

``UdpTransport``: a bound UDP socket; a datagram is at most 64 KiB.

``ShmTransport``: the same UDP socket carries control traffic and small packets; a packet larger
than ``inline_limit`` is written into a ring of shared memory owned by the sender (one ring per
destination, a ``memfd``: nothing to leak in /dev/shm if a process is killed) and only a small
descriptor datagram (ring id, position, length) goes over the socket. The descriptor is also the
wake-up: the receiver blocks in ``select`` on its socket, no thread spins. The receiver maps the
ring through ``/proc/<pid>/fd/<fd>`` (same host, same user), and frees the space by publishing
how far it has consumed; a descriptor for space already freed (a reordered or duplicated one) is
dropped like a lost datagram. A ring that stays full (the receiver is gone or stuck) drops the
packet after ``full_wait`` seconds, counted in ``ring_full_drops``: the protocol's timers recover.
Every transport understands descriptors, so a UDP-only node can receive from a shared-memory one.

Fault injection: seeded, per link (this socket -> one destination), applied on the sending side
with its own ``random.Random`` seeded from (seed, node name, destination), so a run with the same
seed and packet order injects the same faults. Reordering holds a packet back for a few
milliseconds so that later packets overtake it; delay holds it for a random time. Held packets are
released by ``recv`` (every node loop calls it), never by a background thread. It applies to both
transports (on shared memory it acts on the whole packet, before the ring).
"""

from __future__ import annotations

import heapq
import itertools
import mmap
import os
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union

Address = tuple[str, int]
Buffer = Union[bytes, bytearray, memoryview]
Packet = Union[Buffer, Sequence[Buffer]]

UDP_MAX_DATAGRAM = 65507  # largest UDP payload over IPv4
TRANSPORTS = ("udp", "shm")
SHM_RING_BYTES = 32 << 20  # per link (sender -> one destination), mapped up front
SHM_MAX_ELEMENTS = (SHM_RING_BYTES // 4 - 64) // 4  # float32 per packet: a quarter of a ring

# descriptor of a packet in a shared-memory ring: magic, pid, fd, ring id, position, length
_DESC = struct.Struct("!BIIQQI")
_DESC_MAGIC = 0xA7  # never a valid protocol version byte
_RING_HEADER = 64  # bytes before the data: ring id (u64), consumed position (u64)
_RING_META = struct.Struct("=QQ")


@dataclass(frozen=True)
class FaultPlan:
    """Probabilities per packet, applied independently on each link."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.01
    seed: int = 0

    @property
    def active(self) -> bool:
        return any(p > 0 for p in (self.drop, self.duplicate, self.reorder, self.delay))


@dataclass
class TransportCounters:
    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    delayed: int = 0
    shm_sent: int = 0
    shm_received: int = 0
    stale_descriptors: int = 0
    ring_full_drops: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Transport(Protocol):
    """What every node needs from the network."""

    address: Address
    counters: TransportCounters
    receive_buffer: int  # bytes a peer may have in flight towards this node
    max_packet: int  # largest packet (header + payload) ``send`` accepts

    def send(self, data: Packet, addr: Address, *, control: bool = False) -> None: ...
    def prepare(self, addr: Address) -> None: ...
    def recv(self, timeout: float) -> tuple[Buffer, Address] | None: ...
    def close(self) -> None: ...


@dataclass(order=True)
class _Held:
    due: float
    order: int
    data: bytes = field(compare=False)
    addr: Address = field(compare=False)


def _parts(data: Packet) -> list[Buffer]:
    return [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)


def _size(parts: list[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def _map(fd: int, size: int) -> mmap.mmap:
    """Shared mapping with every page faulted in up front: touching fresh shared-memory pages
    one by one costs more than the copies themselves (measured ~14 ms per MiB on first use)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


class _Ring:
    """Producer side of one link's ring: a memfd mapped here, written only by this process."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.fd = os.memfd_create("trainmaster-aggregation-ring")
        os.ftruncate(self.fd, _RING_HEADER + capacity)
        self.map = _map(self.fd, _RING_HEADER + capacity)
        self.id = random.getrandbits(63)
        _RING_META.pack_into(self.map, 0, self.id, 0)
        self.head = 0  # total bytes ever reserved (monotonic position)

    def consumed(self) -> int:
        return _RING_META.unpack_from(self.map, 0)[1]

    def reserve(self, n: int) -> int | None:
        """Position for ``n`` contiguous bytes, or None while the consumer has not freed room."""
        pos = self.head
        off = pos % self.capacity
        if off + n > self.capacity:  # never split a packet: skip to the start of the ring
            pos += self.capacity - off
        if pos + n - self.consumed() > self.capacity:
            return None
        self.head = pos + n
        return pos

    def write(self, pos: int, parts: list[Buffer]) -> None:
        at = _RING_HEADER + pos % self.capacity
        for p in parts:
            n = memoryview(p).nbytes
            byte_view = p if isinstance(p, (bytes, bytearray)) else memoryview(p).cast("B")
            self.map[at:at + n] = byte_view
            at += n

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _RingView:
    """Consumer side of a peer's ring, mapped through /proc/<pid>/fd/<fd>."""

    def __init__(self, pid: int, fd: int):
        with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
            self.map = _map(f.fileno(), os.fstat(f.fileno()).st_size)
        self.capacity = len(self.map) - _RING_HEADER
        self.id = _RING_META.unpack_from(self.map, 0)[0]
        self.view = memoryview(self.map)

    def consumed(self) -> int:
        return _RING_META.unpack_from(self.map, 0)[1]

    def release(self, upto: int) -> None:
        if upto > self.consumed():
            struct.pack_into("=Q", self.map, 8, upto)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process


class UdpTransport:
    """A bound UDP socket; ``send`` injects the plan's faults, ``recv`` waits with a timeout."""

    kind = "udp"

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0,
                 faults: FaultPlan | None = None, buffer_bytes: int = 8 << 20):
        self.name = name
        self.faults = faults or FaultPlan()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass
        self.sock.bind((host, port))
        self.sock.setblocking(False)
        self.address: Address = self.sock.getsockname()
        self.receive_buffer = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.max_packet = UDP_MAX_DATAGRAM
        self.counters = TransportCounters()
        self._links: dict[Address, random.Random] = {}
        self._held: list[_Held] = []
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._views: dict[tuple[int, int], _RingView] = {}
        self._release: tuple[_RingView, int] | None = None

    def _rng(self, addr: Address) -> random.Random:
        rng = self._links.get(addr)
        if rng is None:
            rng = random.Random(f"{self.faults.seed}|{self.name}|{addr[0]}:{addr[1]}")
            self._links[addr] = rng
        return rng

    def prepare(self, addr: Address) -> None:
        """Set up what sending to ``addr`` needs before the first packet (nothing for UDP)."""

    def send(self, data: Packet, addr: Address, *, control: bool = False) -> None:
        """Send one packet; control messages (stats, shutdown) bypass fault injection."""
        parts = _parts(data)
        size = _size(parts)
        if size > self.max_packet:
            raise ValueError(f"packet of {size} bytes exceeds this transport's limit of "
                             f"{self.max_packet} bytes")
        with self._lock:
            self.counters.sent += 1
            self.counters.bytes_sent += size
            plan = self.faults
            if control or not plan.active:
                self._emit(parts, size, addr)
                return
            rng = self._rng(addr)
            if rng.random() < plan.drop:
                self.counters.dropped += 1
                return
            copies = 1
            if rng.random() < plan.duplicate:
                self.counters.duplicated += 1
                copies = 2
            now = time.monotonic()
            for _ in range(copies):
                if rng.random() < plan.reorder:
                    self.counters.reordered += 1
                    self._hold(now + rng.uniform(0.001, 0.004), parts, addr)
                elif rng.random() < plan.delay:
                    self.counters.delayed += 1
                    self._hold(now + rng.uniform(0.0, plan.delay_s), parts, addr)
                else:
                    self._emit(parts, size, addr)

    def _hold(self, due: float, parts: list[Buffer], addr: Address) -> None:
        # a held packet must own its bytes: the caller's buffers may change after send returns
        heapq.heappush(self._held, _Held(due, next(self._order), b"".join(parts), addr))

    def _emit(self, parts: list[Buffer], size: int, addr: Address) -> None:
        self._sendmsg(parts, addr)

    def _sendmsg(self, parts: list[Buffer], addr: Address) -> None:
        try:
            self.sock.sendmsg(parts, (), 0, addr)
        except BlockingIOError:
            # the kernel's send buffer is full: wait for room rather than lose the packet here
            select.select([], [self.sock], [], 1.0)
            try:
                self.sock.sendmsg(parts, (), 0, addr)
            except OSError:
                pass  # the network lost it; the protocol's timers recover
        except OSError:
            pass  # e.g. ECONNREFUSED from a peer that went away: a loss like any other

    def _release_due(self) -> float | None:
        """Send held packets whose time has come; return seconds until the next one."""
        with self._lock:
            now = time.monotonic()
            while self._held and self._held[0].due <= now:
                held = heapq.heappop(self._held)
                self._emit([held.data], len(held.data), held.addr)
            return self._held[0].due - now if self._held else None

    def _resolve(self, data: bytes) -> memoryview | None:
        """The packet a shared-memory descriptor points at, or None if it is gone."""
        _, pid, fd, ring_id, pos, n = _DESC.unpack(data)
        view = self._views.get((pid, fd))
        if view is None or view.id != ring_id:
            try:
                view = _RingView(pid, fd)
            except (OSError, ValueError):
                return None  # the sender exited: its ring went with it
            if view.id != ring_id:
                view.close()
                return None
            self._views[(pid, fd)] = view
        if n == 0:
            return None  # an announcement: the ring is mapped now, nothing to deliver
        if pos < view.consumed():
            self.counters.stale_descriptors += 1  # duplicate or late: that space was reused
            return None
        off = _RING_HEADER + pos % view.capacity
        self._release = (view, pos + n)
        self.counters.shm_received += 1
        return view.view[off:off + n]

    def recv(self, timeout: float) -> tuple[Buffer, Address] | None:
        """Next packet, or None after ``timeout`` seconds; releases held packets meanwhile.

        The returned buffer is valid until the next call."""
        if self._release is not None:
            view, upto = self._release
            self._release = None
            view.release(upto)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                data, addr = self.sock.recvfrom(65535)
                self.counters.received += 1
                if len(data) == _DESC.size and data[0] == _DESC_MAGIC:
                    packet = self._resolve(data)
                    if packet is not None:
                        return packet, addr
                else:
                    return data, addr
            except BlockingIOError:
                pass
            except OSError:
                pass  # ICMP errors surfaced on the socket: ignore, timers recover
            next_held = self._release_due()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            wait = remaining if next_held is None else min(remaining, max(next_held, 0.0))
            select.select([self.sock], [], [], wait)

    def close(self) -> None:
        self._release = None
        for view in self._views.values():
            view.close()
        self._views.clear()
        self.sock.close()


class ShmTransport(UdpTransport):
    """UDP for control and small packets, a shared-memory ring per destination for large ones."""

    kind = "shm"

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0,
                 faults: FaultPlan | None = None, ring_bytes: int = SHM_RING_BYTES,
                 inline_limit: int = 8192, full_wait: float = 0.25):
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("the shared-memory transport needs Linux (memfd_create)")
        super().__init__(name, host, port, faults)
        self.ring_bytes = ring_bytes
        self.inline_limit = inline_limit
        self.full_wait = full_wait
        self.receive_buffer = ring_bytes
        self.max_packet = ring_bytes // 4
        self._rings: dict[Address, _Ring] = {}

    def prepare(self, addr: Address) -> None:
        """Create the ring towards ``addr`` and have the receiver map it now: mapping a ring
        takes tens of milliseconds, which inside the first reduction looks like a loss."""
        with self._lock:
            self._ring(addr)

    def _ring(self, addr: Address) -> _Ring:
        ring = self._rings.get(addr)
        if ring is None:
            ring = self._rings[addr] = _Ring(self.ring_bytes)
            self._sendmsg([_DESC.pack(_DESC_MAGIC, os.getpid(), ring.fd, ring.id, 0, 0)], addr)
        return ring

    def _emit(self, parts: list[Buffer], size: int, addr: Address) -> None:
        if size <= self.inline_limit:
            self._sendmsg(parts, addr)
            return
        ring = self._ring(addr)
        pos = ring.reserve(size)
        if pos is None:
            # the receiver has not consumed enough yet: wait with a growing sleep, bounded
            deadline = time.monotonic() + self.full_wait
            pause = 0.0005
            while pos is None and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
                pos = ring.reserve(size)
            if pos is None:
                self.counters.ring_full_drops += 1
                return
        ring.write(pos, parts)
        self.counters.shm_sent += 1
        self._sendmsg([_DESC.pack(_DESC_MAGIC, os.getpid(), ring.fd, ring.id, pos, size)], addr)

    def close(self) -> None:
        super().close()
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()


def make_transport(kind: str, name: str, host: str = "127.0.0.1", port: int = 0,
                   faults: FaultPlan | None = None) -> UdpTransport:
    """The transport called ``kind`` ("udp" or "shm")."""
    if kind == "udp":
        return UdpTransport(name, host, port, faults)
    if kind == "shm":
        return ShmTransport(name, host, port, faults)
    raise ValueError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
