"""Transports: UDP datagrams, and UDP plus shared-memory rings for large payloads on one host.

Both implement the same ``Transport`` protocol, so every node and the worker client run on
either. ``send`` takes one buffer or a sequence of buffers (header + payload, sent with one
scatter-gather call, no concatenation copy). ``recv`` returns a buffer that stays valid until
the next ``recv`` (for shared memory it is a view into the sender's ring; consumers copy what
they keep).

``UdpTransport``: a bound UDP socket. A packet larger than a datagram of the path to its
destination (its MTU less the IP and UDP headers) is cut into datagrams that fit, sent with UDP
segmentation offload and received with UDP receive offload (``segments.py``): one system call
per 64 KiB each way, and the packet put back together with a strided copy. A packet is at most
``UDP_MAX_PACKET`` bytes.

``ShmTransport``: the same UDP socket carries control traffic and small packets; a packet larger
than ``inline_limit`` is written into a ring of shared memory owned by the sender (one ring per
destination, a ``memfd``: nothing to leak in /dev/shm if a process is killed) and only a small
descriptor datagram (ring id, position, length) goes over the socket. The descriptor is also the
wake-up: the receiver blocks on its socket (``recv``), no thread spins. The receiver maps the
ring through ``/proc/<pid>/fd/<fd>`` (same host, same user), and frees the space by publishing
how far it has consumed; a descriptor for space already freed (a reordered or duplicated one) is
dropped like a lost datagram. A ring that stays full (the receiver is gone or stuck) drops the
packet after ``full_wait`` seconds, counted in ``ring_full_drops``: the protocol's timers recover.
Every transport understands descriptors, so a UDP-only node can receive from a shared-memory one.

Fewer copies on shared memory: ``packet`` reserves the next packet in the ring, so the sender
builds it where the receiver reads it; ``retain`` keeps a received packet's ring space from being
reused (the consumed position stops before it) until ``release``, so a node can sum packets
where they lie; ``share`` writes values once into a *result store* (a ``memfd`` of the sending
node) that any process of the host reads in place through a small reference (``shared``), with
``shared_intact`` telling the reader afterwards whether the space was reused meanwhile.

Fault injection: seeded, per link (this socket -> one destination), applied on the sending side
with its own ``random.Random`` seeded from (seed, node name, destination), so a run with the same
seed and packet order injects the same faults. Reordering holds a packet back for a few
milliseconds so that later packets overtake it; delay holds it for a random time. Held packets are
released by ``recv`` (every node loop calls it), never by a background thread. It applies to both
transports (on shared memory it acts on the whole packet, before the ring).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import mmap
import os
import random
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union, cast

from trainmaster.aggregation.segments import (
    SEG_HEADER,
    SEG_MAGIC,
    SOL_UDP,
    UDP_GRO,
    UDP_MAX_DATAGRAM,
    Reassembler,
    SegmentCounters,
    Segmenter,
    segment_cmsg,
)

Address = tuple[str, int]
Buffer = Union[bytes, bytearray, memoryview]
Packet = Union[Buffer, Sequence[Buffer]]

UDP_MAX_PACKET = 1 << 20  # largest packet over UDP: 16 segments of 64 KiB at most MTUs
# a receive buffer holds any datagram, and any run of them the kernel coalesces (64 KiB)
_RX_BUFFER = 1 << 17
_GRO_CMSG = socket.CMSG_SPACE(4)
_MSG_TRUNC = int(socket.MSG_TRUNC)  # a plain int: ``&`` with the enum member costs ~2 us
_DONTWAIT = int(socket.MSG_DONTWAIT)
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO's struct timeval
_IP_MTU = getattr(socket, "IP_MTU", 14)  # Linux: the path MTU of a connected socket
SOCKET_BUFFER = 32 << 20  # asked for; what the kernel grants is in ``receive_buffer``
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux values
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
TRANSPORTS = ("udp", "shm")
SHM_RING_BYTES = 32 << 20  # per link (sender -> one destination), mapped up front
SHM_MAX_ELEMENTS = (SHM_RING_BYTES // 4 - 64) // 4  # float32 per packet: a quarter of a ring

# descriptor of a packet in a shared-memory ring: magic, pid, fd, ring id, position, length
_DESC = struct.Struct("!BIIQQI")
_DESC_MAGIC = 0xA7  # never a valid protocol version byte
_RING_HEADER = 64  # bytes before the data: ring id (u64), consumed position (u64)
_RING_META = struct.Struct("=QQ")
# reference to bytes in a node's result store: pid, fd, store id, position, length
STORE_REF = struct.Struct("!IIQQI")
SHM_STORE_BYTES = 128 << 20  # per node that publishes results; pages are touched as used


@dataclass(frozen=True)
class FaultPlan:
    """Probabilities per packet, applied independently on each link, and a fixed latency."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.01
    seed: int = 0
    # apply the faults to each datagram of a packet cut into segments (its segments are then
    # sent one by one), not to the packet as a whole: what exercises the reassembly
    per_datagram: bool = False
    # a fixed one-way delay added to every packet this node sends (control messages too):
    # a longer link than the machine has, e.g. to give a job a bandwidth-delay product of
    # several slices on a testbed whose round trips are below a millisecond (tc netem is not
    # available everywhere; this needs nothing from the kernel). Packets keep their order.
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.latency_s <= 10.0:
            raise ValueError(f"latency_s must be between 0 and 10 seconds, got {self.latency_s}")

    @functools.cached_property
    def active(self) -> bool:
        return self.latency_s > 0 or any(p > 0 for p in (self.drop, self.duplicate, self.reorder, self.delay))


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
    segments: SegmentCounters = field(default_factory=SegmentCounters)

    def as_dict(self) -> dict[str, int]:
        out = {k: v for k, v in self.__dict__.items() if k != "segments"}
        return {**out, **self.segments.__dict__}


