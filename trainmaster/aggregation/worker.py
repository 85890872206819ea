"""The worker client: ``allreduce(array) -> array`` through forwarding and parameter nodes.

The tensor is cut into slices of ``chunk`` elements; at most ``window`` slices are in flight (no
more than the pool of slots, and no more than the receive buffer holds). Each slice is quantised
and sent with aggregate-at = 0. A slice whose result does not come back within the retransmit
timeout, or that ``gap_threshold`` later slices overtook, is sent again with the retransmit flag
and aggregate-at = 1. An exception-retransmit instruction makes the worker resend that slice as
float32. A heartbeat thread keeps the parameter node aware that this worker is alive.

Low-bit aggregation (``WorkerConfig(quantizer=SharedScale(8))``, or ``precision="int8"``): the
client keeps, per tensor (the ``key`` of ``allreduce``), the largest magnitude the job's workers
sent for each slice in the previous round (every RESULT carries it) and this worker's rounding
error (error feedback). The next all-reduce of that tensor quantises each slice, input plus
carried error, with the exponent every worker derives from that magnitude: the same for all of
them, agreed without a message of its own. The sums come down as int16 (exact); with
``results="int8"`` (the default of an int8 job) the parameter node re-quantises each verified
sum to int8 with a scale of its own, by stochastic rounding (``quantize.requantize_int8``):
every worker receives half the bytes, and the result, unbiased, is within one more unit of
that scale (``last_error_bound`` includes it).

Control messages are reliable: the heartbeat thread owns a second socket (the *control*
socket) and retransmits each HEARTBEAT every ``control_retry`` seconds until the parameter node
acknowledges it (ACK, routed back through the forwarding nodes); ``close`` does the same for
BYE. The acknowledgements are also this worker's view of the fabric, and so are the results
that come down (a result is the whole path answering): when neither has come for
``failover_after`` seconds the forwarding node is taken for dead and the worker falls back to
the parameter node directly (HELLO there moves its route; every slice then goes with
aggregate-at = 1, as on the collision path); when the parameter node does not answer either for
``parameter_node_dead_after`` more seconds, the reduction fails with an error naming it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainmaster.aggregation.kills import KillPlan, Trigger
from trainmaster.aggregation.memory import tune_allocator
from trainmaster.aggregation.multicast import (
    DEFAULT_NETWORK,
    MAX_FAILED_REJOINS,
    REJOIN_INTERVAL_S,
    group_for,
    parse_network,
    segment_of,
)
from trainmaster.aggregation.protocol import (
    HEADER_SIZE,
    MAX_ELEMENTS,
    MAX_WORKERS,
    NO_PEAK,
    Flag,
    Header,
    Kind,
    ProtocolError,
    decode,
    encode,
    encode_header_into,
    peak_exponent,
    slot_id,
    values,
)
from trainmaster.aggregation.quantize import (
    BLOCK,
    BlockFloat,
    Quantizer,
    SharedScale,
    dequantize_into,
    error_bound,
    peak_magnitude,
    quantize_into,
)
from trainmaster.aggregation.transport import Address, Buffer, FaultPlan, make_transport

# elements per slice: on udp 64 KiB (the per-packet cost of Python is paid 4x less often than
# with 16 KiB, measured in bench/aggregation_hotpath.py; the transport cuts a slice into
# datagrams that fit the path's MTU and hands 64 KiB to the kernel per system call), on shm
# 4 MiB
DEFAULT_CHUNK = {"udp": MAX_ELEMENTS, "shm": 1 << 20}
log = logging.getLogger(__name__)
PRECISIONS = ("int32", "int16", "int8")
# how the sums come down: as the nodes summed them, or re-quantised to int8 by the parameter node
RESULT_PRECISIONS = ("exact", "int8")


def quantizer_for(precision: str) -> Quantizer:
    """The quantiser a job's ``precision`` names: ``int32`` (block floating point, the
    default), ``int16`` or ``int8`` (low-bit aggregation with a shared scale and error
    feedback)."""
    if precision == "int32":
        return BlockFloat()
    if precision == "int16":
        return SharedScale(16)
    if precision == "int8":
        return SharedScale(8)
    raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


def host_identity() -> str:
    """Boot id and pid namespace: two processes with the same identity can see each other's
    pids, so a node may watch a worker's process instead of waiting for its silence."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


class AggregationError(RuntimeError):
    """The reduction cannot complete (a worker died, the fabric is unreachable)."""


class WorkerLostError(AggregationError):
    """Another worker of the job stopped; raised at every surviving worker."""


@dataclass
class WorkerCounters:
    packets_sent: int = 0
    retransmits: int = 0
    gap_retransmits: int = 0
    float_resends: int = 0
    duplicates_ignored: int = 0
    results: int = 0
    fallbacks_to_parameter_node: int = 0  # the forwarding node stopped answering
    window_cuts: int = 0  # congestion window halved after a loss
    # retransmissions whose slice's result came back sooner than any round trip could after
    # them: the first send was answered, the loss was a delay (the window cut is undone)
    spurious_retransmits: int = 0
    stale_results: int = 0  # shared-store references whose space was reused before reading
    low_bit_slices: int = 0  # slices sent as int8/int16 with the job's shared scale (first sends)
    rejoins: int = 0  # the job's group left and joined again after a retransmission (multicast.py)
    results_from_group: int = 0  # RESULTs that came from the job's multicast group
    # renewals after which resent results came, none from the group (multicast.py)
    failed_rejoins: int = 0
    # 1 once the worker left the group for good and asked for its results unicast
    unicast_fallbacks: int = 0
    elements_reduced: int = 0
    seconds_in_allreduce: float = 0.0


