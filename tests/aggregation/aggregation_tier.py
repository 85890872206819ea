"""An in-process tier for aggregation tests: real UDP sockets, each node in its own thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from trainmaster.aggregation.fabric import query
from trainmaster.aggregation.parameter_node import ParameterNode
from trainmaster.aggregation.protocol import Kind
from trainmaster.aggregation.switch import ForwardingNode
from trainmaster.aggregation.transport import Address, FaultPlan
from trainmaster.aggregation.worker import AggregationClient, WorkerConfig


@dataclass
class ThreadTier:
    ps: ParameterNode
    switches: list[ForwardingNode]
    threads: list[threading.Thread] = field(default_factory=list)
    transport: str = "udp"
    mtu: int | None = None

    def attach(self, rank: int) -> Address:
        order = [*self.switches[1:], self.switches[0]]
        return order[rank % len(order)].address

    def stop(self) -> None:
        for node in [*self.switches, self.ps]:
            query(node.address, Kind.SHUTDOWN)
        for t in self.threads:
            t.join(timeout=5)


def random_inputs(
    jobs: int, world: int, n: int, rounds: int, seed: int = 0, big: float = 0.0
) -> dict[tuple[int, int], list[np.ndarray]]:
    """Random float32 tensors per (job, rank) and round; ``big`` plants values that overflow a
    fixed quantisation scale."""
    rng = np.random.default_rng(seed)
    out = {}
    for job in range(1, jobs + 1):
        for r in range(world):
            xs = []
            for _ in range(rounds):
                x = rng.standard_normal(n).astype(np.float32)
                if big:
                    x[::97] = big
                xs.append(x)
            out[(job, r)] = xs
    return out


def start_tier(
    slots: int = 64,
    levels: int = 1,
    faults: FaultPlan | None = None,
    dead_after: float = 10.0,
    transport: str = "udp",
    siblings: int = 1,
    mtu: int | None = None,
    partitions: int = 0,
) -> ThreadTier:
    """``siblings``: forwarding nodes directly under the parameter node (what the ina
    framework builds for a switch role with several replicas); ``mtu``: every node and worker
    cuts its packets into datagrams of at most this MTU (segmentation on loopback)."""
    ps = ParameterNode(faults=faults, dead_after=dead_after, transport=transport, mtu=mtu)
    kw: dict[str, Any] = {"slots": slots, "faults": faults, "transport": transport, "mtu": mtu}
    top = ForwardingNode(ps.address, name="top", partitions=partitions, **kw)
    switches = [top]
    switches += [ForwardingNode(ps.address, name=f"sibling-{i}", **kw) for i in range(1, siblings)]
    if levels == 2:
        switches += [ForwardingNode(top.address, name=f"l1-{i}", **kw) for i in range(2)]
    tier = ThreadTier(ps, switches, transport=transport, mtu=mtu)
    for node in [ps, *switches]:
        t = threading.Thread(target=node.serve, daemon=True)
        t.start()
        tier.threads.append(t)
    return tier


def reduce_all(
    tier: ThreadTier,
    inputs: dict[tuple[int, int], list[np.ndarray]],
    world: int,
    config: WorkerConfig | None = None,
    faults: FaultPlan | None = None,
) -> dict[tuple[int, int], Any]:
    """Run every (job, rank) worker in a thread; returns each worker's results and stats."""
    out: dict[tuple[int, int], Any] = {}

    def work(job: int, rank: int) -> None:
        with AggregationClient(
            tier.attach(rank), job, rank, world, config, faults, transport=tier.transport, mtu=tier.mtu
        ) as c:
            results = [(c.allreduce(x, key="t"), c.last_error_bound) for x in inputs[(job, rank)]]
            out[(job, rank)] = (results, c.stats(), dict(c.slot_override))

    threads = [threading.Thread(target=work, args=key) for key in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def assert_exact(inputs: dict[tuple[int, int], list[np.ndarray]], out: dict[tuple[int, int], Any]) -> None:
    assert set(out) == set(inputs), f"workers without a result: {set(inputs) - set(out)}"
    for (job, rank), (results, _, _) in out.items():
        for rnd, (y, bound) in enumerate(results):
            exact = sum(
                inputs[(job, r)][rnd].astype(np.float64) for r in range(len({k for k in inputs if k[0] == job}))
            )
            err = np.abs(y.astype(np.float64) - exact)
            assert np.all(err <= bound + np.abs(exact) * 2.0**-23), (job, rank, rnd, err.max())


@pytest.fixture
def tier_factory() -> Iterator[Any]:
    made: list[ThreadTier] = []

    def make(**kwargs: Any) -> ThreadTier:
        tier = start_tier(**kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.stop()