class Transport(Protocol):
    """What every node needs from the network."""

    address: Address
    counters: TransportCounters
    receive_buffer: int  # bytes a peer may have in flight towards this node
    max_packet: int  # largest packet (header + payload) ``send`` accepts

    def send(self, data: Packet, addr: Address, *, control: bool = False) -> None: ...
    def buffer_per_sender(self, senders: int) -> int: ...
    def packet(self, addr: Address, size: int) -> memoryview: ...
    def prepare(self, addr: Address) -> None: ...
    def recv(self, timeout: float) -> tuple[Buffer, Address] | None: ...
    def retain(self) -> object | None: ...
    def release(self, token: object | None) -> None: ...
    def share(self, size: int) -> tuple[memoryview, bytes] | None: ...
    def unshare(self, ref: bytes) -> None: ...
    def shared(self, ref: Buffer) -> memoryview | None: ...
    def shared_intact(self, ref: Buffer) -> bool: ...
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

    def view(self, pos: int, n: int) -> memoryview:
        return _region(self.map, self.capacity, pos, n)

    def write(self, pos: int, parts: list[Buffer]) -> None:
        at = _RING_HEADER + pos % self.capacity
        for p in parts:
            n = memoryview(p).nbytes
            byte_view = p if isinstance(p, (bytes, bytearray)) else memoryview(p).cast("B")
            self.map[at : at + n] = byte_view
            at += n

    def close(self) -> None:
        _close_map(self.map)
        os.close(self.fd)


def _region(m: mmap.mmap, capacity: int, pos: int, n: int) -> memoryview:
    """The ``n`` bytes at stream position ``pos`` of a ring or store mapping (after its header)."""
    at = _RING_HEADER + pos % capacity
    return memoryview(m)[at : at + n]