@dataclass
class _InFlight:
    seq: int
    start: int
    stop: int
    sent_at: float
    rto: float
    floats: bool = False
    acks_after: int = 0
    gap_resent: bool = False
    sends: int = 0
    last_sent_packet: int = 0  # the worker's packets_sent count when this slice last went
    peak: float = 0.0  # the slice's largest magnitude (of what this worker sends)
    first_sent_at: float = 0.0
    resent_at: float = 0.0  # when it was last sent again after a timeout or a gap
    cwnd_before: float = 0.0  # the window its loss halved (0: its loss cut nothing)


@dataclass
class _Stream:
    """What low-bit aggregation carries from one all-reduce of a tensor to the next.

    ``peaks``: per slice, the largest magnitude (``Header.peak``) any worker sent in the last
    round (``NO_PEAK``: no round yet: the slice goes as int32); ``margins`` / ``clean``: per
    slice, the bits kept free above it and the rounds since it last overflowed
    (``SharedScale.next_margin``); ``residual``: this worker's rounding error per element,
    added to the next input (error feedback); ``carried``: per slice, the bound of every
    worker's carried error (the result's error bound includes it)."""

    size: int
    peaks: np.ndarray
    margins: np.ndarray
    clean: np.ndarray
    residual: np.ndarray
    sent: np.ndarray  # the input plus the carried error: what this round quantises
    carried: np.ndarray

    @classmethod
    def empty(cls, size: int, slices: int, margin: int) -> _Stream:
        return cls(
            size,
            np.full(slices, NO_PEAK, np.int16),
            np.full(slices, margin, np.int8),
            np.zeros(slices, np.int16),
            np.zeros(size, np.float32),
            np.empty(size, np.float32),
            np.zeros(slices, np.float32),
        )


@dataclass
class WorkerConfig:
    chunk: int | None = None  # elements per slice; None: DEFAULT_CHUNK of the transport
    window: int = 64
    # initial, then adapted to the measured round trip; None: 0.2 s on udp, 1 s on shm (a first
    # megabyte slice under load can take that long, and resending it only adds work)
    retransmit_timeout: float | None = None
    # None: 0.05 s on udp; 0.2 s on shm, where nothing is lost but injected faults and a
    # spurious retransmission of a megabyte slice costs more than waiting
    min_retransmit_timeout: float | None = None
    max_retransmit_timeout: float = 1.0
    gap_threshold: int = 16
    # AIMD send window between 1 and ``window``: halved when a slice is lost (at most once per
    # window of sends), grown by one slice per window of results. On a capped link the queue
    # in front of it (e.g. a tbf qdisc) is what drops packets; a fixed window of 64 KiB
    # datagrams would overflow it on every reduction. False: always the full window.
    congestion_control: bool = True
    timeout: float = 30.0  # no progress for this long -> AggregationError
    heartbeat: float = 0.5
    control_retry: float = 0.1  # resend an unacknowledged HEARTBEAT / BYE after this long
    # no acknowledgement through the forwarding node for this long: go to the parameter node
    failover_after: float = 3.0
    # ... and none from the parameter node directly for this long more: the job fails
    parameter_node_dead_after: float = 10.0
    bye_timeout: float = 2.0  # how long ``close`` retransmits BYE waiting for its ACK
    # where to fall back; None: the address the parameter node's WELCOME names
    parameter_node: Address | None = None
    quantizer: Quantizer = field(default_factory=BlockFloat)
    # how the parameter node sends the sums down (RESULT_PRECISIONS): "exact", or "int8"
    # (re-quantised, unbiased, one more unit of error); None: "int8" for an int8 job
    # (``SharedScale(8)``), "exact" otherwise. Every worker of a job is configured alike.
    results: str | None = None
    # keep freed megabyte buffers in this process' heap (see memory.py): no page faults per slice
    tune_allocator: bool = True
    # receive the job's results from its multicast group (multicast.py): the forwarding node
    # sends each result once and the bridge replicates it. Applies over udp on an interface
    # that can (not loopback); elsewhere, or if the node does not, results come unicast.
    multicast: bool = True
    multicast_network: str = DEFAULT_NETWORK  # where the jobs' groups are; alike at every node

    def __post_init__(self) -> None:
        parse_network(self.multicast_network)

    @property
    def result_precision(self) -> str:
        """``results``, with its default resolved."""
        if self.results is not None:
            return self.results
        low8 = isinstance(self.quantizer, SharedScale) and self.quantizer.bits == 8
        return "int8" if low8 else "exact"


