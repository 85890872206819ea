"""Low-rank gradient compression whose factor sums go through the fabric as integers.

Why: at 8 workers on 100 Mbit/s links an int8 all-reduce of a 1.08 M-parameter CNN spends most
of a training step on the wire (per worker and step, 1.08 MB of int8 up and their int16 sum,
2.16 MB, down). PowerSGD (Vogels et al., 2019) sends rank-``r`` factors of each gradient matrix
instead, a few thousand numbers; PyTorch's hook sends them through gloo's ring, 2(N-1) hops
per all-reduce. Here they go through in-network aggregation: one round trip through the
forwarding node per all-reduce, and the nodes add the factors as integers of the job's
quantiser (int8 with a shared scale, int32 block floating point, ...): exact sums, the spec's
overflow fallback (floats) when a value outgrows the shared scale, loss and failover as for any
all-reduce. It is our own code (PowerSGD's power iteration), chosen per job by the DDP hook a
script registers (``fabric_lowrank_hook`` instead of ``fabric_allreduce_hook``).

Per bucket and step, each matrix-shaped gradient (viewed as ``n x m``, plus this worker's
carried error: ``M``) is approximated as follows, ``Q`` (``m x r``) being the same on every
worker (drawn from the same seed, then the previous step's summed ``Q``: warm start):

1. ``P = M Q``; sum ``P`` over the workers (all-reduce 1), orthonormalise it: every worker has
   the same sum, hence the same basis;
2. ``Q = M^T P``; sum ``Q`` over the workers (all-reduce 2);
3. the average gradient is ``P Q^T / world``.

Vectors and matrices too small to gain (``n m < rate (n + m) r``) go uncompressed in
all-reduce 1. Error feedback: each worker keeps what the average left out of its own ``M``
(``M`` minus the result) and adds it to its next gradient of the bucket: PowerSGD's rule and
PyTorch's hook's. It also covers the quantiser's rounding, so the client's quantiser must not
carry its own (``SharedScale(error_feedback=False)``: the rounding would be fed back twice).
The first ``start`` steps of a bucket are plain all-reduces of ``M``, as PyTorch's
``start_powerSGD_iter``.

Slices: every column of a factor (and the uncompressed part) starts a slice of its own, padded
with zeros to a multiple of the client's ``chunk``, so that a slice's shared scale is that of
one column: the second column of ``P`` (often far smaller than the first) is not rounded on the
first one's scale. Choose a ``chunk`` near the length of the longest column (e.g. 1024 for a
1024 x 1024 layer).
"""

import dataclasses
import typing

import numpy as np
import torch
import torch.distributed as dist

from trainmaster.aggregation.quantize import SharedScale
from trainmaster.aggregation.torch_hook import FabricHookState
from trainmaster.aggregation.worker import AggregationClient


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One gradient of the bucket: where it lies in the bucket's flat buffer, and, when it is
    compressed, its matrix shape and where its factors' columns start in the two all-reduces."""

    offset: int
    numel: int
    rows: int = 0  # 0: sent uncompressed
    cols: int = 0
    rest_at: int = 0  # uncompressed: its place in all-reduce 1
    p_at: tuple[int, ...] = ()  # compressed: where each column of P starts in all-reduce 1
    q_at: tuple[int, ...] = ()  # ... and each column of Q in all-reduce 2


@dataclasses.dataclass(frozen=True)
class _Layout:
    segments: tuple[_Segment, ...]
    p_size: int  # elements of all-reduce 1 (the uncompressed part, then P's columns, padded)
    q_size: int  # elements of all-reduce 2 (Q's columns, padded)


