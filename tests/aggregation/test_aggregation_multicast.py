"""Results replicated by the network (``multicast.py``), on a real testbed: hosts are network
namespaces on one Linux bridge (IGMP snooping, the bridge as querier), every node and worker a
process of its own on its host, results sent once to a job's group and cloned by the bridge."""

from __future__ import annotations

import functools
import inspect
import ipaddress
import json
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aggregation_tier import assert_exact, random_inputs
from trainmaster.aggregation.multicast import (
    DEFAULT_NETWORK,
    MAX_FAILED_REJOINS,
    REJOIN_INTERVAL_S,
    group_for,
    parse_network,
)
from trainmaster.aggregation.parameter_node import ParameterNode
from trainmaster.aggregation.switch import ForwardingNode
from trainmaster.aggregation.transport import FaultPlan
from trainmaster.aggregation.worker import DEFAULT_CHUNK, AggregationClient, WorkerConfig
from trainmaster.cli import aggregation as cli_aggregation

PS_PORT, SWITCH_PORT = 7400, 7401
WAIT_S = 120.0  # for any process of a test to report
SLICE_BYTES = 4 * DEFAULT_CHUNK["udp"] + 4096  # one slice on the wire, with headers


@pytest.fixture
def testbed() -> Iterator[Callable[..., Any]]:
    """``testbed(hosts=N)`` -> a testbed that is up (uncapped links); removed after the test,
    failed or not, and nothing of its prefix may be left."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("testbeds need root and iproute2 (network namespaces, veth links, tc qdiscs)")
    from trainmaster.testbed import Testbed, TestbedOptions, remove
    from trainmaster.testbed.iproute import namespaces

    prefix = f"t{secrets.token_hex(3)}"

    def make(**options: Any) -> Any:
        return Testbed.up(TestbedOptions(prefix=prefix, link_rate=None, **options))

    try:
        yield make
    finally:
        remove(prefix)
        left = [ns for ns in namespaces() if ns.startswith(f"{prefix}-")]
        assert not left, f"namespaces left behind by the test: {left}"


# ---- processes on testbed hosts --------------------------------------------------------------
def _node(namespace: str, make: Callable[[], Any], stop: Any, out: Any) -> None:
    """A forwarding or parameter node on a host until ``stop``; then its stats go to ``out``."""
    from trainmaster.agent.netns import enter

    enter(namespace)
    node = make()
    serving = threading.Thread(target=node.serve, daemon=True)
    serving.start()
    stop.wait(timeout=WAIT_S)
    stats = node.stats()
    node.stop()
    serving.join(timeout=5)
    out.put((namespace, stats))


def _worker(
    namespace: str,
    host: str,
    switch: tuple[str, int],
    job: int,
    rank: int,
    world: int,
    inputs: list[np.ndarray],
    faults: FaultPlan | None,
    network: str,
    out: Any,
) -> None:
    from trainmaster.agent.netns import enter

    enter(namespace)
    config = WorkerConfig(timeout=60.0, failover_after=20.0, multicast_network=network)
    with AggregationClient(switch, job, rank, world, config, faults, host=host) as client:
        results = [(client.allreduce(x, key="t"), client.last_error_bound) for x in inputs]
        out.put(((job, rank), (results, {**client.stats(), "group": client.group}, {})))


def _steady_input(rank: int, index: int, n: int) -> np.ndarray:
    return np.random.default_rng((rank, index)).standard_normal(n).astype(np.float32)


def _steady_worker(
    namespace: str,
    host: str,
    switch: tuple[str, int],
    rank: int,
    world: int,
    n: int,
    stop: Any,
    progress: Any,
    out: Any,
) -> None:
    """A worker that reduces (4 inputs in turn, each sum checked against the exact one) until
    ``stop``: each round carries one more element, 1 where ``stop`` is set, so every worker
    ends after the same round (the first whose sum of flags is not 0). Rank 0 keeps its rounds,
    retransmissions, renewals of its group and unicast fallbacks so far in ``progress``."""
    from trainmaster.agent.netns import enter

    enter(namespace)
    inputs = [_steady_input(rank, i, n) for i in range(4)]
    sums = [sum(_steady_input(r, i, n).astype(np.float64) for r in range(world)) for i in range(4)]
    config = WorkerConfig(timeout=60.0, failover_after=20.0)
    with AggregationClient(switch, 1, rank, world, config, host=host) as client:
        rounds, exact = 0, True
        while True:
            y = client.allreduce(np.append(inputs[rounds % 4], np.float32(stop.is_set())))
            bound = client.last_error_bound
            assert bound is not None
            err = np.abs(y[:-1].astype(np.float64) - sums[rounds % 4])
            exact &= bool(np.all(err <= bound[:-1] + np.abs(sums[rounds % 4]) * 2.0**-23))
            rounds += 1
            if rank == 0:
                counters = client.counters
                progress[:] = [
                    rounds,
                    counters.retransmits,
                    counters.rejoins,
                    counters.unicast_fallbacks,
                    counters.spurious_retransmits,
                ]
            if y[-1] > 0.5:
                break
        out.put(((1, rank), (exact, {**client.stats(), "rounds": rounds}, {})))


class Fabric:
    """Nodes and workers of one test on a testbed, as forked processes."""

    def __init__(self, bed: Any):
        self.bed = bed
        self.ctx = mp.get_context("fork")
        self.stop = self.ctx.Event()
        self.steady_stop = self.ctx.Event()
        # a steady rank 0's rounds, retransmissions, renewals, unicast fallbacks and spurious
        # retransmissions
        self.progress = self.ctx.Array("i", 5)
        self.node_out = self.ctx.Queue()
        self.worker_out = self.ctx.Queue()
        self.nodes: list[Any] = []
        self.workers: list[Any] = []

    def node(self, host: str, make: Callable[[], Any]) -> None:
        proc = self.ctx.Process(target=_node, args=(self.bed.namespace(host), make, self.stop, self.node_out))
        proc.start()
        self.nodes.append(proc)

    def worker(
        self,
        host: str,
        switch: tuple[str, int],
        job: int,
        rank: int,
        world: int,
        inputs: Any,
        faults: Any,
        network: str = DEFAULT_NETWORK,
    ) -> None:
        args = (self.bed.namespace(host), self.bed.address(host), switch, job, rank, world, inputs, faults, network)
        proc = self.ctx.Process(target=_worker, args=(*args, self.worker_out))
        proc.start()
        self.workers.append(proc)

    def steady_worker(self, host: str, switch: tuple[str, int], rank: int, world: int, n: int) -> None:
        """A ``_steady_worker`` of job 1 until ``steady_stop``; rank 0's counters so far in
        ``progress``."""
        args = (self.bed.namespace(host), self.bed.address(host), switch, rank, world, n)
        proc = self.ctx.Process(target=_steady_worker, args=(*args, self.steady_stop, self.progress, self.worker_out))
        proc.start()
        self.workers.append(proc)

    def results(self) -> tuple[dict[tuple[int, int], Any], dict[str, dict[str, Any]]]:
        """Every worker's results and stats, then every node's stats (by namespace)."""
        out: dict[tuple[int, int], Any] = {}
        try:
            for _ in self.workers:
                key, value = self.worker_out.get(timeout=WAIT_S)
                out[key] = value
        except queue.Empty:
            pass  # a worker failed: assert_exact names the missing ones
        self.stop.set()
        nodes = {}
        for _ in self.nodes:
            namespace, stats = self.node_out.get(timeout=WAIT_S)
            nodes[namespace.rsplit("-", 1)[1]] = stats
        return out, nodes

    def close(self) -> None:
        self.steady_stop.set()  # steady workers end their round while the nodes still serve
        _join(self.workers)
        self.stop.set()
        _join(self.nodes)


def _join(procs: list[Any]) -> None:
    """Wait for each process (10 s), killing one that does not end."""
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


@pytest.fixture
def fabric_on() -> Iterator[Callable[[Any], Fabric]]:
    made: list[Fabric] = []

    def make(bed: Any) -> Fabric:
        made.append(Fabric(bed))
        return made[-1]

    yield make
    for fabric in made:
        fabric.close()


def _down_bytes(bed: Any, before: dict[str, Any], host: str) -> int:
    return int(bed.counters()[host].down_bytes - before[host].down_bytes)


def _one_level(bed: Any, fabric: Any) -> tuple[str, int]:
    """The parameter node on h5 and the forwarding node on the switch host (where the bridge
    is); the forwarding node's address, which the workers send to."""
    ps = (bed.address("h5"), PS_PORT)
    switch = (bed.address("sw"), SWITCH_PORT)
    fabric.node("h5", functools.partial(ParameterNode, ps[0], ps[1]))
    fabric.node("sw", functools.partial(ForwardingNode, ps, host=switch[0], port=switch[1]))
    return switch


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_results_go_once_to_the_jobs_group_and_the_bridge_replicates_them(testbed, fabric_on) -> None:
    """Multicast result replication: 4 workers on 4 hosts, the forwarding node on the switch
    host sends each result once to the job's group (no unicast copy at all without faults), the
    bridge clones it to the 4 members' ports, every sum is exact; IGMP snooping keeps the
    results off the parameter node's port (not a member): its link carries the partial sums
    once, not the results too."""
    bed = testbed(hosts=5)
    fabric = fabric_on(bed)
    switch = _one_level(bed, fabric)
    n, rounds = 200_000, 3
    inputs = random_inputs(1, 4, n, rounds, seed=3)
    before = bed.counters()
    for rank in range(4):
        fabric.worker(f"h{rank + 1}", switch, 1, rank, 4, inputs[(1, rank)], None)
    out, nodes = fabric.results()
    assert_exact(inputs, out)
    sw = nodes["sw"]
    slices = -(-n // DEFAULT_CHUNK["udp"])
    assert {stats["group"] for _, stats, _ in out.values()} == {group_for(1, switch)}
    resent = sum(stats["retransmits"] + stats["gap_retransmits"] for _, stats, _ in out.values())
    assert sw["results_multicast"] >= slices * rounds
    assert sw["results_replicated"] <= resent  # unicast only for a worker that asked again
    tensor = n * 4 * rounds
    for host in ("h1", "h2", "h3", "h4"):
        assert _down_bytes(bed, before, host) >= tensor
    # partial sums once, and a slice per retransmission (a flooded result would double it)
    assert _down_bytes(bed, before, "h5") < 1.2 * tensor + resent * SLICE_BYTES


@pytest.mark.timeout(300)
def test_two_tenants_of_one_forwarding_node_do_not_receive_each_others_results(testbed, fabric_on) -> None:
    """Multicast result replication, shared switch: jobs 1 and 2 share one forwarding node, each
    on two hosts of its own; each job's results go to its own group, so the bridge gives job
    2's hosts none of job 1's (much larger) results, and both jobs' sums are exact."""
    bed = testbed(hosts=5)
    fabric = fabric_on(bed)
    switch = _one_level(bed, fabric)
    big, small, rounds = 300_000, 20_000, 2
    inputs = random_inputs(1, 2, big, rounds, seed=5)
    inputs.update({(2, r): xs for (_, r), xs in random_inputs(1, 2, small, rounds, seed=6).items()})
    before = bed.counters()
    for (job, rank), xs in inputs.items():
        fabric.worker(f"h{(job - 1) * 2 + rank + 1}", switch, job, rank, 2, xs, None)
    out, nodes = fabric.results()
    assert_exact(inputs, out)
    assert group_for(1, switch) != group_for(2, switch)
    assert {out[(job, r)][1]["group"] for job in (1, 2) for r in (0, 1)} == {group_for(1, switch), group_for(2, switch)}
    assert nodes["sw"]["results_multicast"] > 0
    big_bytes = big * 4 * rounds
    for host in ("h1", "h2"):
        assert _down_bytes(bed, before, host) >= big_bytes
    for host in ("h3", "h4"):  # job 2's hosts: their own results, none of job 1's
        assert _down_bytes(bed, before, host) < big_bytes / 4


@pytest.mark.timeout(300)
def test_with_a_flooding_bridge_and_a_shared_group_workers_drop_the_other_jobs_results(testbed, fabric_on) -> None:
    """Multicast result replication, the worst case for tenants: the bridge's IGMP snooping is
    off (it floods every group to every port) and the two jobs' groups coincide (a range of
    two groups, job ids chosen to collide), so every worker receives the other job's results
    too; each worker drops what is not its job's, and both jobs' sums are exact."""
    bed = testbed(hosts=5)
    bed.run("sw", ["ip", "link", "set", "br0", "type", "bridge", "mcast_snooping", "0"])
    fabric = fabric_on(bed)
    network = "239.192.7.0/30"
    ps = (bed.address("h5"), PS_PORT)
    switch = (bed.address("sw"), SWITCH_PORT)
    other = next(j for j in range(2, 64) if group_for(j, switch, network) == group_for(1, switch, network))
    fabric.node("h5", functools.partial(ParameterNode, ps[0], ps[1]))
    node = functools.partial(ForwardingNode, ps, host=switch[0], port=switch[1], multicast_network=network)
    fabric.node("sw", node)
    big, small, rounds = 300_000, 20_000, 2
    inputs = random_inputs(1, 2, big, rounds, seed=12)
    inputs.update({(other, r): xs for (_, r), xs in random_inputs(1, 2, small, rounds, seed=13).items()})
    before = bed.counters()
    for (job, rank), xs in inputs.items():
        fabric.worker(f"h{(job != 1) * 2 + rank + 1}", switch, job, rank, 2, xs, None, network)
    out, nodes = fabric.results()
    assert_exact(inputs, out)
    assert {stats["group"] for _, stats, _ in out.values()} == {group_for(1, switch, network)}
    assert nodes["sw"]["results_multicast"] > 0
    for host in ("h3", "h4"):  # the other job's hosts got job 1's results, and dropped them
        assert _down_bytes(bed, before, host) >= big * 4 * rounds


@pytest.mark.timeout(300)
@pytest.mark.parametrize("per_datagram", [False, True])
def test_loss_duplication_and_reordering_with_multicast_results_stay_exact(
    testbed, fabric_on, per_datagram: bool
) -> None:
    """Multicast result replication under faults: every node and worker drops, duplicates and
    reorders packets (``per_datagram``: each datagram of a segmented packet on its own); a lost
    multicast copy is lost for every member, each asks again and gets a unicast resend, a
    duplicated or late copy is dropped by the workers; every sum stays exact.

    The faults are random per run: each link's generator is seeded from the plan's seed, the
    node and the destination, and the testbed's subnet (hence every address, the group, the
    workers' ports) differs per run. So the run must carry enough packets for the faults
    asserted below to happen: per packet, at 3 % a slice's result (the parameter node's copy
    and the multicast copy) escapes loss with 0.97^2, and 3 rounds (30 slices) left the
    forwarding node without a lost result or without any drop in about 1 run of 9 (measured:
    3 of 28); 25 rounds (250 slices) leave it with 0.97^500 < 1e-6. Per datagram, each slice
    is ~8 datagrams at risk, and 3 rounds suffice."""
    bed = testbed(hosts=4)
    fabric = fabric_on(bed)
    faults = FaultPlan(drop=0.03, duplicate=0.03, reorder=0.05, seed=11, per_datagram=per_datagram)
    ps = (bed.address("h4"), PS_PORT)
    switch = (bed.address("sw"), SWITCH_PORT)
    fabric.node("h4", functools.partial(ParameterNode, ps[0], ps[1], faults=faults))
    fabric.node("sw", functools.partial(ForwardingNode, ps, host=switch[0], port=switch[1], faults=faults))
    rounds = 3 if per_datagram else 25
    inputs = random_inputs(1, 3, 150_000, rounds, seed=7)
    for rank in range(3):
        fabric.worker(f"h{rank + 1}", switch, 1, rank, 3, inputs[(1, rank)], faults)
    out, nodes = fabric.results()
    assert_exact(inputs, out)
    sw = nodes["sw"]
    assert sw["results_multicast"] > 0 and sw["transport"]["dropped"] > 0
    assert sw["results_replicated"] > 0  # results resent to the workers that asked, unicast


def _ports_of(bed: Any, group: str) -> set[str]:
    """The bridge ports the bridge forwards ``group`` to (its learned mdb entries)."""
    shown = bed.run("sw", ["bridge", "-j", "mdb", "show", "dev", "br0"]).stdout
    entries = [e for table in json.loads(shown or "[]") for e in table.get("mdb", [])]
    return {e["port"] for e in entries if e.get("grp") == group}


def _reporting(bed: Any, host: str, group: str) -> bool:
    """Whether ``host``'s kernel will still send a report for ``group`` by itself (a join's
    repeat pending: /proc/net/igmp's timer of the group runs)."""
    key = ipaddress.IPv4Address(group).packed[::-1].hex().upper()
    lines = bed.run(host, ["cat", "/proc/net/igmp"]).stdout.splitlines()
    return any(line.split()[0] == key and line.split()[2].startswith("1:") for line in lines if line.split())


def _wait(what: str, condition: Callable[[], bool], timeout: float) -> float:
    """Poll ``condition`` every 10 ms until it holds; the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.01)
    return time.monotonic() - start


def _three_steady_workers(bed: Any, fabric_on: Callable[[Any], Fabric]) -> tuple[Fabric, tuple[str, int], int]:
    """One job of three steady workers on h1..h3 (150,000 elements a round), its forwarding node
    on the switch host and its parameter node on h4: the fabric, the forwarding node's address
    and the slices of a round."""
    fabric = fabric_on(bed)
    ps = (bed.address("h4"), PS_PORT)
    switch = (bed.address("sw"), SWITCH_PORT)
    fabric.node("h4", functools.partial(ParameterNode, ps[0], ps[1]))
    fabric.node("sw", functools.partial(ForwardingNode, ps, host=switch[0], port=switch[1]))
    n = 150_000
    for rank in range(3):
        fabric.steady_worker(f"h{rank + 1}", switch, rank, 3, n)
    return fabric, switch, -(-(n + 1) // DEFAULT_CHUNK["udp"])


@pytest.mark.timeout(300)
def test_a_worker_whose_membership_the_bridge_lost_renews_it_and_multicast_resumes(testbed, fabric_on) -> None:
    """Multicast result replication, membership renewal: mid-run the bridge forgets h1's
    membership of the job's group (``bridge mdb del``, as a flush, a restart or a missed
    report leaves it), so the group's results stop reaching worker 0, which gets them by
    asking again (unicast resends). Its kernel would report the membership again only when
    the bridge queries (125 s; 31 s after the bridge's start): the worker renews it at a
    resend (leave and join, at most every REJOIN_INTERVAL_S), the bridge forwards the group to
    h1's port again within 5 s (expected: that interval, a retransmission timeout and the
    report's delay of up to 0.2 s), and then worker 0 gets its results by multicast again: few
    resends in the next 20 rounds (all of them, 10 a round, without it); every sum is exact."""
    bed = testbed(hosts=4)
    # h1's kernel repeats its join's report within 50 ms rather than 10 s: after that nothing
    # but the worker itself can renew the membership before the bridge's next query
    for key in ("igmpv2_unsolicited_report_interval", "igmpv3_unsolicited_report_interval"):
        bed.run("h1", ["sysctl", "-qw", f"net.ipv4.conf.eth0.{key}=50"])
    fabric, switch, slices = _three_steady_workers(bed, fabric_on)
    group, progress = group_for(1, switch), fabric.progress
    _wait("3 members learned, 3 rounds", lambda: len(_ports_of(bed, group)) == 3 and progress[0] >= 3, 60)
    _wait("h1's kernel to finish reporting on its own", lambda: not _reporting(bed, "h1", group), 10)
    bed.run("sw", ["bridge", "mdb", "del", "dev", "br0", "port", "p1", "grp", group])
    assert "p1" not in _ports_of(bed, group)
    _wait("h1's membership to be renewed", lambda: "p1" in _ports_of(bed, group), 5)
    back_at, asked_at = progress[:2]
    _wait("20 rounds after the renewal", lambda: progress[0] >= back_at + 20, 60)
    asked_after = progress[1] - asked_at
    fabric.steady_stop.set()
    out, nodes = fabric.results()
    assert set(out) == {(1, 0), (1, 1), (1, 2)}
    assert all(exact for exact, _, _ in out.values())
    assert out[(1, 0)][1]["rejoins"] >= 1 and nodes["sw"]["results_multicast"] > 0
    # the round in flight at the renewal (``progress`` lags by up to a round: measured 5-10)
    # and a late result or two on a loaded machine: not 20 rounds' worth
    assert asked_after <= 3 * slices, (asked_after, slices)


def _member(bed: Any, host: str, group: str) -> bool:
    """Whether ``host``'s kernel holds a membership of ``group`` (/proc/net/igmp)."""
    key = ipaddress.IPv4Address(group).packed[::-1].hex().upper()
    lines = bed.run(host, ["cat", "/proc/net/igmp"]).stdout.splitlines()
    return any(line.split()[0] == key for line in lines if line.split())


def _igmp_dropped(bed: Any, host: str) -> int:
    """Packets the ``_drop_igmp`` rule on ``host`` dropped so far."""
    rules = json.loads(bed.run(host, ["nft", "-j", "list", "table", "ip", "tm_test"]).stdout)["nftables"]
    return sum(e["counter"]["packets"] for r in rules if "rule" in r for e in r["rule"]["expr"] if "counter" in e)


def _drop_igmp(bed: Any, host: str) -> None:
    """Drop every IGMP packet ``host`` sends (its membership reports): an nftables table in the
    host's namespace, removed with it (the testbed fixture removes the namespaces, failed test
    or not)."""
    for argv in (
        ["nft", "add", "table", "ip", "tm_test"],
        ["nft", "add", "chain", "ip", "tm_test", "out", "{ type filter hook output priority 0 ; }"],
        ["nft", "add", "rule", "ip", "tm_test", "out", "ip", "protocol", "igmp", "counter", "drop"],
    ):
        done = bed.run(host, argv)
        assert done.returncode == 0, (argv, done.stderr)


@pytest.mark.timeout(300)
def test_a_worker_whose_membership_never_works_receives_its_results_unicast_for_good(testbed, fabric_on) -> None:
    """Multicast result replication, unicast fallback: h1's kernel never gets a membership
    report out (an nftables rule in h1's namespace drops its IGMP), so the bridge never
    forwards the job's group to h1's port, and worker 0 gets every result only by asking again.
    Its renewals of the membership fail (resent results come, none from the group): after
    MAX_FAILED_REJOINS of them in a row it leaves the group and says HELLO without it, within
    (MAX_FAILED_REJOINS + 3) * REJOIN_INTERVAL_S of its first renewal (expected: that many
    intervals, a retransmission timeout, a round of lag in ``progress``); the forwarding node
    sends its results unicast from then on (``members_to_unicast``), the worker renews no
    more, and the 20 rounds after the next one need no resend (every slice of every round, 10
    a round, before; the next round still runs on the initial retransmission timeout, as no
    result the worker got so far was an unambiguous round trip sample). A resend the worker
    finds spurious (its first send was answered, late: measured 6 in one run of 15 at load
    9.6) was not needed and is not counted; workers 1 and 2 keep the group; every sum is
    exact."""
    bed = testbed(hosts=4)
    _drop_igmp(bed, "h1")
    fabric, switch, slices = _three_steady_workers(bed, fabric_on)
    group, progress = group_for(1, switch), fabric.progress
    _wait("worker 0's first renewal", lambda: progress[2] >= 1, 60)
    bound = (MAX_FAILED_REJOINS + 3) * REJOIN_INTERVAL_S
    _wait("worker 0 to fall back to unicast", lambda: progress[3] == 1, bound)
    switched_at, _, renewals, _, _ = progress[:]
    assert not _member(bed, "h1", group)  # it left the group
    _wait("the round after the fallback", lambda: progress[0] >= switched_at + 1, 30)
    counted_from, asked_at, _, _, late_at = progress[:]
    _wait("20 rounds more", lambda: progress[0] >= counted_from + 20, 60)
    asked_after, late_after = progress[1] - asked_at, progress[4] - late_at
    assert "p1" not in _ports_of(bed, group) and {"p2", "p3"} <= _ports_of(bed, group)
    fabric.steady_stop.set()
    out, nodes = fabric.results()
    assert set(out) == {(1, 0), (1, 1), (1, 2)}
    assert all(exact for exact, _, _ in out.values())
    lost = out[(1, 0)][1]
    assert lost["unicast_fallbacks"] == 1 and lost["group"] is None
    assert lost["rejoins"] == renewals == MAX_FAILED_REJOINS  # none after the fallback
    assert lost["failed_rejoins"] == MAX_FAILED_REJOINS
    # a late result on a loaded machine, at most: not 20 rounds' worth (20 * slices)
    assert asked_after - late_after <= 2, (asked_after, late_after, slices, os.getloadavg())
    for rank in (1, 2):
        kept = out[(1, rank)][1]
        assert kept["unicast_fallbacks"] == 0 and kept["group"] == group and kept["results_from_group"] > 0
    sw = nodes["sw"]
    assert sw["members_to_unicast"] == 1 and sw["results_multicast"] >= 20 * slices
    assert _igmp_dropped(bed, "h1") > 0


@pytest.mark.timeout(300)
def test_a_lone_member_answered_unicast_under_loss_keeps_its_group(testbed, fabric_on) -> None:
    """Multicast result replication, unicast fallback, the other side: of a job's two members,
    h1's IGMP is dropped (as above) and worker 0 falls back to unicast, so worker 1 is the
    job's only member and the forwarding node (which multicasts to two or more) answers it
    unicast too. The node drops 3 % of what it sends, so worker 1 keeps asking again and
    renewing its membership, about once a second for the 6 s after the fallback, and while
    worker 0 still straggled it resent every slice for a while; but its results come as the
    parameter node first sent them, not sent again on its request (RETRANSMIT), so none of its
    renewals counts as failed and it keeps the group. (Judged by whether its slices were
    answered at their first send, it failed 1-2 renewals in 3 runs of 3; counting the group's
    copies as success too, in 3 runs of 5.) Every sum is exact."""
    bed = testbed(hosts=3)
    _drop_igmp(bed, "h1")
    fabric = fabric_on(bed)
    ps = (bed.address("h3"), PS_PORT)
    switch = (bed.address("sw"), SWITCH_PORT)
    lossy = FaultPlan(drop=0.03, seed=13)
    fabric.node("h3", functools.partial(ParameterNode, ps[0], ps[1]))
    fabric.node("sw", functools.partial(ForwardingNode, ps, host=switch[0], port=switch[1], faults=lossy))
    for rank in range(2):
        fabric.steady_worker(f"h{rank + 1}", switch, rank, 2, 150_000)
    progress = fabric.progress
    _wait("worker 0 to fall back to unicast", lambda: progress[3] == 1, 60)
    time.sleep(6 * REJOIN_INTERVAL_S)  # worker 1 alone on the group, under loss
    fabric.steady_stop.set()
    out, nodes = fabric.results()
    assert set(out) == {(1, 0), (1, 1)}
    assert all(exact for exact, _, _ in out.values())
    assert out[(1, 0)][1]["unicast_fallbacks"] == 1
    lone = out[(1, 1)][1]
    assert lone["unicast_fallbacks"] == 0 and lone["group"] == group_for(1, switch)
    assert lone["failed_rejoins"] == 0 and lone["rejoins"] > MAX_FAILED_REJOINS, lone
    assert nodes["sw"]["members_to_unicast"] == 1 and nodes["sw"]["transport"]["dropped"] > 0


@pytest.mark.timeout(300)
def test_a_two_level_tree_multicasts_at_each_level_to_its_own_workers_only(testbed, fabric_on) -> None:
    """Multicast result replication in a two-level tree on one segment: workers 0 and 1 under
    the top forwarding node (switch host), workers 2 and 3 under a lower node on host h5; each
    node multicasts to its own group (job and node), the top node reaches the lower node
    unicast (a node is not a member: its HELLOs relay its workers'), and no worker receives a
    result twice; every sum is exact."""
    bed = testbed(hosts=6)
    fabric = fabric_on(bed)
    ps = (bed.address("h6"), PS_PORT)
    top = (bed.address("sw"), SWITCH_PORT)
    lower = (bed.address("h5"), SWITCH_PORT)
    fabric.node("h6", functools.partial(ParameterNode, ps[0], ps[1]))
    fabric.node("sw", functools.partial(ForwardingNode, ps, host=top[0], port=top[1]))
    fabric.node("h5", functools.partial(ForwardingNode, top, host=lower[0], port=lower[1], name="lower"))
    n, rounds = 150_000, 2
    inputs = random_inputs(1, 4, n, rounds, seed=9)
    before = bed.counters()
    for rank in range(4):
        fabric.worker(f"h{rank + 1}", top if rank < 2 else lower, 1, rank, 4, inputs[(1, rank)], None)
    out, nodes = fabric.results()
    assert_exact(inputs, out)
    assert out[(1, 0)][1]["group"] == out[(1, 1)][1]["group"] == group_for(1, top)
    assert out[(1, 2)][1]["group"] == out[(1, 3)][1]["group"] == group_for(1, lower)
    assert nodes["sw"]["results_multicast"] > 0 and nodes["h5"]["results_multicast"] > 0
    assert nodes["sw"]["results_replicated"] > 0  # the copies for the lower node
    for rank in range(4):  # each result once, and once more per slice it asked again for
        stats = out[(1, rank)][1]
        again = stats["retransmits"] + stats["gap_retransmits"]
        assert _down_bytes(bed, before, f"h{rank + 1}") < 1.2 * n * 4 * rounds + again * SLICE_BYTES


def test_multicast_options_are_validated_and_apply_only_where_a_segment_replicates() -> None:
    """Multicast result replication, where it applies: a group range outside 224.0.0.0/4 or in
    the link-local control block is refused at the configuration (the forwarding node's command:
    exit 2, no traceback); on loopback (no multicast
    segment) and on the shared-memory transport the forwarding node keeps unicast and the
    worker joins no group; groups differ per job and per node."""
    for bad in ("10.0.0.0/8", "224.0.0.0/24", "239.1.1.1/31", "not a network"):
        with pytest.raises(ValueError):
            parse_network(bad)
        with pytest.raises(ValueError):
            WorkerConfig(multicast_network=bad)
        with pytest.raises(ValueError):
            ForwardingNode(("127.0.0.1", 9), multicast_network=bad)
    assert parse_network(DEFAULT_NETWORK).is_multicast
    # the CLI repeats the default as a literal (it loads the aggregation package lazily): alike
    cli_default = inspect.signature(cli_aggregation.forwarding_node).parameters["multicast_network"].default
    assert cli_default.default == DEFAULT_NETWORK
    cli = subprocess.run(
        [sys.executable, "-m", "trainmaster", "aggregation", "forwarding-node", "--parent", "127.0.0.1:9"]
        + ["--multicast-network", "10.0.0.0/8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2 and "--multicast-network" in cli.stderr and "Traceback" not in cli.stderr
    node = ("10.0.0.254", 7000)
    assert group_for(1, node) == group_for(1, node)
    assert len({group_for(job, node) for job in range(1, 50)}) > 45
    assert group_for(1, node) != group_for(1, ("10.0.0.5", 7000))
    for transport in ("udp", "shm"):
        switch = ForwardingNode(("127.0.0.1", 9), transport=transport)
        try:
            assert switch.segment is None
            client = AggregationClient(switch.address, 1, 0, 1, transport=transport)
            assert client.group is None
            client.close()
        finally:
            switch.transport.close()