def _close_map(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # a caller still holds a view; the mapping goes with the process


class _Store:
    """Producer side of a result store: values written once and read in place by several
    processes (the verified sums every worker of a job reads, multicast as references).

    A memfd mapped without ``MAP_POPULATE`` (it is large; its pages are touched as they are
    used). Blocks are allocated in order and may be freed in any order; the oldest live block
    is the *tail*, published in the header: a reader accepts a reference only while its
    position is not behind the tail, before and after reading, because space behind the tail
    may be rewritten. When every block is free, allocation starts again at the beginning of
    the memory (positions stay monotonic, so old references stay recognisable as old): the
    same pages then serve every round."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.fd = os.memfd_create("trainmaster-aggregation-results")
        os.ftruncate(self.fd, _RING_HEADER + capacity)
        self.map = mmap.mmap(self.fd, _RING_HEADER + capacity, flags=mmap.MAP_SHARED)
        self.id = random.getrandbits(63)
        self.head = 0
        self.live: dict[int, int] = {}  # position -> length
        self.order: deque[int] = deque()
        _RING_META.pack_into(self.map, 0, self.id, 0)

    def alloc(self, n: int) -> int | None:
        """Position of ``n`` free contiguous bytes, or None while older blocks hold the space."""
        if not self.live:
            self.head = -(-self.head // self.capacity) * self.capacity
            self._publish_tail(self.head)
        pos = self.head
        off = pos % self.capacity
        if off + n > self.capacity:  # never split a block: skip to the start of the memory
            pos += self.capacity - off
        if pos + n - (self.order[0] if self.order else pos) > self.capacity:
            return None
        self.live[pos] = n
        self.order.append(pos)
        self.head = pos + n
        return pos

    def free(self, pos: int) -> None:
        self.live.pop(pos, None)
        while self.order and self.order[0] not in self.live:
            self.order.popleft()
        self._publish_tail(self.order[0] if self.order else self.head)

    def _publish_tail(self, tail: int) -> None:
        struct.pack_into("=Q", self.map, 8, tail)

    def view(self, pos: int, n: int) -> memoryview:
        return _region(self.map, self.capacity, pos, n)

    def close(self) -> None:
        _close_map(self.map)
        os.close(self.fd)


class _StoreView:
    """Reader side of a peer's result store, mapped through /proc/<pid>/fd/<fd>."""

    def __init__(self, pid: int, fd: int):
        with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        self.capacity = len(self.map) - _RING_HEADER
        self.id = _RING_META.unpack_from(self.map, 0)[0]

    def holds(self, pos: int) -> bool:
        """Whether the block at ``pos`` is still the one referenced (not behind the tail)."""
        return _RING_META.unpack_from(self.map, 0)[1] <= pos

    def view(self, pos: int, n: int) -> memoryview:
        return _region(self.map, self.capacity, pos, n)

    def close(self) -> None:
        _close_map(self.map)


class _RingView:
    """Consumer side of a peer's ring, mapped through /proc/<pid>/fd/<fd>.

    Space is freed in ring order: up to the end of the last packet delivered, but never past
    the oldest packet the consumer still retains (``UdpTransport.retain``)."""

    def __init__(self, pid: int, fd: int):
        with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
            self.map = _map(f.fileno(), os.fstat(f.fileno()).st_size)
        self.capacity = len(self.map) - _RING_HEADER
        self.id = _RING_META.unpack_from(self.map, 0)[0]
        self.view = memoryview(self.map)
        self.delivered = 0  # end of the newest packet handed out: anything before is old
        self.retained: set[int] = set()  # positions of packets the consumer still reads

    def publish(self) -> None:
        upto = min(self.retained) if self.retained else self.delivered
        if upto > _RING_META.unpack_from(self.map, 0)[1]:
            struct.pack_into("=Q", self.map, 8, upto)

    def close(self) -> None:
        self.view.release()
        _close_map(self.map)


def _size_buffers(sock: socket.socket, size: int) -> None:
    """Ask for ``size`` bytes of receive and send buffer.

    A plain ``SO_RCVBUF`` is clamped to ``net.core.rmem_max`` (4 MiB on the test machines;
    the kernel doubles it for bookkeeping): at 1 Gbit/s a forwarding node receiving 64 KiB
    datagrams from 4 workers overflowed it (``RcvbufErrors`` in the switch host's
    /proc/net/snmp) and every overflowed datagram became a retransmission timeout. A datagram
    cut into 9000-byte frames also occupies about twice its size in the buffer (each frame's
    buffer is charged). With ``CAP_NET_ADMIN`` (root, as on a testbed) the ``*FORCE``
    variants lift the clamp; without it the clamped size is what we get, and the windows
    that the WELCOME hands out follow what was granted."""
    for force, plain in ((_SO_RCVBUFFORCE, socket.SO_RCVBUF), (_SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        for opt in (force, plain):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
                break
            except OSError:
                continue


class UdpTransport:
    """A bound UDP socket; ``send`` injects the plan's faults, ``recv`` waits with a timeout."""

    kind = "udp"

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan | None = None,
        buffer_bytes: int = SOCKET_BUFFER,
        mtu: int | None = None,
    ):
        """``mtu``: cut packets into datagrams of at most this MTU even where the path allows
        more (e.g. on loopback, to see segmentation at work); None: each path's own."""
        self.name = name
        self.faults = faults or FaultPlan()
        if mtu is not None and not 576 <= mtu <= 65536:
            raise ValueError(f"mtu must be between 576 and 65536 bytes, got {mtu}")
        self.mtu = mtu
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _size_buffers(self.sock, buffer_bytes)
        try:
            self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)  # coalesced datagrams, see segments.py
        except OSError:
            pass  # an older kernel: every datagram comes alone (still correct)
        self.sock.bind((host, port))
        # the socket blocks, but only where ``recv`` waits for its next datagram (bounded by
        # SO_RCVTIMEO, see ``_next_datagram``); every send, and every receive beside a group's
        # socket, passes MSG_DONTWAIT
        self.sock.setblocking(True)
        self._rcvtimeo = 0.0  # SO_RCVTIMEO as set last (0: never set, the kernel's "forever")
        self.address: Address = self.sock.getsockname()
        self.receive_buffer = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.max_packet = UDP_MAX_PACKET
        self.counters = TransportCounters()
        self._strides: dict[Address, int] = {}  # destination -> datagram size of its path
        self._segmenter = Segmenter(self.counters.segments)
        self._reassembler = Reassembler(self.counters.segments, UDP_MAX_PACKET)
        self._pooled: bytearray | None = None  # buffer of the reassembled packet recv returned last
        self._links: dict[Address, random.Random] = {}
        self._held: list[_Held] = []
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._views: dict[tuple[int, int], _RingView] = {}
        self._last: tuple[_RingView, int] | None = None  # ring packet handed out by recv
        self._scratch = bytearray(0)
        self._stores: dict[tuple[int, int], _StoreView] = {}
        # datagrams are received into preallocated buffers (no allocation per packet): the
        # buffer of the packet ``recv`` returned last is reused by the next ``recv`` unless it
        # was retained, then it waits in ``_rx_free`` for ``release``
        self._rx = bytearray(_RX_BUFFER)
        self._rx_kept = False
        self._rx_free: list[bytearray] = []
        # the sockets ``recv`` reads: this one, and a multicast group's (``join``)
        self._inputs: tuple[socket.socket, ...] = (self.sock,)
        self._poller: select.poll | None = None  # of ``_inputs``, once there are several
        self._memberships: list[tuple[socket.socket, bytes]] = []  # ``join``'s, for ``rejoin``
        self._multicast_if: str | None = None  # ``multicast_from``: the interface groups go out of

    def multicast_from(self, interface: str) -> None:
        """Send to multicast groups out of the interface holding the address ``interface``,
        one hop only (TTL 1), without a copy to this host (loop off)."""
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        self._multicast_if = interface

    def join(self, group: str, port: int) -> bool:
        """Also receive what is sent to ``group``:``port`` on the interface of this transport's
        address (a second socket, bound to the group, read by ``recv`` like the first);
        False, and nothing joined, where the interface cannot (loopback, no multicast)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # one group, several workers
            _size_buffers(sock, SOCKET_BUFFER)
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            except OSError:
                pass
            sock.bind((group, port))
            membership = socket.inet_aton(group) + socket.inet_aton(self.address[0])
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return False
        self._inputs = (*self._inputs, sock)
        self._poller = None  # polled anew, with the group's socket
        self._memberships.append((sock, membership))
        return True

    def rejoin(self) -> None:
        """Leave every joined group and join it again at once: the kernel sends a fresh
        membership report (IGMP), from which a snooping bridge that never learned or lost this
        port's membership learns it now rather than at its next general query (minutes)."""
        for sock, membership in self._memberships:
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP, membership)
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
            except OSError:
                pass  # the interface went away: results keep coming unicast, on request

    def leave(self) -> None:
        """Leave every joined group for good (``recv`` reads this transport's own socket only):
        closing a group's socket drops its membership, the kernel reports the leave."""
        for sock, _ in self._memberships:
            sock.close()
        self._memberships.clear()
        self._inputs = (self.sock,)
        self._poller = None  # ``recv`` waits on this transport's own socket alone again

    def _rng(self, addr: Address) -> random.Random:
        rng = self._links.get(addr)
        if rng is None:
            rng = random.Random(f"{self.faults.seed}|{self.name}|{addr[0]}:{addr[1]}")
            self._links[addr] = rng
        return rng

    def prepare(self, addr: Address) -> None:
        """Set up what sending to ``addr`` needs before the first packet (UDP: learn the
        datagram size of the path)."""
        self.stride(addr)

    def stride(self, addr: Address) -> int:
        """The largest datagram (UDP payload) towards ``addr`` that its path carries whole:
        the path MTU (``IP_MTU`` of a connected socket) less 28 bytes of IP and UDP headers,
        capped by ``mtu`` and by the UDP limit. Learned once per destination."""
        stride = self._strides.get(addr)
        if stride is None:
            mtu = path_mtu(self.address[0], addr, self._multicast_if) or 1500
            if self.mtu is not None:
                mtu = min(mtu, self.mtu)
            stride = self._strides[addr] = max(SEG_HEADER + 64, min(UDP_MAX_DATAGRAM, mtu - 28))
        return stride

    def buffer_per_sender(self, senders: int) -> int:
        """Bytes each of ``senders`` peers may have in flight towards this node: the socket's
        receive buffer is shared by all of them (8 workers with a window sized for the whole
        buffer each overflow it, and every overflowed datagram is a retransmission)."""
        return self.receive_buffer // max(1, senders)

    def send(self, data: Packet, addr: Address, *, control: bool = False) -> None:
        """Send one packet; control messages (stats, shutdown) bypass fault injection."""
        parts = _parts(data)
        size = _size(parts)
        if size > self.max_packet:
            raise ValueError(f"packet of {size} bytes exceeds this transport's limit of {self.max_packet} bytes")
        with self._lock:
            self.counters.sent += 1
            self.counters.bytes_sent += size
            for due in self._fate(addr, control):
                if due is None:
                    self._emit(parts, size, addr)
                else:
                    self._hold(due, parts, addr)

    def _fate(self, addr: Address, control: bool) -> list[float | None]:
        """What the fault plan does to one packet on this link: one entry per copy to deliver,
        None = now, a time = held until then; no entry = dropped."""
        plan = self.faults
        if not plan.active or control and not plan.latency_s:
            return [None]
        if control:  # a control message is never lost, but it crosses the same long link
            return [time.monotonic() + plan.latency_s]
        rng = self._rng(addr)
        if rng.random() < plan.drop:
            self.counters.dropped += 1
            return []
        copies = 1
        if rng.random() < plan.duplicate:
            self.counters.duplicated += 1
            copies = 2
        now = time.monotonic()
        fate: list[float | None] = []
        lag = plan.latency_s
        for _ in range(copies):
            due: float | None = None
            if rng.random() < plan.reorder:
                self.counters.reordered += 1
                due = now + rng.uniform(0.001, 0.004)
            elif rng.random() < plan.delay:
                self.counters.delayed += 1
                due = now + rng.uniform(0.0, plan.delay_s)
            if lag:  # the long link comes on top of any reordering or delay
                due = (now if due is None else due) + lag
            fate.append(due)
        return fate

    def packet(self, addr: Address, size: int) -> memoryview:
        """A writable buffer for the next packet to ``addr`` (header + payload, ``size``
        bytes): fill it and ``send`` it. Lets a sender build the payload where it travels from
        (on shared memory: in the ring itself) instead of in a temporary that is then copied.
        Valid until the next ``packet`` call."""
        if len(self._scratch) < size:
            self._scratch = bytearray(size)  # replaced, not resized: old views stay valid
        return memoryview(self._scratch)[:size]

    def _hold(self, due: float, parts: list[Buffer], addr: Address) -> None:
        # a held packet must own its bytes: the caller's buffers may change after send returns
        heapq.heappush(self._held, _Held(due, next(self._order), b"".join(parts), addr))

    def _emit(self, parts: list[Buffer], size: int, addr: Address) -> None:
        stride = self.stride(addr)
        if size <= stride:
            self._sendmsg(parts, addr)
            return
        # larger than one datagram of the path: segments, several per system call (GSO)
        count = self._segmenter.layout(parts, size, stride)
        if self.faults.per_datagram and self.faults.active:
            for index in range(count):
                piece = bytes(self._segmenter.segment(index, stride, count))
                for due in self._fate(addr, False):
                    if due is None:
                        self._sendmsg([piece], addr)
                    else:
                        heapq.heappush(self._held, _Held(due, next(self._order), piece, addr))
            return
        for batch, several in self._segmenter.batches(count, stride):
            if several:
                self.counters.segments.gso_sends += 1
            self._sendmsg([batch], addr, segment_cmsg(stride) if several else ())

    def _sendmsg(self, parts: list[Buffer], addr: Address, cmsg: object = ()) -> None:
        try:
            self.sock.sendmsg(parts, cmsg, _DONTWAIT, addr)  # type: ignore[arg-type]
        except BlockingIOError:
            # the kernel's send buffer is full: wait for room rather than lose the packet here
            select.select([], [self.sock], [], 1.0)
            try:
                self.sock.sendmsg(parts, cmsg, _DONTWAIT, addr)  # type: ignore[arg-type]
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
                if self.faults.per_datagram and held.data[:1] == bytes([SEG_MAGIC]):
                    self._sendmsg([held.data], held.addr)  # a segment held back on its own
                else:
                    self._emit([held.data], len(held.data), held.addr)
            return self._held[0].due - now if self._held else None

    def _resolve(self, data: Buffer) -> memoryview | None:
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
        if pos < view.delivered:
            self.counters.stale_descriptors += 1  # duplicate or late: that space was reused
            return None
        off = _RING_HEADER + pos % view.capacity
        view.delivered = pos + n
        self._last = (view, pos)
        self.counters.shm_received += 1
        return view.view[off : off + n]

    def retain(self) -> object | None:
        """Keep the buffer of the packet ``recv`` returned last valid after the next ``recv``,
        until ``release(token)``: a node that sums packets as they come can keep reading them
        where they lie instead of copying them (a ring packet keeps its ring space; a datagram
        keeps its receive buffer, and the next ``recv`` takes another one)."""
        if self._pooled is not None:  # a packet put together from segments: keep its buffer
            kept, self._pooled = self._pooled, None
            return ("pool", kept)
        if self._last is None:
            self._rx_kept = True
            return self._rx
        view, pos = self._last
        view.retained.add(pos)
        return self._last

    def release(self, token: object | None) -> None:
        """Let the sender reuse a retained packet's space (or this node a receive buffer)."""
        if isinstance(token, bytearray):
            if token is not self._rx:
                self._rx_free.append(token)
            else:
                self._rx_kept = False
        elif isinstance(token, tuple) and token[0] == "pool":
            self._reassembler.give_back(token[1])
        elif isinstance(token, tuple):  # a ring packet: (its ring, its position), from ``retain``
            view, pos = cast(tuple[_RingView, int], token)
            view.retained.discard(pos)
            view.publish()

    def share(self, size: int) -> tuple[memoryview, bytes] | None:
        """A writable block of ``size`` bytes in this node's result store and the reference
        that lets other processes on this host read it in place; None: no store (UDP) or no
        room (the caller sends the values themselves)."""
        return None

    def unshare(self, ref: bytes) -> None:
        """Free a block obtained from ``share`` (no-op where there is no store)."""

    def shared(self, ref: Buffer) -> memoryview | None:
        """The bytes a result-store reference names, read in place; None if they are gone
        (the store's owner exited, or reused the space). Whoever reads them must check
        ``shared_intact`` afterwards: the owner may have reused the space meanwhile."""
        if len(ref) != STORE_REF.size:
            return None
        pid, fd, store_id, pos, n = STORE_REF.unpack(ref)
        view = self._stores.get((pid, fd))
        if view is None or view.id != store_id:
            try:
                view = _StoreView(pid, fd)
            except (OSError, ValueError):
                return None
            if view.id != store_id:
                view.close()
                return None
            self._stores[(pid, fd)] = view
        if n > view.capacity or not view.holds(pos):
            self.counters.stale_descriptors += 1
            return None
        return view.view(pos, n)

    def shared_intact(self, ref: Buffer) -> bool:
        """After reading ``shared(ref)``: whether the bytes were still the referenced ones."""
        pid, fd, _, pos, _ = STORE_REF.unpack(ref)
        view = self._stores.get((pid, fd))
        return view is not None and view.holds(pos)

    def recv(self, timeout: float) -> tuple[Buffer, Address] | None:
        """Next packet, or None after ``timeout`` seconds; releases held packets meanwhile.

        The returned buffer is valid until the next call."""
        if self._last is not None:
            self._last[0].publish()
            self._last = None
        if self._pooled is not None:
            self._reassembler.give_back(self._pooled)
            self._pooled = None
        if self._rx_kept:
            self._rx = self._rx_free.pop() if self._rx_free else bytearray(_RX_BUFFER)
            self._rx_kept = False
        ready = self._reassembler.ready
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if ready:
                packet, sender, self._pooled = ready.popleft()
                return packet, sender
            try:
                n, ancillary, flags, addr = self._next_datagram(deadline)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return None
                continue  # a held packet was due, or the wait ended a little early
            except OSError:
                continue  # ICMP errors surfaced on the socket: ignore, timers recover
            self.counters.received += 1
            data = memoryview(self._rx)[:n]
            stride = _gro_stride(ancillary)
            if flags & _MSG_TRUNC:
                continue  # larger than any packet of ours: not one
            if n > SEG_HEADER and data[0] == SEG_MAGIC or (stride and stride < n):
                self._coalesced(n, stride or n, addr)
                continue
            if n == _DESC.size and data[0] == _DESC_MAGIC:
                resolved = self._resolve(data)
                if resolved is not None:
                    return resolved, addr
                continue
            return data, addr

    def _next_datagram(self, deadline: float) -> tuple[int, list[tuple[int, int, bytes]], int, Address]:
        """The next datagram (into the receive buffer), waited for until ``deadline`` or the
        next held packet's time (held packets that are due are sent first); BlockingIOError:
        none came. One wait per datagram, in the kernel, and no Python exception where one
        comes: with one socket (the nodes) a blocking receive bounded by SO_RCVTIMEO, with
        several (a worker and its job's group) a poll of them, then a receive from one that is
        readable. A non-blocking receive from each socket, a select when all found nothing and
        a receive again cost 3-4 system calls and an exception per socket for every datagram
        waited for: a forwarding node waits for most of the ~600 runs of an 8-worker 4 MiB
        all-reduce at 1 Gbit/s, each worker for most of its ~70.

        SO_RCVTIMEO is set again only when the wait differs from it by more than a tenth (or
        5 ms): a wait may end up to that much after ``deadline``, which only delays a timer."""
        wait = deadline - time.monotonic()
        if self._held:
            next_held = self._release_due()
            if next_held is not None:
                wait = min(wait, next_held)
        if len(self._inputs) > 1:
            if self._poller is None:
                self._poller = select.poll()
                for sock in self._inputs:
                    self._poller.register(sock, select.POLLIN)
            readable = self._poller.poll(max(0, math.ceil(wait * 1000)))
            if not readable:
                raise BlockingIOError
            sock = next(s for s in self._inputs if s.fileno() == readable[0][0])
            return sock.recvmsg_into([self._rx], _GRO_CMSG, _DONTWAIT)
        if wait <= 1e-6:
            return self.sock.recvmsg_into([self._rx], _GRO_CMSG, _DONTWAIT)
        current = self._rcvtimeo
        if not current or abs(wait - current) > max(0.005, current / 10):
            seconds = int(wait)
            self.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(seconds, max(1, int((wait - seconds) * 1e6)))
            )
            self._rcvtimeo = wait
        return self.sock.recvmsg_into([self._rx], _GRO_CMSG)

    def _coalesced(self, n: int, stride: int, sender: Address) -> None:
        """Datagrams ``stride`` bytes apart in the receive buffer: segments go to the
        reassembly (whole packets come out in ``_reassembler.ready``); a datagram that is not
        a segment (the kernel coalesced plain datagrams of one flow) is copied out whole."""
        if self._rx[0] == SEG_MAGIC:  # (a datagram in the run that is not a segment is dropped)
            self._reassembler.feed(self._rx, n, stride, sender)
            return
        for start in range(0, n, stride):
            stop = min(n, start + stride)
            if self._rx[start] == SEG_MAGIC:
                self._reassembler.feed(bytearray(self._rx[start:stop]), stop - start, stop - start, sender)
                continue
            buffer = self._reassembler.take(stop - start)
            buffer[: stop - start] = self._rx[start:stop]
            self._reassembler.ready.append((memoryview(buffer)[: stop - start], sender, buffer))

    def close(self) -> None:
        self._last = None
        for views in (self._views, self._stores):
            for view in views.values():
                view.close()
            views.clear()
        for sock in self._inputs:
            sock.close()  # a group's socket leaves the group as it closes


