"""Start a parameter node and one or two levels of forwarding nodes as real processes.

Used by the demo, the tests and the benchmark; the ``ina`` framework and the CLI's
``parameter-node`` / ``forwarding-node`` commands start the same classes one per process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

from trainmaster.aggregation.protocol import Header, Kind, decode, encode
from trainmaster.aggregation.transport import TRANSPORTS, Address, FaultPlan, UdpTransport


def _serve_parameter_node(conn: Any, faults: FaultPlan, dead_after: float,
                          transport: str) -> None:
    from trainmaster.aggregation.parameter_node import ParameterNode

    node = ParameterNode(faults=faults, dead_after=dead_after, transport=transport)
    conn.send(node.address)
    conn.close()
    node.serve()


def _serve_forwarding_node(conn: Any, parent: Address, slots: int, name: str,
                           faults: FaultPlan, transport: str) -> None:
    from trainmaster.aggregation.switch import ForwardingNode

    node = ForwardingNode(parent, slots=slots, name=name, faults=faults, transport=transport)
    conn.send(node.address)
    conn.close()
    node.serve()


def query(addr: Address, kind: Kind = Kind.STATS, timeout: float = 2.0,
          attempts: int = 3) -> dict[str, Any] | None:
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
                    return json.loads(body)
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
    ps: Address | None = None
    switches: list[Address] = field(default_factory=list)
    processes: list[Any] = field(default_factory=list)

    def start(self) -> Fabric:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        ctx = mp.get_context("fork")
        self.ps = self._spawn(ctx, _serve_parameter_node,
                              (self.faults, self.dead_after, self.transport))
        top = self._spawn(ctx, _serve_forwarding_node,
                          (self.ps, self.slots, "switch-top", self.faults, self.transport))
        self.switches = [top]
        if self.levels >= 2:
            for i in range(self.first_level_nodes):
                self.switches.append(self._spawn(
                    ctx, _serve_forwarding_node,
                    (top, self.slots, f"switch-l1-{i}", self.faults, self.transport)))
        elif self.levels != 1:
            raise ValueError("levels must be 1 or 2")
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
        assert self.ps is not None
        return {"ps": query(self.ps), "switches": [query(s) for s in self.switches]}

    def stop(self) -> None:
        for addr in [*self.switches, *([self.ps] if self.ps else [])]:
            query(addr, Kind.SHUTDOWN)
        deadline = time.monotonic() + 3
        for proc in self.processes:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)

    def __enter__(self) -> Fabric:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