class AggregationClient:
    """One worker of one job. Not thread-safe: one ``allreduce`` at a time."""

    def __init__(
        self,
        switch: Address,
        job: int,
        rank: int,
        world: int,
        config: WorkerConfig | None = None,
        faults: FaultPlan | None = None,
        host: str = "127.0.0.1",
        transport: str = "udp",
        kill: KillPlan | None = None,
        mtu: int | None = None,
    ):
        """``mtu``: cut packets into datagrams of at most this MTU (see ``UdpTransport``)."""
        if not 0 <= rank < world <= MAX_WORKERS:
            raise ValueError(f"rank {rank} / world {world}: need 0 <= rank < world <= {MAX_WORKERS}")
        self.config = config or WorkerConfig()
        if self.config.result_precision not in RESULT_PRECISIONS:
            raise ValueError(f"results {self.config.results!r}: choose one of {', '.join(RESULT_PRECISIONS)}")
        if self.config.tune_allocator:
            tune_allocator()
        self.transport = make_transport(transport, f"worker{job}.{rank}", host, 0, faults, mtu)
        self._control = make_transport("udp", f"worker{job}.{rank}-control", host, 0, faults, mtu)
        # slices must line up across the job's workers: configure all of them alike
        self.chunk = self.config.chunk or DEFAULT_CHUNK[transport]
        default_rto, default_floor = (0.2, 0.05) if transport == "udp" else (1.0, 0.2)
        cfg = self.config
        self.min_rto = cfg.min_retransmit_timeout if cfg.min_retransmit_timeout is not None else default_floor
        # without a configured timeout the first slices' one must not undercut the floor
        self.initial_rto = (
            cfg.retransmit_timeout if cfg.retransmit_timeout is not None else max(default_rto, self.min_rto)
        )
        limit = (self.transport.max_packet - HEADER_SIZE) // 4
        if not 1 <= self.chunk <= limit:
            self.transport.close()
            self._control.close()
            raise ValueError(f"chunk must be between 1 and {limit} elements on the {transport} transport")
        self.switch, self.job, self.rank, self.world = switch, job, rank, world
        # the job's group, joined before the HELLO says so (the forwarding node's port)
        self.group: str | None = None
        if self.config.multicast and transport == "udp" and segment_of(self.transport.address[0]) is not None:
            group = group_for(job, switch, self.config.multicast_network)
            if self.transport.join(group, switch[1]):
                self.group = group
        self._rejoin_at = 0.0  # when a retransmission may next renew the group's membership
        # RESULTs as the parameter node first sent them, and those it sent again because this
        # worker asked (its RETRANSMIT flag), of any slice
        self._first_results = self._resent_results = 0
        self._renewed: tuple[int, int] | None = None  # both at the last renewal; None: none yet
        self._failed_in_row = 0  # renewals in a row judged failed (multicast.py)
        # ``_first_results`` when the worker gave the group up; the HELLO that says so is
        # repeated until a first result comes (unicast) after it. None: a member, or confirmed
        self._left_group_at: int | None = None
        self.parameter_node: Address | None = self.config.parameter_node
        self.target = switch  # where data goes: the forwarding node, or the parameter node
        self._kill = Trigger(kill if kill is not None and kill.aims_at("worker", rank) else None)
        self.bit = 1 << rank
        self.counters = WorkerCounters()
        self.round = 0
        self.window = 1
        self.cwnd = 1.0  # congestion window (slices), <= window; kept across reductions
        self._cwnd_cut_at = 0  # packets_sent when the window was last halved
        self.slot_override: dict[int, int] = {}
        # per-slice error bounds of the last reduction; the per-element array is built on demand
        self._bounds: np.ndarray | None = None
        self._bound_shape: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None
        self._joined = False
        self._busy_round = 0
        # control path (see the module docstring): the heartbeat thread owns the beat state
        # (``_beat`` is also called by ``join``, before that thread starts)
        self._beat_lock = threading.Lock()
        self._beat_seq = 0
        self._beat_round = 0
        self._beat_sent_at = 0.0
        self._beat_acked = 0
        self._beat_acked_at = time.monotonic()
        # when the last RESULT came down (written by the data path, read by the heartbeat
        # thread): on a loaded machine an acknowledgement can queue for seconds behind data in
        # the parameter node's socket while results keep arriving, and a fallback then would
        # send every worker's data to the parameter node (measured: 8 workers at load ~50)
        self._result_heard_at = time.monotonic()
        self._control_target = switch
        self._fall_back = threading.Event()  # set by the heartbeat thread: go to the ps
        self._direct = False  # the main thread has moved data to the parameter node
        self._direct_welcomed = False
        self._fabric_error: str | None = None
        self._scratch = np.empty(BLOCK, dtype=np.float32)  # quantisation's work space
        self._srtt: float | None = None  # smoothed round trip of a slice (RFC 6298 style)
        self._rttvar = 0.0
        self._min_rtt = math.inf  # the shortest round trip seen: no answer can come sooner
        self._streams: dict[Any, _Stream] = {}  # low-bit state per tensor key
        self._stream: _Stream | None = None  # the current reduction's

    # ---- membership -----------------------------------------------------------------------
    def join(self) -> None:
        """Register with the fabric and wait until every worker of the job has (a barrier)."""
        if self._joined:
            return
        hello = self._hello_packet()
        self.transport.prepare(self.switch)
        deadline = time.monotonic() + self.config.timeout
        next_hello = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise AggregationError(
                    f"job {self.job} worker {self.rank}: no WELCOME from the fabric at "
                    f"{self.switch[0]}:{self.switch[1]} within {self.config.timeout:.0f} s "
                    f"(are the forwarding node, the parameter node and all {self.world} workers "
                    f"running?)"
                )
            if now >= next_hello:
                self.transport.send(hello, self.switch)
                next_hello = now + 0.3
            got = self.transport.recv(min(0.3, deadline - now))
            if got is None:
                continue
            h, body = self._decode(got[0])
            if h is not None and h.kind == Kind.WELCOME and h.job == self.job:
                info = self._welcome_info(body)
                budget = info.get("buffer_per_worker")
                pool = h.slot or 1
                per_packet = HEADER_SIZE + 4 * self.chunk
                # half of the smallest buffer share on the path (a datagram occupies more
                # than its bytes in a socket buffer), and of this worker's own buffer
                room = min(self.transport.receive_buffer, budget or self.transport.receive_buffer)
                by_buffer = max(1, room // (2 * per_packet))
                self.window = max(1, min(self.config.window, pool, by_buffer))
                self.cwnd = float(self.window)
                self._joined = True
                break
        self._beat_acked_at = time.monotonic()
        self._beat(fresh=True)
        self._heart = threading.Thread(target=self._heartbeat, daemon=True, name=f"aggregation-heartbeat-{self.rank}")
        self._heart.start()

    def _welcome_info(self, welcome: bytes | memoryview) -> dict[str, Any]:
        """What a WELCOME says (the parameter node's address, taken unless configured; the
        per-worker in-flight budget); {} if unreadable."""
        try:
            info = json.loads(bytes(welcome)) if len(welcome) else {}
            host, port = info.get("parameter_node") or ("", 0)
            if "buffer_per_worker" in info:
                info["buffer_per_worker"] = int(info["buffer_per_worker"])
            # a wildcard bind names no reachable address
            named: Address | None = None if host in (None, "", "0.0.0.0", "::") else (str(host), int(port))
        except (ValueError, TypeError, AttributeError):
            return {}
        if self.parameter_node is None and named is not None:
            self.parameter_node = named
        return info

    def _beat(self, fresh: bool) -> None:
        """Send a HEARTBEAT on the control socket; ``fresh``: a new one (new sequence number,
        the current busy state), else the unacknowledged one again.

        The round field says whether this worker waits inside allreduce (0: idle), so the
        parameter node knows someone waits even when no slice of that round reached it yet;
        the sequence number lets it ignore a late copy that would set an old busy state."""
        with self._beat_lock:
            if fresh:
                self._beat_seq += 1
                self._beat_round = self._busy_round
            beat = Header(Kind.HEARTBEAT, self.job, self._beat_round, self._beat_seq, self.bit, self.world)
            self._control.send(encode(beat), self._control_target)
            self._beat_sent_at = time.monotonic()

    def _heartbeat(self) -> None:
        """The control thread: beat every ``heartbeat`` s, resend until acknowledged, and
        judge the fabric from the acknowledgements (fall back, or fail naming the node)."""
        cfg = self.config
        while not self._stop.is_set():
            now = time.monotonic()
            unacked = self._beat_acked < self._beat_seq
            if self._busy_round != self._beat_round or (not unacked and now - self._beat_sent_at >= cfg.heartbeat):
                # a change of the busy state goes out at once, in a fresh beat: a reduction
                # shorter than control_retry is never announced (no packet per allreduce)
                self._beat(fresh=True)
            elif unacked and now - self._beat_sent_at >= cfg.control_retry:
                self._beat(fresh=False)
            self._judge_fabric(now)
            if self._fabric_error is not None:
                return
            # wake at least every control_retry to see a change of the busy state
            wait = (
                cfg.control_retry
                if self._beat_acked < self._beat_seq
                else min(cfg.control_retry, self._beat_sent_at + cfg.heartbeat - time.monotonic())
            )
            got = self._control.recv(max(0.0, wait))
            if got is None:
                continue
            h, _ = self._decode(got[0])
            if h is not None and h.kind == Kind.ACK and h.job == self.job and h.slot == Kind.HEARTBEAT:
                self._beat_acked = max(self._beat_acked, h.seq)
                self._beat_acked_at = time.monotonic()

    def _judge_fabric(self, now: float) -> None:
        cfg = self.config
        silent = now - max(self._beat_acked_at, self._result_heard_at)
        if not self._fall_back.is_set():
            if silent < cfg.failover_after:
                return
            if self.parameter_node is not None and self.parameter_node != self.switch:
                # the forwarding node (or the way to it) is gone: talk to the parameter node
                self._control_target = self.parameter_node
                self._beat_acked_at = now
                self._fall_back.set()
                return
        elif silent < cfg.parameter_node_dead_after:
            return
        ps = self.parameter_node or self.switch
        via = (
            f", nor through the forwarding node {self.switch[0]}:{self.switch[1]} before"
            if self._fall_back.is_set()
            else ""
        )
        self._fabric_error = (
            f"job {self.job} worker {self.rank}: the parameter node at {ps[0]}:{ps[1]} does not "
            f"answer: no acknowledgement of a heartbeat for {silent:.1f} s{via}; the job cannot "
            f"continue (is the parameter node running?)"
        )

    def close(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join(timeout=2)
        if self._joined and self._fabric_error is None:
            self._leave()
        self.transport.close()
        self._control.close()

    def _leave(self) -> None:
        """BYE, retransmitted until the parameter node acknowledges it (or ``bye_timeout``):
        a BYE lost on the way would leave this worker looking dead once its process exits."""
        cfg = self.config
        bye = encode(Header(Kind.BYE, self.job, 0, self._beat_seq + 1, self.bit, self.world))
        deadline = time.monotonic() + cfg.bye_timeout
        while time.monotonic() < deadline:
            self._control.send(bye, self._control_target)
            until = min(deadline, time.monotonic() + cfg.control_retry)
            while (left := until - time.monotonic()) > 0:
                got = self._control.recv(left)
                if got is None:
                    break
                h, _ = self._decode(got[0])
                if h is not None and h.kind == Kind.ACK and h.slot == Kind.BYE and h.job == self.job:
                    return

    def __enter__(self) -> AggregationClient:
        self.join()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- reduction ------------------------------------------------------------------------
    @staticmethod
    def _decode(data: Buffer) -> tuple[Header | None, bytes | memoryview]:
        try:
            return decode(data)
        except (ProtocolError, ValueError):
            return None, b""

    def _encoding(self, fl: _InFlight, chunk: np.ndarray) -> tuple[Flag, np.dtype, int]:
        """How a slice goes: its payload flag, element type and exponent (float32 on the
        exception path; int8/int16 with the job's shared scale once a round of this tensor
        told every worker the slice's magnitude; int32 otherwise)."""
        if fl.floats:
            return Flag.FLOAT, np.dtype("<f4"), 0
        quantizer = self.config.quantizer
        stream = self._stream
        if isinstance(quantizer, SharedScale):
            if stream is not None and stream.peaks[fl.seq] != NO_PEAK:
                exponent = quantizer.shared_exponent(int(stream.peaks[fl.seq]), self.world, int(stream.margins[fl.seq]))
                return (Flag.INT8 if quantizer.bits == 8 else Flag.INT16), quantizer.dtype, exponent
            return Flag.NONE, np.dtype("<i4"), BlockFloat().choose_exponent(chunk, self.world, fl.peak)
        return Flag.NONE, np.dtype("<i4"), quantizer.choose_exponent(chunk, self.world, fl.peak)

    def _send_slice(self, x: np.ndarray, fl: _InFlight, retransmit: bool) -> None:
        """Quantise (or copy, on the float path) the slice straight into the outgoing packet."""
        chunk = x[fl.start : fl.stop]
        slot = self.slot_override.get(fl.seq, slot_id(self.job, fl.seq))
        flags = Flag.AGGREGATE_AT_PS if self._direct else Flag.NONE
        if retransmit:
            flags |= Flag.RETRANSMIT | Flag.AGGREGATE_AT_PS
        if fl.floats:
            flags |= Flag.AGGREGATE_AT_PS
        kind, dtype, exponent = self._encoding(fl, chunk)
        packet = self.transport.packet(self.target, HEADER_SIZE + dtype.itemsize * chunk.size)
        payload = np.frombuffer(packet, dtype, chunk.size, HEADER_SIZE)
        if fl.floats:
            payload[:] = chunk
        else:
            quantize_into(chunk, exponent, payload, fl.peak, self._scratch)
        stream = self._stream
        if stream is not None and (fl.floats or fl.sends == 0):
            # error feedback: what this worker's rounding left out goes into its next round
            # (nothing once the slice goes as floats)
            residual = stream.residual[fl.start : fl.stop]
            if fl.floats or not self._feedback:
                residual[...] = 0.0
            else:
                dequantize_into(payload, exponent, residual)
                np.subtract(chunk, residual, out=residual)
            if kind in (Flag.INT8, Flag.INT16):
                self.counters.low_bit_slices += 1
        head = Header(
            Kind.DATA,
            self.job,
            self.round,
            fl.seq,
            self.bit,
            self.world,
            slot,
            exponent,
            chunk.size,
            flags | kind,
            peak=peak_exponent(fl.peak),
        )
        encode_header_into(packet, head, chunk.size)
        del payload  # no view of the packet may outlive this call
        self.transport.send(packet, self.target)
        self.counters.packets_sent += 1
        self._kill.tick(self.counters.packets_sent)
        fl.last_sent_packet = self.counters.packets_sent
        fl.sends += 1
        fl.sent_at = time.monotonic()
        if fl.sends == 1:
            fl.first_sent_at = fl.sent_at

    @property
    def last_error_bound(self) -> np.ndarray | None:
        """Per-element bound on the absolute error of the last ``allreduce`` result (float32,
        the input's shape). Built when asked: most callers never look at it."""
        if self._bounds is None:
            return None
        n = math.prod(self._bound_shape)
        return np.repeat(self._bounds, self.chunk)[:n].reshape(self._bound_shape)

    def allreduce(self, array: Any, out: np.ndarray | None = None, key: Any = None) -> Any:
        """Sum ``array`` over every worker of the job; returns the same type and shape.

        numpy arrays and torch tensors are accepted; the sum is computed in the quantised
        domain, and ``last_error_bound`` holds the per-element bound on its absolute error.
        ``out`` (numpy input only): a C-contiguous float32 array of the same size that
        receives the result (it may be ``array`` itself: in place, as gloo's all_reduce).
        ``key`` (low-bit aggregation): which tensor this is, so that its shared scale and
        carried error go on from its previous all-reduce (every worker must use the same keys
        in the same order; default: the element count). With error feedback the result is the
        sum of the inputs plus the errors carried from the previous round minus this round's:
        ``last_error_bound`` bounds both.
        """
        torch_like = hasattr(array, "detach") and hasattr(array, "numpy")
        src = array.detach().cpu().numpy() if torch_like else np.asarray(array)
        x = np.ascontiguousarray(src, dtype=np.float32).ravel()
        self._stream = self._stream_for(x.size if key is None else key, x.size)
        if self._stream is not None:
            np.add(x, self._stream.residual, out=self._stream.sent)
            x = self._stream.sent
        # each slice's peak, found once (two reductions, no temporary array) and used to
        # choose the slice's scale, to tell the others its magnitude, and to refuse NaN and
        # infinity (the max and min carry them; the carried error is finite): one read of
        # the tensor for all three, not a second one to check it
        peaks = [peak_magnitude(x[i : i + self.chunk]) for i in range(0, max(x.size, 1), self.chunk)]
        if not all(map(math.isfinite, peaks)):
            self._stream = None
            raise ValueError("allreduce input contains NaN or infinity")
        target = None
        if out is not None:
            if torch_like or out.dtype != np.float32 or out.size != x.size or not out.flags.c_contiguous:
                raise ValueError(
                    "out must be a C-contiguous float32 numpy array of the input's size (numpy input only)"
                )
            target = out.reshape(-1)
        self.join()  # after checking the arguments: a wrong call fails at once
        try:
            result_flat, bounds = self._reduce(x, peaks, target)
        finally:
            self._busy_round = 0  # announced by the heartbeat thread within control_retry
        self._bounds, self._bound_shape = bounds, tuple(src.shape)
        self._stream = None
        if out is not None:
            return out
        result = result_flat.reshape(src.shape)
        if torch_like:
            import torch

            return torch.from_numpy(result).to(dtype=array.dtype, device=array.device)
        return result.astype(src.dtype, copy=False) if src.dtype.kind == "f" else result

    def _stream_for(self, key: Any, size: int) -> _Stream | None:
        """The low-bit state of tensor ``key`` (a fresh one when its size changed); None
        without low-bit aggregation or error feedback."""
        quantizer = self.config.quantizer
        if not isinstance(quantizer, SharedScale):
            return None
        stream = self._streams.get(key)
        if stream is None or stream.size != size:
            stream = self._streams[key] = _Stream.empty(size, max(1, math.ceil(size / self.chunk)), quantizer.margin)
        return stream

    @property
    def _feedback(self) -> bool:
        quantizer = self.config.quantizer
        return isinstance(quantizer, SharedScale) and quantizer.error_feedback

    def _rto(self) -> float:
        cfg = self.config
        if self._srtt is None:
            return self.initial_rto
        rto = self._srtt + 4 * self._rttvar
        return min(cfg.max_retransmit_timeout, max(self.min_rto, rto))

    def _sample_rtt(self, rtt: float) -> None:
        self._min_rtt = min(self._min_rtt, rtt)
        if self._srtt is None:
            self._srtt, self._rttvar = rtt, rtt / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt

    def _reduce(
        self, x: np.ndarray, peaks: list[float], out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        started = time.monotonic()
        self.round += 1
        self._busy_round = self.round
        n = x.size
        chunk = self.chunk
        total = max(1, math.ceil(n / chunk))
        if out is None:
            out = np.empty(n, dtype=np.float32)
        bound = np.zeros(total, dtype=np.float32)  # per slice; written by _accept
        pending: dict[int, _InFlight] = {}
        next_seq = done = 0
        last_progress = time.monotonic()
        next_hello = 0.0
        while done < total:
            if self._fabric_error is not None:
                raise AggregationError(self._fabric_error)
            if self._fall_back.is_set():
                if not self._direct:
                    self._go_direct(pending)
                if not self._direct_welcomed and time.monotonic() >= next_hello:
                    self._hello(self.target)
                    next_hello = time.monotonic() + 0.3
            while next_seq < total and len(pending) < max(1, int(self.cwnd)):
                fl = _InFlight(
                    next_seq, next_seq * chunk, min(n, (next_seq + 1) * chunk), 0.0, self._rto(), peak=peaks[next_seq]
                )
                pending[next_seq] = fl
                self._send_slice(x, fl, retransmit=False)
                next_seq += 1
            now = time.monotonic()
            if now - last_progress > cfg.timeout:
                raise AggregationError(self._timeout_message(len(pending)))
            first_due = min(fl.sent_at + fl.rto for fl in pending.values())
            got = self.transport.recv(max(0.0, min(first_due - now, 0.5)))
            if got is not None:
                h, body = self._decode(got[0])
                if h is not None and h.job == self.job:
                    if h.kind == Kind.RESULT:
                        if h.has(Flag.RETRANSMIT):
                            self._resent_results += 1
                        else:
                            self._first_results += 1
                        if h.bitmap & ~self.bit:  # the group's copy names every member
                            self.counters.results_from_group += 1
                    if h.kind == Kind.ABORT:
                        raise WorkerLostError(bytes(body).decode(errors="replace"))
                    if h.kind == Kind.WELCOME:
                        self._direct_welcomed = self._direct
                    elif h.round != self.round or h.seq not in pending:
                        if h.kind == Kind.RESULT:
                            self.counters.duplicates_ignored += 1
                    elif h.kind == Kind.RESULT and self._accept(h, body, pending[h.seq], out, bound):
                        fl = pending.pop(h.seq)
                        now = self._result_heard_at = time.monotonic()
                        if fl.sends == 1:  # Karn: only unambiguous samples
                            self._sample_rtt(now - fl.sent_at)
                        elif fl.resent_at and now - fl.resent_at < self._min_rtt:
                            self._spurious(fl, now)
                        if cfg.congestion_control:
                            self.cwnd = min(float(self.window), self.cwnd + 1.0 / self.cwnd)
                        done += 1
                        last_progress = time.monotonic()
                        for other in pending.values():
                            if other.seq < fl.seq:
                                other.acks_after += 1
                    elif h.kind == Kind.EXCEPTION:
                        fl = pending[h.seq]
                        if not fl.floats:
                            fl.floats = True
                            self.counters.float_resends += 1
                            self._send_slice(x, fl, retransmit=False)
                            last_progress = time.monotonic()
            now = time.monotonic()
            for fl in pending.values():
                gap = fl.acks_after >= cfg.gap_threshold and not fl.gap_resent
                if gap or now >= fl.sent_at + fl.rto:
                    if gap:
                        fl.gap_resent = True
                        self.counters.gap_retransmits += 1
                    else:
                        fl.rto = min(fl.rto * 2, cfg.max_retransmit_timeout)
                    self._on_loss(fl)
                    if now >= self._rejoin_at and not self._direct:
                        self._renew_membership(now)
                    self.counters.retransmits += 1
                    fl.resent_at = now
                    self._send_slice(x, fl, retransmit=True)
        self.counters.elements_reduced += n
        self.counters.seconds_in_allreduce += time.monotonic() - started
        return out, bound

    def _renew_membership(self, now: float) -> None:
        """A result had to be asked for again, perhaps because the bridge does not (or no
        longer) forward the job's group to this worker's port: leave and join the group, whose
        fresh membership report restores the multicast copies within the report's delay. At
        most every ``REJOIN_INTERVAL_S``; the resend meanwhile comes unicast.

        The previous renewal is judged first (multicast.py): failed if results the parameter
        node sent again came since and none as it first sent them; after
        ``MAX_FAILED_REJOINS`` failures in a row the worker gives the group up. Once it has,
        the HELLO that says so goes again instead, until a first result comes after it."""
        if self.group is None:
            if self._left_group_at is not None:
                if self._first_results > self._left_group_at:
                    self._left_group_at = None  # the node answers it unicast: confirmed
                else:
                    self._rejoin_at = now + REJOIN_INTERVAL_S
                    self._hello(self.switch)
            return
        self._rejoin_at = now + REJOIN_INTERVAL_S
        heard = (self._first_results, self._resent_results)
        if self._renewed is not None:
            if heard[0] > self._renewed[0]:
                self._failed_in_row = 0
            elif heard[1] > self._renewed[1]:
                self._failed_in_row += 1
                self.counters.failed_rejoins += 1
        if self._failed_in_row >= MAX_FAILED_REJOINS:
            self._give_up_group()
            return
        self.transport.rejoin()
        self._renewed = heard
        self.counters.rejoins += 1

    def _give_up_group(self) -> None:
        """Leave the job's group for good and say HELLO without it: the forwarding node sends
        this worker's results unicast from now on (the other members keep the group)."""
        log.warning(
            "job %d worker %d: %d renewals of multicast group %s in a row brought no result from "
            "it (results came only when asked for again); receiving results unicast from now on",
            self.job,
            self.rank,
            self._failed_in_row,
            self.group,
        )
        self.transport.leave()
        self.group = None
        self.counters.unicast_fallbacks += 1
        self._left_group_at = self._first_results
        self._hello(self.switch)

    def _on_loss(self, fl: _InFlight) -> None:
        """Multiplicative decrease, once per window: only a loss of a slice sent after the
        last cut counts (the others of that window were lost to the same overflow)."""
        if not self.config.congestion_control or fl.last_sent_packet <= self._cwnd_cut_at:
            return
        fl.cwnd_before = self.cwnd
        self.cwnd = max(1.0, self.cwnd / 2)
        self._cwnd_cut_at = self.counters.packets_sent
        self.counters.window_cuts += 1

    def _spurious(self, fl: _InFlight, now: float) -> None:
        """The result of a resent slice came back sooner than any round trip after the resend
        (Eifel's test, by time): the first send was answered and the slice was only late. On a
        machine whose cores are busy, scheduling delays look like losses; undo the window cut
        and learn the long round trip (an unambiguous sample now), so the timer stops firing."""
        self.counters.spurious_retransmits += 1
        if fl.cwnd_before:
            self.cwnd = max(self.cwnd, fl.cwnd_before)
        self._sample_rtt(now - fl.first_sent_at)

    def _hello_packet(self) -> bytes:
        """HELLO: this worker's process (the parameter node may watch it), how the job's
        sums are to come down, and the multicast group it joined (with the address it sends
        from, so that a forwarding node can tell a HELLO straight from it)."""
        me: dict[str, Any] = {"pid": os.getpid(), "host": host_identity(), "results": self.config.result_precision}
        if self.group is not None:
            me["multicast"] = {"group": self.group, "address": list(self.transport.address)}
        return encode(Header(Kind.HELLO, self.job, bitmap=self.bit, fan_in=self.world), json.dumps(me).encode())

    def _hello(self, addr: Address) -> None:
        self.transport.send(self._hello_packet(), addr)

    def _go_direct(self, pending: dict[int, _InFlight]) -> None:
        """Fall back to the parameter node: data goes there with aggregate-at = 1, and every
        slice in flight (perhaps summed in the dead node's memory) is resent now."""
        assert self.parameter_node is not None
        self.target = self.parameter_node
        self.transport.prepare(self.target)
        self._direct = True
        self.counters.fallbacks_to_parameter_node += 1
        self._hello(self.target)
        for fl in pending.values():
            fl.sent_at = 0.0

    def _timeout_message(self, pending: int) -> str:
        head = (
            f"job {self.job} worker {self.rank}: no result for {pending} slice(s) of round "
            f"{self.round} within {self.config.timeout:.0f} s"
        )
        if time.monotonic() - self._beat_acked_at < 2 * self.config.failover_after:
            return (
                f"{head}; the parameter node acknowledges this worker's heartbeats, so the "
                f"fabric is up: another worker of the job is not contributing (the "
                f"parameter node names a worker it finds dead or stopped)"
            )
        return f"{head}; the forwarding node {self.switch[0]}:{self.switch[1]} or the parameter node is unreachable"

    def _accept(self, h: Header, body: bytes | memoryview, fl: _InFlight, out: np.ndarray, bound: np.ndarray) -> bool:
        """Write a slice's result into ``out``; False if it could not be read (a reference to
        the shared result store whose space was reused: handled like a lost packet)."""
        if h.count != fl.stop - fl.start:
            raise AggregationError(f"result for slice {h.seq} has {h.count} elements, expected {fl.stop - fl.start}")
        shared = self.transport.shared(body) if h.has(Flag.SHARED) else None
        if h.has(Flag.SHARED) and shared is None:
            self.counters.stale_results += 1
            return False
        vals = values(h, body if shared is None else shared)
        if h.has(Flag.FLOAT):
            out[fl.start : fl.stop] = vals
        else:
            dequantize_into(vals, h.exponent, out[fl.start : fl.stop])
        del vals
        if h.has(Flag.SHARED) and not self.transport.shared_intact(body):
            self.counters.stale_results += 1  # rewritten while we read: what we wrote is void
            return False
        floats = h.has(Flag.FLOAT)
        stream = self._stream
        # a re-quantised sum (int8 down) is stated at the coarser exponent: the bounds of the
        # way up hold there too, and its stochastic rounding adds less than one unit
        bound[fl.seq] = 0.0 if floats else error_bound(h.exponent, self.world)
        if h.has(Flag.INT8):
            bound[fl.seq] += math.ldexp(1.0, -h.exponent)
        if stream is not None:
            # the errors carried into this round, and the bound of those this round carries on
            # (each worker's own rounding, at most half a unit of the slice's scale)
            bound[fl.seq] += stream.carried[fl.seq]
            stream.carried[fl.seq] = (
                0.5 * self.world * math.ldexp(1.0, -h.exponent) if self._feedback and not floats else 0.0
            )
            if stream.peaks[fl.seq] != NO_PEAK and isinstance(self.config.quantizer, SharedScale):
                # a low-bit slice that overflowed came back as floats
                margin, clean = self.config.quantizer.next_margin(
                    int(stream.margins[fl.seq]), int(stream.clean[fl.seq]), floats
                )
                stream.margins[fl.seq], stream.clean[fl.seq] = margin, clean
            stream.peaks[fl.seq] = h.peak
        if h.has(Flag.CONFLICT):
            self.slot_override[h.seq] = h.slot
        self.counters.results += 1
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "role": "worker",
            "job": self.job,
            "rank": self.rank,
            "window": self.window,  # slices in flight at most (slots, buffers, configured)
            "group": self.group,  # the multicast group results come from; None: unicast
            **self.counters.__dict__,
            "transport": self.transport.counters.as_dict(),
        }