class ShmTransport(UdpTransport):
    """UDP for control and small packets, a shared-memory ring per destination for large ones."""

    kind = "shm"

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan | None = None,
        ring_bytes: int = SHM_RING_BYTES,
        inline_limit: int = 8192,
        full_wait: float = 0.25,
        store_bytes: int = SHM_STORE_BYTES,
        mtu: int | None = None,
    ):
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("the shared-memory transport needs Linux (memfd_create)")
        super().__init__(name, host, port, faults, mtu=mtu)
        self.ring_bytes = ring_bytes
        self.inline_limit = inline_limit
        self.full_wait = full_wait
        self.receive_buffer = ring_bytes
        self.max_packet = ring_bytes // 4
        self._rings: dict[Address, _Ring] = {}
        self._open: tuple[_Ring, int, memoryview] | None = None  # reserved by ``packet``
        self._store: _Store | None = None
        self.store_bytes = store_bytes

    def buffer_per_sender(self, senders: int) -> int:
        """Every sender has a ring of its own."""
        return self.ring_bytes

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

    def packet(self, addr: Address, size: int) -> memoryview:
        """A large packet is reserved in the ring towards ``addr``, so the caller writes it
        where the receiver reads it and ``send`` only has to send the descriptor."""
        if size <= self.inline_limit or size > self.max_packet:
            return super().packet(addr, size)
        with self._lock:
            ring = self._ring(addr)
            pos = ring.reserve(size)
            if pos is None:  # full: a temporary; ``send`` waits for room as for any packet
                self._open = None
                return super().packet(addr, size)
            view = ring.view(pos, size)
            self._open = (ring, pos, view)
            return view

    def _emit(self, parts: list[Buffer], size: int, addr: Address) -> None:
        if size <= self.inline_limit:
            self._sendmsg(parts, addr)
            return
        ring = self._ring(addr)
        if self._open is not None and len(parts) == 1 and parts[0] is self._open[2] and self._open[0] is ring:
            # the packet was built in place (``packet``): only the descriptor is left to send;
            # a second copy of it (a duplicate) is written out like any other packet
            built_at = self._open[1]
            self._open = None
            self._notify(ring, built_at, size, addr)
            return
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
        self._notify(ring, pos, size, addr)

    def _notify(self, ring: _Ring, pos: int, size: int, addr: Address) -> None:
        self.counters.shm_sent += 1
        self._sendmsg([_DESC.pack(_DESC_MAGIC, os.getpid(), ring.fd, ring.id, pos, size)], addr)

    def share(self, size: int) -> tuple[memoryview, bytes] | None:
        if self._store is None:
            self._store = _Store(self.store_bytes)
        store = self._store
        pos = store.alloc(size) if size <= store.capacity else None
        if pos is None:
            return None
        return store.view(pos, size), STORE_REF.pack(os.getpid(), store.fd, store.id, pos, size)

    def unshare(self, ref: bytes) -> None:
        if self._store is not None:
            self._store.free(STORE_REF.unpack(ref)[3])

    def close(self) -> None:
        super().close()
        self._open = None
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
        if self._store is not None:
            self._store.close()
            self._store = None


