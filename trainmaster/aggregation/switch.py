"""The forwarding node: a software switch that sums a job's packets in a fixed pool of slots.

Up-going DATA packets with aggregate-at = 0 are summed in the slot named by their resource id
(modulo the pool size). When every worker below this node has contributed, the partial sum goes
up (to a second-level node or to the parameter node) and the slot is freed. Packets that must
not be summed here go up unchanged with aggregate-at = 1: retransmissions (and the partial sum
already held for that slice, so the parameter node can finish it), packets whose slot is held by
another slice (conflict flag), and anything for a slice already diverted. Down-going packets are
multicast to the workers (or lower nodes) named in their bitmap, using routes learned from HELLO:
one copy per next hop, except a RESULT for every worker that joined the job's IP multicast group
from this node's segment, which is sent once to that group for the bridge to replicate
(``multicast.py``).

Slot allocation: by default every job's slices share the whole pool (the spec's dynamic,
multi-tenant slots: slot = resource id mod pool, a slot held by another job is a conflict).
``partitions=k`` splits the pool statically into k equal parts instead, one per job in the order
the jobs first said HELLO (the k+1-th job shares the first part again), and gives a job's
slices the slots of its part round robin by slice index (a window no larger than the part
meets itself only when an early slice is still pending): the static allocation the spec also allows, and the baseline of the
shared-switch benchmark.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from trainmaster.aggregation.accumulator import IntSum
from trainmaster.aggregation.kills import KillPlan
from trainmaster.aggregation.multicast import DEFAULT_NETWORK, group_for, parse_network, segment_of
from trainmaster.aggregation.node import DatagramNode, NodeCounters
from trainmaster.aggregation.protocol import (
    HEADER_SIZE,
    Flag,
    Header,
    Kind,
    bits,
    dtype_flag,
    encode_header_into,
    encode_parts,
    values,
)
from trainmaster.aggregation.transport import Address, FaultPlan, make_transport

Key = tuple[int, int, int]


@dataclass
class _Slot:
    key: Key
    sum: IntSum
    fan_in: int
    since: float
    retained: list[object] = field(default_factory=list)  # received packets the sum reads


@dataclass
class SwitchCounters(NodeCounters):
    aggregated: int = 0
    partials_sent: int = 0
    collisions: int = 0
    flushes: int = 0
    forwarded: int = 0
    duplicates_ignored: int = 0
    slots_released: int = 0
    released_by_abort: int = 0
    results_replicated: int = 0  # RESULT copies sent down: one per worker (or lower node)
    results_multicast: int = 0  # RESULTs sent once to the job's group (the bridge replicates them)
    workers_moved: int = 0  # workers that fell back to the parameter node (MOVED notices)
    # members whose HELLO came again without the group: their results go unicast (multicast.py)
    members_to_unicast: int = 0


@dataclass
class _Job:
    base: int = 0  # its part of the pool: slots base .. base + size - 1
    size: int = 0
    local_mask: int = 0
    routes: dict[int, Address] = field(default_factory=dict)  # worker rank -> next hop down
    # worker rank -> next hop down for acknowledgements (a worker's control socket, or the
    # lower forwarding node its heartbeats came through)
    control_routes: dict[int, Address] = field(default_factory=dict)
    members: int = 0  # workers that receive the job's results from its multicast group


class _RecentKeys:
    """Bounded memory of slices (diverted to the parameter node, or finished)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def add(self, key: Key) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: Key) -> bool:
        return key in self._keys

    def discard_job(self, job: int) -> None:
        """Forget the job's slices (O(capacity): on a job's end or rerun only)."""
        for key in [k for k in self._keys if k[0] == job]:
            del self._keys[key]


