"""UDP transport with seeded, per-link fault injection (drop, duplicate, reorder, delay).

Faults are applied on the sending side of every link (this socket -> one destination), each
link with its own ``random.Random`` seeded from (seed, node name, destination), so a run with
the same seed and the same packet order injects the same faults. Reordering holds a packet back
for a few milliseconds so that later packets on the link overtake it; delay holds it for a
random time. Held packets are released by ``recv`` (every node loop calls it), never by a
background thread.
"""

from __future__ import annotations

import heapq
import itertools
import random
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

Address = tuple[str, int]


@dataclass(frozen=True)
class FaultPlan:
    """Probabilities per datagram, applied independently on each link."""

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

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Transport(Protocol):
    """What every node needs from the network; UDP is the one implementation."""

    address: Address
    counters: TransportCounters

    def send(self, data: bytes, addr: Address, *, control: bool = False) -> None: ...
    def recv(self, timeout: float) -> tuple[bytes, Address] | None: ...
    def close(self) -> None: ...


@dataclass(order=True)
class _Held:
    due: float
    order: int
    data: bytes = field(compare=False)
    addr: Address = field(compare=False)


class UdpTransport:
    """A bound UDP socket; ``send`` injects the plan's faults, ``recv`` waits with a timeout."""

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
        self.counters = TransportCounters()
        self._links: dict[Address, random.Random] = {}
        self._held: list[_Held] = []
        self._order = itertools.count()
        self._lock = threading.Lock()

    def _rng(self, addr: Address) -> random.Random:
        rng = self._links.get(addr)
        if rng is None:
            rng = random.Random(f"{self.faults.seed}|{self.name}|{addr[0]}:{addr[1]}")
            self._links[addr] = rng
        return rng

    def send(self, data: bytes, addr: Address, *, control: bool = False) -> None:
        """Send one datagram; control messages (stats, shutdown) bypass fault injection."""
        with self._lock:
            self.counters.sent += 1
            self.counters.bytes_sent += len(data)
            plan = self.faults
            if control or not plan.active:
                self._emit(data, addr)
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
                    self._hold(now + rng.uniform(0.001, 0.004), data, addr)
                elif rng.random() < plan.delay:
                    self.counters.delayed += 1
                    self._hold(now + rng.uniform(0.0, plan.delay_s), data, addr)
                else:
                    self._emit(data, addr)

    def _hold(self, due: float, data: bytes, addr: Address) -> None:
        heapq.heappush(self._held, _Held(due, next(self._order), data, addr))

    def _emit(self, data: bytes, addr: Address) -> None:
        try:
            self.sock.sendto(data, addr)
        except BlockingIOError:
            # the kernel's send buffer is full: wait for room rather than lose the packet here
            select.select([], [self.sock], [], 1.0)
            try:
                self.sock.sendto(data, addr)
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
                self._emit(held.data, held.addr)
            return self._held[0].due - now if self._held else None

    def recv(self, timeout: float) -> tuple[bytes, Address] | None:
        """Next datagram, or None after ``timeout`` seconds; releases held packets meanwhile."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                data, addr = self.sock.recvfrom(65535)
                self.counters.received += 1
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
        self.sock.close()