def _gro_stride(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The datagram size of a coalesced receive (its ``UDP_GRO`` control message), 0 if none."""
    for level, kind, data in ancillary:
        if level == SOL_UDP and kind == UDP_GRO and len(data) >= 2:
            return int.from_bytes(data[:4] if len(data) >= 4 else data[:2], "little")
    return 0


def path_mtu(host: str, addr: Address, multicast_if: str | None = None) -> int | None:
    """The MTU of the path from ``host`` to ``addr`` as the kernel knows it (None if it does
    not say). A datagram larger than it would be fragmented by IP, and a fragmented datagram is
    lost when any fragment is (measured: 4 workers on one 100 Mbit/s tbf link, 64 KiB datagrams
    over MTU 1500: 0.8 MB/s; 8.8 KB datagrams over MTU 9000: 2.9 MB/s): packets are cut into
    datagrams that fit instead (``segments.py``). A multicast group's path is the one out of
    ``multicast_if`` (the interface a sender of groups names; a group has no route)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((host, 0))
        if multicast_if is not None:
            probe.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(multicast_if))
        probe.connect(addr)
        return int(probe.getsockopt(socket.IPPROTO_IP, _IP_MTU))
    except OSError:
        return None
    finally:
        probe.close()


def make_transport(
    kind: str,
    name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    faults: FaultPlan | None = None,
    mtu: int | None = None,
) -> UdpTransport:
    """The transport called ``kind`` ("udp" or "shm"); ``mtu``: see ``UdpTransport``."""
    if kind == "udp":
        return UdpTransport(name, host, port, faults, mtu=mtu)
    if kind == "shm":
        return ShmTransport(name, host, port, faults, mtu=mtu)
    raise ValueError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
