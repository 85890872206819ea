"""The parameter node: verifies forwarding-node sums and aggregates whatever they could not.

For every slice it keeps an integer sum built only from contributions with disjoint worker
bitmaps (complete sums from a forwarding node, flushed partial sums, retransmitted, conflicting
or diverted packets alike). When the bitmap is complete it verifies overflow: a clean sum goes
down flagged VERIFIED (and is cached, so a worker that lost it gets it again on retransmit); an
overflowed one triggers the exception-retransmit instruction and a float sum. A job whose
workers asked for int8 results (their HELLO says) gets each verified integer sum re-quantised
to int8 by stochastic rounding, at a scale the RESULT's header carries: the sums are checked
exact first, and the float path is unchanged. It also watches
worker liveness: a worker that falls silent while its job waits fails the job with a clear
message to the other workers, and every forwarding node frees the job's slots.

Liveness is judged from control traffic only (HELLO, HEARTBEAT, BYE), which workers retransmit
until this node acknowledges it (ACK): data packets may be lost by the thousand under heavy
loss without making a live worker look silent, and a worker that said BYE is known to have left
even if the first copies of its BYE were dropped. A worker on this host is watched through its
process: one that exited is dead, one that is stopped (SIGSTOP) and silent for ``stalled_after``
seconds is stalled; either is named in the abort.
"""

from __future__ import annotations

import json
import os
import select
import time
from dataclasses import dataclass, field

import numpy as np

from trainmaster.aggregation.accumulator import FloatSum, IntSum
from trainmaster.aggregation.kills import KillPlan
from trainmaster.aggregation.node import DatagramNode, NodeCounters
from trainmaster.aggregation.protocol import (
    Flag,
    Header,
    Kind,
    bits,
    dtype_flag,
    encode,
    full_mask,
    values,
)
from trainmaster.aggregation.quantize import requantize_int8
from trainmaster.aggregation.transport import Address, FaultPlan, make_transport
from trainmaster.aggregation.worker import host_identity


@dataclass
class _Slice:
    ints: IntSum = field(default_factory=IntSum)
    floats: FloatSum | None = None  # set once the slice is on the exception path
    conflict: bool = False
    slot: int = 0
    # the RESULT, kept for workers that lost it: its values, or their shared-store reference
    result: tuple[Header, bytes | np.ndarray] | None = None


@dataclass
class _Job:
    fan_in: int
    registered: int = 0
    left: int = 0
    routes: dict[int, Address] = field(default_factory=dict)
    last_seen: dict[int, float] = field(default_factory=dict)
    slices: dict[tuple[int, int], _Slice] = field(default_factory=dict)
    newest_round: int = 0
    pool: int = 0
    busy_round: int = 0  # newest round a heartbeat said some worker is waiting in
    busy: int = 0  # workers whose newest heartbeat said they wait inside allreduce
    beat_seq: dict[int, int] = field(default_factory=dict)  # rank -> newest heartbeat seq
    contributed: dict[int, int] = field(default_factory=dict)  # rank -> newest round it sent
    failed: str | None = None
    processes: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (pid, pidfd)
    answered_round: int = 0  # newest round with a result: every worker finished the ones before
    shared: list[tuple[int, bytes]] = field(default_factory=list)  # (round, result-store ref)
    moved_from: dict[int, Address] = field(default_factory=dict)  # rank -> its old next hop
    # how the verified integer sums go down (the workers' HELLO says): "exact", as summed, or
    # "int8", re-quantised with stochastic rounding (``requantize_int8``)
    results: str = "exact"

    @property
    def all_local(self) -> bool:
        """Every worker runs on this node's host (watched through its process)."""
        return len(self.processes) == self.fan_in


@dataclass
class ParameterNodeCounters(NodeCounters):
    pieces_merged: int = 0
    duplicates_ignored: int = 0
    verified: int = 0
    completeness_failures: int = 0
    overflow_fallbacks: int = 0
    conflicts_aggregated: int = 0
    retransmits_seen: int = 0
    results_resent: int = 0
    results_sent: int = 0  # RESULT packets of first answers: one per next hop, not per worker
    results_shared: int = 0  # verified sums multicast as references to the shared store
    results_requantised: int = 0  # integer sums sent down as int8 (the job asked for it)
    jobs_failed: int = 0
    jobs_ended: int = 0  # every worker said BYE (the BYEs arrived, however lossy the network)
    control_acks: int = 0  # HEARTBEAT / BYE copies acknowledged


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, or traced): state T/t in /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] in (b"T", b"t")