def _padded(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


def plan_layout(shapes: list[tuple[int, ...]], rank: int, rate: float, chunk: int) -> _Layout:
    """Which gradients of a bucket are compressed, and where everything goes on the wire.

    A gradient is compressed when it has two or more dimensions (viewed as ``shape[0] x rest``),
    ``rank`` is below both sides and ``n m >= rate (n + m) rank``: the factors are then at least
    ``rate`` times smaller than the gradient."""
    plain, packed = [], []
    offset = 0
    for shape in shapes:
        numel = int(np.prod(shape)) if shape else 1
        n = shape[0] if len(shape) > 1 else 0
        m = numel // n if n else 0
        if n and rank < min(n, m) and n * m >= rate * (n + m) * rank:
            packed.append((offset, numel, n, m))
        else:
            plain.append((offset, numel))
        offset += numel
    segments: list[_Segment] = []
    rest = 0
    for off, numel in plain:
        segments.append(_Segment(off, numel, rest_at=rest))
        rest += numel
    p_pos, q_pos = _padded(rest, chunk), 0
    for off, numel, n, m in packed:
        p_at, q_at = [], []
        for _ in range(rank):
            p_at.append(p_pos)
            p_pos += _padded(n, chunk)
            q_at.append(q_pos)
            q_pos += _padded(m, chunk)
        segments.append(_Segment(off, numel, n, m, p_at=tuple(p_at), q_at=tuple(q_at)))
    return _Layout(tuple(segments), p_pos, q_pos)


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR; deterministic, so every worker, holding
    the same sum, gets the same basis)."""
    return torch.linalg.qr(p, mode="reduced").Q


class LowRankHookState(FabricHookState):
    """State of ``fabric_lowrank_hook``: per bucket, the step count, this worker's carried error
    and the warm-start ``Q`` of each compressed gradient; a communication thread as
    ``FabricHookState``'s.

    ``rank``: columns of the factors; ``start``: plain all-reduces before the first compressed
    step; ``min_compression_rate``: how much smaller the factors must be than a gradient for it
    to be compressed; ``seed``: the initial ``Q`` (the same on every worker)."""

    def __init__(
        self,
        client: AggregationClient,
        rank: int = 2,
        start: int = 10,
        min_compression_rate: float = 2.0,
        seed: int = 0,
    ):
        if rank < 1 or start < 0 or min_compression_rate <= 0:
            raise ValueError(
                f"rank must be >= 1, start >= 0, min_compression_rate > 0 (got {rank}, {start}, {min_compression_rate})"
            )
        quantizer = client.config.quantizer
        if isinstance(quantizer, SharedScale) and quantizer.error_feedback:
            raise ValueError(
                "the low-rank hook carries each worker's error itself: give its client a quantiser "
                "without error feedback (SharedScale(bits, error_feedback=False)), or the rounding "
                "is fed back twice"
            )
        self.rank = rank
        self.start = start
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.compressed_buckets = 0  # buckets reduced as factors
        self._step = 0  # training steps whose buckets were all submitted (DDP's last bucket)
        self._errors: dict[int, tuple[tuple[tuple[int, ...], ...], torch.Tensor]] = {}
        self._qs: dict[int, dict[int, torch.Tensor]] = {}
        self._layouts: dict[int, tuple[tuple[tuple[int, ...], ...], _Layout]] = {}
        super().__init__(client)  # starts the communication thread: last

    def submit_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Queue a DDP bucket: its buffer, index, gradients' shapes and the training step (a
        step ends with DDP's last bucket; the step, not the bucket's own count, decides plain
        or compressed, as in PyTorch's hook: DDP rebuilds its buckets after the first step)."""
        shapes = tuple(tuple(g.shape) for g in bucket.gradients())
        future = self.submit(bucket.buffer(), (bucket.index(), shapes, self._step))
        if bucket.is_last():
            self._step += 1
        return future

    def average(self, tensor: torch.Tensor, key: object) -> None:
        """Replace the bucket ``tensor`` by the workers' average: plain for the first
        ``start`` steps, then its low-rank approximation (the module docstring). ``key``:
        (bucket index, gradient shapes, training step). A bucket whose gradients changed (DDP
        rebuilt its buckets) starts afresh: no carried error, a new ``Q``."""
        index, shapes, step = typing.cast(tuple[int, tuple[tuple[int, ...], ...], int], key)
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError("the low-rank hook reduces contiguous float32 CPU buckets")
        flat = tensor.view(-1)
        carried = self._errors.get(index)
        m = flat + carried[1] if carried is not None and carried[0] == shapes else flat.clone()
        result = torch.empty_like(m)
        if step < self.start:
            self.client.allreduce(m.numpy(), out=result.numpy(), key=("lowrank-plain", index))
            result.div_(self.client.world)
        else:
            self._compressed(m, result, index, shapes)
            self.compressed_buckets += 1
        self._errors[index] = (shapes, m - result)
        flat.copy_(result)

    def _layout(self, index: int, shapes: tuple[tuple[int, ...], ...]) -> _Layout:
        known = self._layouts.get(index)
        if known is None or known[0] != shapes:
            known = self._layouts[index] = (
                shapes,
                plan_layout(list(shapes), self.rank, self.min_compression_rate, self.client.chunk),
            )
            self._qs[index] = {}
        return known[1]

    def _compressed(
        self, m: torch.Tensor, result: torch.Tensor, index: int, shapes: tuple[tuple[int, ...], ...]
    ) -> None:
        layout = self._layout(index, shapes)
        world, r = self.client.world, self.rank
        qs = self._qs[index]
        first = torch.from_numpy(np.zeros(layout.p_size, np.float32))
        matrices: list[tuple[_Segment, torch.Tensor]] = []
        for seg in layout.segments:
            part = m[seg.offset : seg.offset + seg.numel]
            if not seg.rows:
                first[seg.rest_at : seg.rest_at + seg.numel] = part
                continue
            mat = part.view(seg.rows, seg.cols)
            q = qs.get(seg.offset)
            if q is None:  # the same draw on every worker: the same seed
                q = torch.randn(seg.cols, r, generator=torch.Generator().manual_seed(self.seed * 7919 + seg.offset))
            p = mat @ q
            for j, at in enumerate(seg.p_at):
                first[at : at + seg.rows] = p[:, j]
            matrices.append((seg, mat))
        self.client.allreduce(first.numpy(), out=first.numpy(), key=("lowrank-p", index))
        second = torch.from_numpy(np.zeros(layout.q_size, np.float32))
        bases = []
        for seg, mat in matrices:
            p_sum = torch.stack([first[at : at + seg.rows] for at in seg.p_at], dim=1)
            basis = orthonormalise(p_sum)
            q = mat.t() @ basis
            for j, at in enumerate(seg.q_at):
                second[at : at + seg.cols] = q[:, j]
            bases.append(basis)
        self.client.allreduce(second.numpy(), out=second.numpy(), key=("lowrank-q", index))
        for seg in layout.segments:
            if not seg.rows:
                torch.div(
                    first[seg.rest_at : seg.rest_at + seg.numel], world, out=result[seg.offset : seg.offset + seg.numel]
                )
        for (seg, _), basis in zip(matrices, bases):
            q_sum = torch.stack([second[at : at + seg.cols] for at in seg.q_at], dim=1)
            qs[seg.offset] = q_sum  # warm start: the next step's Q
            approx = result[seg.offset : seg.offset + seg.numel].view(seg.rows, seg.cols)
            torch.matmul(basis, q_sum.t(), out=approx)
            approx.div_(world)


# no ``from __future__ import annotations`` here: DDP checks these annotations at runtime
def fabric_lowrank_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook (``register_comm_hook(LowRankHookState(client), fabric_lowrank_hook)``): the
    bucket's low-rank average over all workers, asynchronously."""
    if not isinstance(state, LowRankHookState):
        raise TypeError("fabric_lowrank_hook needs a LowRankHookState")
    return state.submit_bucket(bucket)
