"""Start a parameter node and one or two levels of forwarding nodes as real processes.

Used by the demo, the tests and the benchmark; the ``ina`` framework and the CLI's
``parameter-node`` / ``forwarding-node`` commands start the same classes one per process.
``Fabric(...)`` keeps its earlier fields and defaults; added since: ``siblings`` (forwarding nodes
directly under the parameter node), ``kill`` (a ``KillPlan``: one node kills or stops itself at
a chosen moment) and ``stalled_after``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from trainmaster.aggregation.kills import KillPlan
from trainmaster.aggregation.protocol import Header, Kind, decode, encode
from trainmaster.aggregation.transport import TRANSPORTS, Address, FaultPlan, UdpTransport


def _serve_parameter_node(
    conn: Any,
    faults: FaultPlan,
    dead_after: float,
    transport: str,
    stalled_after: float = 2.0,
    kill: KillPlan | None = None,
    mtu: int | None = None,
) -> None:
    from trainmaster.aggregation.parameter_node import ParameterNode

    node = ParameterNode(
        faults=faults, dead_after=dead_after, transport=transport, stalled_after=stalled_after, kill=kill, mtu=mtu
    )
    conn.send(node.address)
    conn.close()
    node.serve()


def _serve_forwarding_node(
    conn: Any,
    parent: Address,
    slots: int,
    name: str,
    faults: FaultPlan,
    transport: str,
    kill: KillPlan | None = None,
    index: int = 0,
    mtu: int | None = None,
    partitions: int = 0,
) -> None:
    from trainmaster.aggregation.switch import ForwardingNode

    node = ForwardingNode(
        parent,
        slots=slots,
        name=name,
        faults=faults,
        transport=transport,
        kill=kill,
        index=index,
        mtu=mtu,
        partitions=partitions,
    )
    conn.send(node.address)
    conn.close()
    node.serve()


def query(addr: Address, kind: Kind = Kind.STATS, timeout: float = 2.0, attempts: int = 3) -> dict[str, Any] | None:
    """Ask a node for its counters (STATS) or stop it (SHUTDOWN, no reply expected)."""
    t = UdpTransport("control")
    try:
        for _ in range(attempts):
            t.send(encode(Header(kind, 0)), addr, control=True)
            if kind != Kind.STATS:
                return None
            got = t.recv(timeout)
            if got is not None:
                h, body = decode(got[0])
                if h.kind == Kind.STATS:
                    return json.loads(bytes(body))
        return None
    finally:
        t.close()


@dataclass
class Fabric:
    """A running tier: ``attach_points[i]`` is the forwarding node worker ``i`` talks to.

    ``transport`` ("udp" or "shm") is what the nodes use; workers should use the same."""

    slots: int = 64
    levels: int = 1
    faults: FaultPlan = field(default_factory=FaultPlan)
    dead_after: float = 10.0
    first_level_nodes: int = 2
    transport: str = "udp"
    siblings: int = 1  # forwarding nodes directly under the parameter node (levels = 1 only)
    kill: KillPlan | None = None
    stalled_after: float = 2.0
    mtu: int | None = None  # cut packets into datagrams of at most this MTU (None: the path's)
    partitions: int = 0  # 0: every job shares each node's slots; N: a static split into N parts
    ps: Address | None = None
    switches: list[Address] = field(default_factory=list)
    processes: list[Any] = field(default_factory=list)

    def start(self) -> Fabric:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        if self.levels not in (1, 2) or self.siblings < 1 or (self.levels == 2 and self.siblings != 1):
            raise ValueError("levels must be 1 or 2; several sibling nodes only with 1 level")
        ctx = mp.get_context("fork")
        self.ps = self._spawn(
            ctx,
            _serve_parameter_node,
            (self.faults, self.dead_after, self.transport, self.stalled_after, self.kill, self.mtu),
        )
        top = self._spawn(
            ctx,
            _serve_forwarding_node,
            (self.ps, self.slots, "switch-top", self.faults, self.transport, self.kill, 0, self.mtu, self.partitions),
        )
        self.switches = [top]
        for i in range(1, self.siblings):
            self.switches.append(
                self._spawn(
                    ctx,
                    _serve_forwarding_node,
                    (
                        self.ps,
                        self.slots,
                        f"switch-sibling-{i}",
                        self.faults,
                        self.transport,
                        self.kill,
                        i,
                        self.mtu,
                        self.partitions,
                    ),
                )
            )
        if self.levels == 2:
            for i in range(self.first_level_nodes):
                self.switches.append(
                    self._spawn(
                        ctx,
                        _serve_forwarding_node,
                        (
                            top,
                            self.slots,
                            f"switch-l1-{i}",
                            self.faults,
                            self.transport,
                            self.kill,
                            i + 1,
                            self.mtu,
                            self.partitions,
                        ),
                    )
                )
        return self

    def _spawn(self, ctx: Any, target: Any, args: tuple[Any, ...]) -> Address:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(20):
            raise RuntimeError(f"{target.__name__} did not report its address within 20 s")
        addr: Address = parent.recv()
        self.processes.append(proc)
        return addr

    def attach_point(self, worker_index: int) -> Address:
        """Where worker ``i`` attaches: spread over first-level nodes and the top node."""
        order = [*self.switches[1:], self.switches[0]]  # first-level nodes, then the top node
        return order[worker_index % len(order)]

    def stats(self) -> dict[str, Any]:
        """Every node's counters; None for a node whose process is gone (killed)."""
        assert self.ps is not None
        alive = [p.is_alive() for p in self.processes]  # same order: ps, then the switches
        return {
            "ps": query(self.ps) if alive[0] else None,
            "switches": [query(s) if up else None for s, up in zip(self.switches, alive[1:])],
        }

    def stop(self) -> None:
        """Stop every node: SHUTDOWN, then SIGKILL what is still there after 3 s (a stopped
        or hung node ignores both SHUTDOWN and SIGTERM); nothing is left running."""
        for addr in [*self.switches, *([self.ps] if self.ps else [])]:
            query(addr, Kind.SHUTDOWN, attempts=1, timeout=0.0)
        deadline = time.monotonic() + 3
        for proc in self.processes:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5)

    def __enter__(self) -> Fabric:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