class ParameterNode(DatagramNode):
    counters: ParameterNodeCounters
    poll_interval = 0.1  # liveness is checked every 0.25 s

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan | None = None,
        dead_after: float = 10.0,
        name: str = "ps",
        transport: str = "udp",
        stalled_after: float = 2.0,
        kill: KillPlan | None = None,
        mtu: int | None = None,
    ):
        super().__init__(make_transport(transport, name, host, port, faults, mtu), kill, "ps")
        self.host = host_identity()
        self.dead_after = dead_after
        self.stalled_after = stalled_after
        self.jobs: dict[int, _Job] = {}
        self.counters = ParameterNodeCounters()
        now = time.monotonic()
        self._next_check = now + 0.25  # next liveness check
        self._last_idle = now  # last time the socket was drained

    # ---- sending down ---------------------------------------------------------------------
    def _down(self, job: _Job, h: Header, payload: bytes | np.ndarray, *, control: bool = False) -> int:
        """Send to the workers in ``h.bitmap``, one packet per next hop (a forwarding node
        replicates it to its workers); returns the number of packets sent."""
        return self._send_per_hop(h, payload, job.routes, control=control)

    # ---- up-going -------------------------------------------------------------------------
    def _on_hello(self, h: Header, body: bytes | memoryview, src: Address) -> None:
        job = self.jobs.get(h.job)
        # a failed job, another world size, or a worker that said BYE joining again: the job id
        # is being used again (a rerun), so it is a new job whose rounds start from the first
        if job is None or job.failed or job.fan_in != h.fan_in or job.left & h.bitmap:
            if job is not None:
                self._close_watches(job)
                self._retire(job)
            job = self.jobs[h.job] = _Job(h.fan_in)
        job.registered |= h.bitmap
        worker = self._hello_info(body)
        if worker.get("results") in ("exact", "int8"):
            job.results = str(worker["results"])  # the job's workers are configured alike
        now = time.monotonic()
        self.transport.prepare(src)
        for rank in bits(h.bitmap):
            old = job.routes.get(rank)
            if job.pool and old is not None and old != src:
                job.moved_from[rank] = old  # a welcomed worker now comes another way
            job.routes[rank] = src
            job.last_seen[rank] = now
            self._watch(job, rank, worker)
            if rank in job.moved_from and job.moved_from[rank] != src:
                # tell the old route, on every HELLO of the move (one may be lost): its
                # forwarding node must not wait for this worker in its slots any more
                self.transport.send(
                    encode(Header(Kind.MOVED, h.job, bitmap=1 << rank, fan_in=job.fan_in)), job.moved_from[rank]
                )
        if job.registered == full_mask(job.fan_in):
            # the WELCOME is the job's barrier: every forwarding node now knows every route.
            # It names this node, where workers fall back when their forwarding node dies (a
            # HELLO straight from a worker moves its route here).
            target = full_mask(job.fan_in) if job.pool == 0 else h.bitmap
            job.pool = 1
            # ... and how much each worker may have in flight towards this node (the
            # forwarding nodes lower it to what their own buffers allow)
            info: dict[str, object] = {
                "parameter_node": list(self.address),
                "buffer_per_worker": self.transport.buffer_per_sender(job.fan_in),
            }
            me = json.dumps(info).encode()
            self._down(job, Header(Kind.WELCOME, h.job, bitmap=target, fan_in=job.fan_in), me)

    def _on_data(self, h: Header, body: bytes | memoryview, src: Address) -> None:
        job = self.jobs.get(h.job)
        if job is None:
            return
        if job.failed:
            head = Header(Kind.ABORT, h.job, bitmap=h.bitmap, fan_in=job.fan_in)
            self._down(job, head, job.failed.encode())
            return
        for rank in bits(h.bitmap):  # data says who contributed, never who is alive
            job.contributed[rank] = max(job.contributed.get(rank, 0), h.round)
        if h.round + 1 < job.newest_round or h.round < job.answered_round:
            return  # a slice every worker already finished; nobody can be waiting for it
        if h.round > job.newest_round:
            job.newest_round = h.round
            for key in [k for k in job.slices if k[0] + 1 < h.round]:
                del job.slices[key]
        sl = job.slices.setdefault((h.round, h.seq), _Slice(slot=h.slot))
        if h.has(Flag.RETRANSMIT):
            self.counters.retransmits_seen += 1
        if sl.result is not None:
            if h.has(Flag.RETRANSMIT):
                # flagged: a worker tells a result it asked for from a first one (multicast.py)
                self.counters.results_resent += 1
                head, payload = sl.result
                self._down(job, head.with_(bitmap=h.bitmap, flags=head.flags | Flag.RETRANSMIT), payload)
            else:
                self.counters.duplicates_ignored += 1
            return
        if h.has(Flag.CONFLICT) and not sl.conflict:
            sl.conflict = True
            self.counters.conflicts_aggregated += 1
        full = full_mask(job.fan_in)
        if h.has(Flag.FLOAT):
            if sl.floats is None:
                sl.floats = FloatSum()
            if not sl.floats.add(values(h, body), h.bitmap, h.peak):
                self.counters.duplicates_ignored += 1
                return
            self.counters.pieces_merged += 1
            total = sl.floats.values  # set by the add just accepted
            if sl.floats.bitmap == full and total is not None:
                self._finish(job, h, sl, total.astype(np.float32), 0, sl.floats.top)
            return
        if sl.floats is not None:
            # the slice is on the exception path: this sender missed the instruction
            self._down(job, h.with_(kind=Kind.EXCEPTION, flags=Flag.NONE, count=0), b"")
            return
        # a complete sum in one piece is verified where it lies (and copied once, into the
        # kept result); any other piece is copied into the slice's own sum
        borrow = not sl.ints.bitmap and h.bitmap == full
        if not sl.ints.add(values(h, body), h.exponent, h.bitmap, h.has(Flag.OVERFLOW), borrow=borrow, top=h.peak):
            self.counters.duplicates_ignored += 1
            return
        self.counters.pieces_merged += 1
        self._verify(job, h, sl, src)

    @staticmethod
    def _workers_behind(job: _Job, hop: Address) -> int:
        """Bitmap of the workers whose route from here goes through ``hop``."""
        mask = 0
        for rank, route in job.routes.items():
            if route == hop:
                mask |= 1 << rank
        return mask

    def _verify(self, job: _Job, h: Header, sl: _Slice, src: Address) -> None:
        full = full_mask(job.fan_in)
        if sl.ints.bitmap != full:
            # Completeness of a forwarding node's sum is judged against the workers behind
            # that node (two sibling nodes under this one each send a sum complete for their
            # own workers): only a sum lacking one of the sender's workers is a failure.
            if not h.has(Flag.AGGREGATE_AT_PS) and h.bitmap & self._workers_behind(job, src) != self._workers_behind(
                job, src
            ):
                self.counters.completeness_failures += 1
            return
        q, overflow = sl.ints.wire()
        if overflow:
            self.counters.overflow_fallbacks += 1
            sl.ints.forget_values()  # void (perhaps borrowed): the slice goes on as floats
            sl.floats = FloatSum()
            self._down(job, Header(Kind.EXCEPTION, h.job, h.round, h.seq, full, job.fan_in, h.slot), b"")
            return
        self._finish(job, h, sl, q, sl.ints.exponent, sl.ints.top)

    def _finish(self, job: _Job, h: Header, sl: _Slice, payload: np.ndarray, exponent: int, top: int) -> None:
        """Multicast the verified sum (``payload``: integers at ``exponent``, or floats) with
        the largest magnitude any worker sent for the slice (``top``: the next round's shared
        scale)."""
        self.counters.verified += 1
        if h.round > job.answered_round:
            # a result of this round means every worker has finished every earlier round
            job.answered_round = h.round
            self._retire(job, h.round)
        if job.results == "int8" and payload.dtype.kind == "i":
            # the way down as small as the way up: every worker receives the sum, so at the
            # workers' links it weighs as much as all the int8 slices that went up together
            payload, exponent = requantize_int8(payload, exponent, (h.job, h.round, h.seq))
            self.counters.results_requantised += 1
        slot = sl.slot
        flags = Flag.VERIFIED | dtype_flag(payload.dtype)
        if sl.conflict:
            # an updated resource id, so that this slice's next allocation lands elsewhere
            slot = (sl.slot + 1 + (h.job * 7 + h.seq * 13) % 251) & 0xFFFF
            flags |= Flag.CONFLICT
        body, where = self._keep(job, h.round, payload)
        head = Header(
            Kind.RESULT,
            h.job,
            h.round,
            h.seq,
            full_mask(job.fan_in),
            job.fan_in,
            slot,
            exponent,
            payload.size,
            flags | where,
            peak=top,
        )
        self.counters.results_sent += self._down(job, head, body)
        sl.result = (head, body)  # kept for workers that lost it
        sl.ints = IntSum()
        sl.floats = None

    def _keep(self, job: _Job, rnd: int, payload: np.ndarray) -> tuple[bytes | np.ndarray, Flag]:
        """Where a verified result lives while workers may still need it.

        When every worker of the job is on this host and the transport has a shared result
        store, the values are written there once and the RESULT carries a reference: the
        forwarding nodes multicast a few bytes instead of copying the payload once per worker,
        and each worker reads the values in place. Otherwise this node keeps its own copy."""
        if job.all_local:
            got = self.transport.share(payload.nbytes)
            if got is not None:
                view, ref = got
                np.copyto(np.frombuffer(view, payload.dtype, payload.size), payload)
                job.shared.append((rnd, ref))
                self.counters.results_shared += 1
                return ref, Flag.SHARED
        return (payload if payload.flags.owndata else payload.copy()), Flag.NONE

    def _retire(self, job: _Job, before: int | None = None) -> None:
        """Forget the results of rounds before ``before`` (all of them if None): free their
        shared-store space and their slices."""
        keep = []
        for rnd, ref in job.shared:
            if before is None or rnd < before:
                self.transport.unshare(ref)
            else:
                keep.append((rnd, ref))
        job.shared = keep
        for key in [k for k in job.slices if before is None or k[0] < before]:
            del job.slices[key]

    # ---- liveness -------------------------------------------------------------------------
    @staticmethod
    def _hello_info(hello: bytes | memoryview) -> dict[str, object]:
        """What a worker's HELLO says about it (pid, host, the results it wants); {} if
        unreadable."""
        try:
            me = json.loads(bytes(hello)) if len(hello) else {}
        except ValueError:
            return {}
        return me if isinstance(me, dict) else {}

    def _watch(self, job: _Job, rank: int, me: dict[str, object]) -> None:
        """Watch the worker's process when it runs where this node can see it (same boot and
        pid namespace, from its HELLO): its exit is then noticed at once, not after silence."""
        pid = me.get("pid")
        if not self.host or me.get("host") != self.host or not isinstance(pid, int):
            return
        old = job.processes.get(rank)
        if old is not None:
            if old[0] == pid:
                return  # a repeated HELLO
            if old[1] >= 0:
                os.close(old[1])  # the rank re-joined from another process
            del job.processes[rank]
        try:
            job.processes[rank] = (pid, os.pidfd_open(pid))
        except ProcessLookupError:
            job.processes[rank] = (pid, -1)  # already gone
        except (OSError, AttributeError):
            pass  # no pidfd on this kernel: silence detection only

    @staticmethod
    def _exited(job: _Job, rank: int) -> bool:
        pid, fd = job.processes.get(rank, (0, 0))
        if not pid:
            return False
        return fd < 0 or bool(select.select([fd], [], [], 0)[0])  # readable once it exited

    def _end(self, job_id: int, job: _Job) -> None:
        """Forget a job every worker has left (a failed one stays listed with its reason)."""
        self._close_watches(job)
        self._retire(job)
        del self.jobs[job_id]
        self.counters.jobs_ended += 1

    @staticmethod
    def _close_watches(job: _Job) -> None:
        for _, fd in job.processes.values():
            if fd >= 0:
                os.close(fd)
        job.processes.clear()

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for job_id, job in self.jobs.items():
            if job.failed or job.registered != full_mask(job.fan_in):
                continue
            # A worker that left cleanly had every result, so it is only missed in a later round.
            # A dead one (its process exited, or silent for dead_after) is missed if a slice
            # still lacks it or another worker waits.
            pending = [
                sl.ints.bitmap | (sl.floats.bitmap if sl.floats else 0)
                for sl in job.slices.values()
                if sl.result is None
            ]
            lost: dict[int, str] = {}
            for r in bits(job.registered):
                if job.left >> r & 1:
                    if job.busy_round > job.contributed.get(r, 0):
                        lost[r] = "left"
                    continue
                missed = any(not (b >> r & 1) for b in pending) or job.busy & ~(1 << r)
                if not missed:
                    continue
                silent = now - job.last_seen.get(r, now)
                if r in job.processes:
                    # watched: its process is the truth, a slow (starved) worker is not dead,
                    # a stopped one (SIGSTOP) will not go on by itself
                    pid = job.processes[r][0]
                    if self._exited(job, r):
                        lost[r] = "its process exited"
                    elif silent > self.stalled_after and process_stopped(pid):
                        lost[r] = f"its process {pid} is stopped, silent {silent:.1f} s"
                elif silent > self.dead_after:
                    lost[r] = f"silent {silent:.1f} s"
            if lost:
                self._fail(job_id, job, lost)

    def _fail(self, job_id: int, job: _Job, lost: dict[int, str]) -> None:
        ages = ", ".join(f"worker {r} ({why})" for r, why in lost.items())
        job.failed = (
            f"job {job_id}: {ages}; the reduction cannot complete, so the parameter "
            f"node aborted it and the forwarding nodes released its slots"
        )
        self.counters.jobs_failed += 1
        head = Header(Kind.ABORT, job_id, bitmap=full_mask(job.fan_in), fan_in=job.fan_in)
        self._down(job, head, job.failed.encode())
        self._retire(job)
        self._close_watches(job)

    # ---- loop -----------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        return {
            "role": "ps",
            **self.counters.__dict__,
            "jobs_failed_reasons": [j.failed for j in self.jobs.values() if j.failed],
            "transport": self.transport.counters.as_dict(),
        }

    def _ack(self, h: Header, src: Address) -> None:
        """Acknowledge a control message to the hop it came from (idempotent: every copy)."""
        ack = Header(Kind.ACK, h.job, h.round, h.seq, h.bitmap, h.fan_in, int(h.kind))
        self.counters.control_acks += 1
        self.transport.send(encode(ack), src)

    def _dispatch(self, h: Header, body: bytes | memoryview, src: Address) -> None:
        if h.kind == Kind.DATA:
            self._on_data(h, body, src)
        elif h.kind == Kind.HELLO:
            self._on_hello(h, body, src)
        elif h.kind == Kind.HEARTBEAT:
            self._ack(h, src)
            job = self.jobs.get(h.job)
            if job is not None:
                now = time.monotonic()
                for rank in bits(h.bitmap):
                    job.last_seen[rank] = now
                    if h.seq <= job.beat_seq.get(rank, -1):
                        continue  # a retransmitted or overtaken beat: its busy state is old
                    job.beat_seq[rank] = h.seq
                    job.busy = job.busy | 1 << rank if h.round else job.busy & ~(1 << rank)
                job.busy_round = max(job.busy_round, h.round)
        elif h.kind == Kind.BYE:
            self._ack(h, src)  # every copy: the ack of an earlier one may have been lost
            job = self.jobs.get(h.job)
            if job is not None:
                job.left |= h.bitmap
                job.busy &= ~h.bitmap
                if job.left == full_mask(job.fan_in) and not job.failed:
                    self._end(h.job, job)
        else:
            self._on_control(h, src)

    def _run_timers(self, received: bool) -> None:
        now = time.monotonic()
        if not received:
            self._last_idle = now
        # judge silence only with the socket drained (or after dead_after without a quiet
        # moment): if this node itself was stalled, the heartbeats it has not read yet
        # would otherwise make every worker look dead
        if now >= self._next_check and (not received or now - self._last_idle > self.dead_after):
            self._check_liveness()
            self._next_check = now + 0.25
