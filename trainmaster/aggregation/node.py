"""What a node of the aggregation tier does with a datagram, whichever role it plays.

A forwarding node and the parameter node read the same packets from the same kind of
transport, and treat them alike until the role matters: a datagram is decoded (one that is not
a valid packet is dropped, like a corrupted one), counted, may fire the node's kill plan, and
only then goes to the role's ``_dispatch``. Both answer STATS with their ``stats()`` and stop
on SHUTDOWN, and both send a down-going packet once per next hop, each copy naming only the
workers behind that hop. That much lives here, once; what each role does with DATA, HELLO,
the control messages and the down-going packets stays in its own class (``switch.py``,
``parameter_node.py``), where the protocol's per-role rules are explicit.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from trainmaster.aggregation.kills import KillPlan, Trigger
from trainmaster.aggregation.memory import tune_allocator
from trainmaster.aggregation.protocol import Header, Kind, ProtocolError, bits, decode, encode, encode_parts, set_bitmap
from trainmaster.aggregation.transport import Address, Buffer, UdpTransport


@dataclass
class NodeCounters:
    """What every node counts; each role's counters extend it."""

    packets_in: int = 0


def by_next_hop(bitmap: int, routes: dict[int, Address]) -> dict[Address, int]:
    """The workers of ``bitmap`` grouped by the next hop towards them (rank -> hop in
    ``routes``; a worker without a route is left out): one copy of a down-going packet per
    hop, naming only that hop's workers, which a forwarding node below replicates again."""
    hops: dict[Address, int] = {}
    for rank in bits(bitmap):
        hop = routes.get(rank)
        if hop is not None:
            hops[hop] = hops.get(hop, 0) | 1 << rank
    return hops


class DatagramNode(ABC):
    """The receive side shared by ``ForwardingNode`` and ``ParameterNode``: ``handle`` one
    datagram, ``serve`` until SHUTDOWN (or ``until``)."""

    counters: NodeCounters
    #: how long ``serve`` waits for a packet before it runs ``_run_timers`` anyway
    poll_interval: float = 0.2

    def __init__(self, transport: UdpTransport, kill: KillPlan | None, role: str, index: int = 0) -> None:
        """``role``/``index``: who this process is in a ``KillPlan`` (``ps``, ``switch:INDEX``)."""
        self.transport = transport
        self.address = transport.address
        self._kill = Trigger(kill if kill is not None and kill.aims_at(role, index) else None)
        self._running = True

    @abstractmethod
    def stats(self) -> dict[str, object]:
        """The node's counters, as the reply to STATS carries them."""

    @abstractmethod
    def _dispatch(self, h: Header, body: bytes | memoryview, src: Address) -> None:
        """The role's handling of one valid packet; ends with ``_on_control`` for the kinds
        the role itself does not handle."""

    def handle(self, datagram: Buffer, src: Address) -> None:
        try:
            h, body = decode(datagram)
            self.counters.packets_in += 1
            self._kill.tick(self.counters.packets_in)
            self._dispatch(h, body, src)
        except (ProtocolError, ValueError):
            return  # not a valid packet (wrong version, short payload): like a corrupted one

    def _on_control(self, h: Header, src: Address) -> None:
        """STATS and SHUTDOWN, the same for every role; any other kind is not for this role."""
        if h.kind == Kind.STATS:
            reply = json.dumps(self.stats()).encode()
            self.transport.send(encode(h, reply), src, control=True)
        elif h.kind == Kind.SHUTDOWN:
            self.stop()

    def _send_per_hop(
        self, h: Header, body: bytes | memoryview | np.ndarray, routes: dict[int, Address], *, control: bool = False
    ) -> int:
        """Send ``h`` to the workers in its bitmap, one copy per next hop in ``routes``;
        returns the number of copies sent."""
        hops = by_next_hop(h.bitmap, routes)
        head, payload = encode_parts(h, body)  # encoded once; each copy gets its own bitmap
        for hop, mask in hops.items():
            copy = bytearray(head)
            set_bitmap(copy, mask)
            self.transport.send([copy, payload], hop, control=control)
        return len(hops)

    def _run_timers(self, received: bool) -> None:
        """Called after every wait for a packet (``received``: one was handled): a role's
        timers run here (none by default: a forwarding node's loop stays one recv and one
        handle per packet)."""

    def stop(self) -> None:
        """Make :meth:`serve` return after its current receive (a SIGTERM handler may call it)."""
        self._running = False

    def serve(self, until: float | None = None) -> None:
        tune_allocator()
        while self._running and (until is None or time.monotonic() < until):
            got = self.transport.recv(self.poll_interval)
            if got is not None:
                self.handle(*got)
            self._run_timers(got is not None)
        self.transport.close()