class ForwardingNode(DatagramNode):
    """One forwarding node process' state and loop (``serve``)."""

    counters: SwitchCounters

    def __init__(
        self,
        parent: Address,
        slots: int = 64,
        name: str = "switch",
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan | None = None,
        transport: str = "udp",
        kill: KillPlan | None = None,
        index: int = 0,
        mtu: int | None = None,
        partitions: int = 0,
        multicast: bool = True,
        multicast_network: str = DEFAULT_NETWORK,
    ):
        """``index``: this node's place in the fabric (``switch:INDEX`` in a ``KillPlan``);
        ``mtu``: cut packets into datagrams of at most this MTU (see ``UdpTransport``);
        ``partitions``: 0, one pool shared by every job; k, a static split into k parts;
        ``multicast``: send each result once to the job's group for the workers of this node's
        segment that joined it (``multicast.py``; udp on an interface that can, else unicast)."""
        if slots < 1 or slots > 0xFFFF:
            raise ValueError("a forwarding node needs between 1 and 65535 slots")
        if not 0 <= partitions <= slots:
            raise ValueError(f"partitions must be between 0 (one shared pool) and the {slots} slots")
        parse_network(multicast_network)
        super().__init__(make_transport(transport, name, host, port, faults, mtu), kill, "switch", index)
        self.multicast_network = multicast_network
        # the subnet multicast reaches (None: results go unicast)
        self.segment = segment_of(self.address[0]) if multicast and transport == "udp" else None
        if self.segment is not None:
            self.transport.multicast_from(self.address[0])
        self.parent = parent
        self.pool_size = slots
        self.pool: list[_Slot | None] = [None] * slots
        self.partitions = partitions
        self.transport.prepare(parent)
        self.counters = SwitchCounters()
        self.jobs: dict[int, _Job] = {}
        self.diverted = _RecentKeys()
        self.finished = _RecentKeys()

    # ---- up-going -------------------------------------------------------------------------
    def _new_job(self) -> _Job:
        """A job's part of the pool: all of it, or the next static part."""
        if not self.partitions:
            return _Job(0, self.pool_size)
        size = self.pool_size // self.partitions
        return _Job(len(self.jobs) % self.partitions * size, size)

    def _index(self, h: Header) -> int:
        """The aggregator of a packet's slice: its resource id mod the pool, or with static
        partitions the job's part, round robin by slice index."""
        job = self.jobs.get(h.job)
        if not self.partitions or job is None:
            return h.slot % self.pool_size
        return job.base + h.seq % job.size

    def _on_hello(self, h: Header, body: bytes | memoryview, src: Address) -> None:
        job = self.jobs.get(h.job)
        if job is None:
            job = self.jobs[h.job] = self._new_job()
        if any(job.routes.get(rank, src) != src for rank in bits(h.bitmap)):
            # a worker of this job id joins from a new socket: a new run of the id (a rerun);
            # slices remembered from the earlier run would make its slices look like duplicates
            self.finished.discard_job(h.job)
            self.diverted.discard_job(h.job)
        job.local_mask |= h.bitmap
        for rank in bits(h.bitmap):
            job.routes[rank] = src
        if self._joined_group(h.job, body, src):
            job.members |= h.bitmap
        elif job.members & h.bitmap:
            # a member that gave the group up (it never delivered to it): unicast for good
            self.counters.members_to_unicast += bin(job.members & h.bitmap).count("1")
            job.members &= ~h.bitmap
        self.transport.prepare(src)
        self.transport.send(encode_parts(h, body), self.parent)

    def _joined_group(self, job: int, hello: bytes | memoryview, src: Address) -> bool:
        """Whether the HELLO says its worker joined the job's group and came straight from that
        worker (not through a lower node), from inside this node's segment."""
        if self.segment is None or not len(hello):
            return False
        try:
            claim = json.loads(bytes(hello)).get("multicast") or {}
            group, address = claim.get("group"), tuple(claim.get("address") or ())
        except (ValueError, AttributeError, TypeError):
            return False
        return (
            group == group_for(job, self.address, self.multicast_network)
            and address == tuple(src)
            and src[0] != self.address[0]
            and ipaddress.IPv4Address(src[0]) in self.segment.network
        )

    def _forward_up(self, h: Header, body: bytes | memoryview, extra: Flag = Flag.NONE) -> None:
        self.counters.forwarded += 1
        self.transport.send(encode_parts(h.with_(flags=h.flags | Flag.AGGREGATE_AT_PS | extra), body), self.parent)

    def _flush(self, index: int) -> None:
        """Hand a slot's partial sum to the parameter node (a retransmission arrived)."""
        slot = self.pool[index]
        assert slot is not None
        q, overflow = slot.sum.wire()
        job, rnd, seq = slot.key
        flags = Flag.AGGREGATE_AT_PS | dtype_flag(q.dtype) | (Flag.OVERFLOW if overflow else Flag.NONE)
        head = Header(
            Kind.DATA,
            job,
            rnd,
            seq,
            slot.sum.bitmap,
            slot.fan_in,
            index,
            slot.sum.exponent,
            q.size,
            flags,
            peak=slot.sum.top,
        )
        self.transport.send(encode_parts(head, q), self.parent)
        self.counters.flushes += 1
        self._free(index)

    def _free(self, index: int) -> None:
        slot = self.pool[index]
        self.pool[index] = None
        if slot is not None:
            for token in slot.retained:
                self.transport.release(token)
        self.counters.slots_released += 1

    def _on_data(self, h: Header, body: bytes | memoryview) -> None:
        key = h.key
        index = self._index(h)
        slot = self.pool[index]
        holds_key = slot is not None and slot.key == key
        if h.has(Flag.AGGREGATE_AT_PS) or h.has(Flag.RETRANSMIT):
            if holds_key:
                self._flush(index)
            self.diverted.add(key)
            self._forward_up(h, body)
            return
        if key in self.finished:
            self.counters.duplicates_ignored += 1
            return
        if key in self.diverted:
            self._forward_up(h, body)
            return
        if slot is not None and not holds_key:
            self.counters.collisions += 1
            self.diverted.add(key)
            self._forward_up(h, body, Flag.CONFLICT)
            return
        if slot is None:
            slot = _Slot(key, IntSum(), h.fan_in, time.monotonic())
            self.pool[index] = slot
        job = self.jobs.get(h.job)
        local = job.local_mask if job else 0
        completes = local and (slot.sum.bitmap | h.bitmap) & local == local
        # contributions are read where they arrived (no copy) and summed once, at completion
        if not slot.sum.add(values(h, body), h.exponent, h.bitmap, h.has(Flag.OVERFLOW), borrow=True, top=h.peak):
            self.counters.duplicates_ignored += 1
            return
        self.counters.aggregated += 1
        if completes:
            self._complete(index, slot, h)
        else:
            slot.retained.append(self.transport.retain())

    def _complete(self, index: int, slot: _Slot, h: Header) -> None:
        """Every worker below has contributed: sum straight into the packet that goes up (on
        shared memory, the ring space the parent reads), send it, free the slot."""
        n = h.count
        dtype = slot.sum.wire_dtype
        packet = self.transport.packet(self.parent, HEADER_SIZE + dtype.itemsize * n)
        dest = np.frombuffer(packet, dtype, n, HEADER_SIZE)
        _, overflow = slot.sum.wire(out=dest)
        head = Header(
            Kind.DATA,
            h.job,
            h.round,
            h.seq,
            slot.sum.bitmap,
            h.fan_in,
            h.slot,
            slot.sum.exponent,
            n,
            dtype_flag(dtype) | (Flag.OVERFLOW if overflow else Flag.NONE),
            peak=slot.sum.top,
        )
        encode_header_into(packet, head, n)
        del dest
        self._free(index)
        self.transport.send(packet, self.parent)
        self.counters.partials_sent += 1
        self.finished.add(h.key)

    # ---- down-going -----------------------------------------------------------------------
    def _multicast(self, h: Header, body: bytes | memoryview) -> None:
        job = self.jobs.get(h.job)
        if job is None:
            return
        if h.kind == Kind.RESULT and job.members & h.bitmap == job.members and job.members & (job.members - 1):
            # every member is to receive it (two or more): one send, the bridge replicates it;
            # a resend for some of them goes to those alone, unicast
            group = (group_for(h.job, self.address, self.multicast_network), self.address[1])
            self._send_per_hop(h.with_(bitmap=job.members), body, dict.fromkeys(bits(job.members), group))
            self.counters.results_multicast += 1
            h = h.with_(bitmap=h.bitmap & ~job.members)
            if not h.bitmap:
                return
        copies = self._send_per_hop(h, body, job.routes)
        if h.kind == Kind.RESULT:
            self.counters.results_replicated += copies

    def _on_moved(self, h: Header, body: bytes | memoryview) -> None:
        """Workers of this job left this node's subtree (they fell back to the parameter node):
        stop counting them, finish every slot that now holds all remaining workers, and pass
        the notice down their old routes (a lower node that is alive does the same)."""
        job = self.jobs.get(h.job)
        if job is None or not job.local_mask & h.bitmap:
            return
        job.local_mask &= ~h.bitmap
        job.members &= ~h.bitmap
        hops = {job.routes.pop(rank) for rank in bits(h.bitmap) if rank in job.routes}
        self.counters.workers_moved += bin(h.bitmap).count("1")
        for index, slot in enumerate(self.pool):
            if (
                slot is not None
                and slot.key[0] == h.job
                and job.local_mask
                and slot.sum.bitmap & job.local_mask == job.local_mask
                and slot.sum.size
            ):
                _, rnd, seq = slot.key
                size = slot.sum.size
                self._complete(index, slot, Header(Kind.DATA, h.job, rnd, seq, 0, slot.fan_in, index, 0, size))
        for hop in hops:
            self.transport.send(encode_parts(h, body), hop)

    def _acknowledge(self, h: Header, body: bytes | memoryview) -> None:
        """An ACK goes down the way the acknowledged control message came up."""
        job = self.jobs.get(h.job)
        if job is not None:
            self._send_per_hop(h, body, job.control_routes)

    def _on_down(self, h: Header, body: bytes | memoryview) -> None:
        if h.kind == Kind.RESULT:
            key = h.key
            self.finished.add(key)
            index = self._index(h)
            for i in {index} | (
                {i for i, s in enumerate(self.pool) if s and s.key == key} if h.has(Flag.CONFLICT) else set()
            ):
                held = self.pool[i]
                if held is not None and held.key == key:
                    self._free(i)
        elif h.kind == Kind.WELCOME:
            job = self.jobs.get(h.job)
            size = job.size if job is not None else self.pool_size
            h = h.with_(slot=min(h.slot or size, size))
            body = self._lower_budget(h.job, body)
        elif h.kind == Kind.ABORT:
            self._release_job(h.job)
        self._multicast(h, body)

    def _lower_budget(self, job_id: int, welcome: bytes | memoryview) -> bytes:
        """The WELCOME's per-worker in-flight budget, lowered to this node's share of its
        receive buffer for each of the job's workers below it."""
        job = self.jobs.get(job_id)
        try:
            info = json.loads(bytes(welcome)) if len(welcome) else {}
        except ValueError:
            return bytes(welcome)
        below = bin(job.local_mask).count("1") if job else 1
        mine = self.transport.buffer_per_sender(below)
        info["buffer_per_worker"] = min(int(info.get("buffer_per_worker", mine)), mine)
        return json.dumps(info).encode()

    def _release_job(self, job: int) -> None:
        for i, slot in enumerate(self.pool):
            if slot is not None and slot.key[0] == job:
                self._free(i)
                self.counters.released_by_abort += 1
        self.diverted.discard_job(job)

    # ---- loop -----------------------------------------------------------------------------
    def slots_in_use(self) -> int:
        return sum(1 for s in self.pool if s is not None)

    def stats(self) -> dict[str, object]:
        return {
            "role": "switch",
            "pool": self.pool_size,
            "partitions": self.partitions,
            "slots_in_use": self.slots_in_use(),
            **self.counters.__dict__,
            "transport": self.transport.counters.as_dict(),
        }

    def _dispatch(self, h: Header, body: bytes | memoryview, src: Address) -> None:
        if h.kind == Kind.DATA:
            self._on_data(h, body)
        elif h.kind in (Kind.HELLO,):
            self._on_hello(h, body, src)
        elif h.kind in (Kind.HEARTBEAT, Kind.BYE):
            # forwarded as it is: the worker retransmits it until the parameter node's ACK
            # comes back, which follows the route learned here
            job = self.jobs.get(h.job)
            if job is None:
                job = self.jobs[h.job] = self._new_job()
            for rank in bits(h.bitmap):
                job.control_routes[rank] = src
            self.transport.send(encode_parts(h, body), self.parent)
        elif h.kind == Kind.ACK:
            self._acknowledge(h, body)
        elif h.kind == Kind.MOVED:
            self._on_moved(h, body)
        elif h.kind in (Kind.RESULT, Kind.EXCEPTION, Kind.WELCOME, Kind.ABORT):
            self._on_down(h, body)
        else:
            self._on_control(h, src)
