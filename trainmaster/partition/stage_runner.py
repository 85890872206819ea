"""Run a model split by ``stages.StagePlan`` as a real ``torch.distributed.pipelining`` pipeline.

One process per stage (rank r runs stage r), a gloo process group over TCP, so the stages can
sit on separate hosts (the testbed's network namespaces, each with its capped link). Every rank
builds the same model (same constructor and seed), splits it with ``torch.distributed.pipelining
.pipeline`` at the plan's split points (``stages.build_pipe``) and builds its ``PipelineStage``;
micro-batches flow rank 0 -> 1 -> ... -> k-1 under ``ScheduleGPipe`` (forward only: inference).

Measured, all on one clock (``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process
of the machine, network namespaces included):
- **latency**: one micro-batch alone, from rank 0 starting the step to the last rank holding the
  output (``latency_samples`` times; median and quartiles);
- **throughput**: ``microbatches`` micro-batches in one step, then twice as many; the steady
  period is the last rank's median gap between consecutive micro-batches' forward ends in the
  longer steps (``period_step_difference_seconds``: the steps' difference over the extra
  micro-batches, fill and drain cancelling, is kept beside it); samples per second = 1 / period;
  the outputs are merged (``torch.cat``) only in the warm-up round that checks them;
- where each rank's time goes per micro-batch, streaming and alone (``_ChunkTimer``): posting and
  waiting on receives and sends, the forward, and what none of them accounts for; and each
  boundary's transfer, from both ends being ready to the receiver holding the bytes;
- the costs a prediction rests on, measured in the same run: each stage's compute on its own
  input (the stage's submodule, median of runs, one rank at a time), and the fixed cost of one
  gloo message between neighbours (a one-element tensor's round trip / 2, less nothing: the link
  is priced apart as bytes / bandwidth);
- the outputs, checked equal to the unsplit model's.

``python -m trainmaster.partition.stage_runner`` reads TM_RANK, TM_WORLD, TM_MASTER (rank 0's
address), TM_PORT and TM_STAGE_RUN (the ``StageRun`` as JSON); rank 0 writes the report to
TM_OUTPUT (a file path).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TIMEOUT_S = 300.0


@dataclass
class StageRun:
    """What every rank runs: the model (``module:callable`` with ``model_args``, weights from
    ``seed``), one micro-batch's shape (``input_dtype`` ``tokens:V`` for token ids), the plan's
    split points, and how much to measure."""

    model: str
    input_shape: list[int]
    split_points: list[str]
    model_args: dict[str, Any] = field(default_factory=dict)
    input_dtype: str | None = None
    seed: int = 0
    microbatches: int = 8
    throughput_rounds: int = 3
    latency_samples: int = 12
    calibration_runs: int = 10


def _example(run: StageRun, seed: int):
    from trainmaster.partition.pipeline import example_input

    return example_input(run.input_shape, run.input_dtype, seed)


def run_rank(rank: int, world: int, master: str, port: int, run: StageRun) -> dict | None:
    """This rank's part of the pipeline; rank 0 returns the report, the others None."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe

    from trainmaster.partition.pipeline import build_model
    from trainmaster.partition.stages import build_pipe

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        model = build_model(run.model, run.seed, run.model_args)
        example = _example(run, run.seed + 1)
        t0 = time.perf_counter()
        with torch.no_grad():
            pipe = build_pipe(model, (example,), run.split_points)
        build_seconds = time.perf_counter() - t0
        # one rank at a time, once every rank has built its pipe: a stage is timed as it runs
        # when one micro-batch is alone in the pipeline (no other stage busy), not beside
        # another rank still exporting the model (on a 2-core machine that read 1.6-8x high)
        compute = (0.0, 0.0)
        dist.barrier()
        for turn in range(world):
            if turn == rank:
                compute = _stage_compute(pipe, rank, example, run.calibration_runs)
            dist.barrier()
        stage = pipe.build_stage(rank, torch.device("cpu"))
        fixed = _message_cost(rank, world)
        last = world - 1
        one = ScheduleGPipe(stage, n_microbatches=1)
        inputs = [_example(run, run.seed + 100 + i) for i in range(max(run.latency_samples, 1) + 2)]
        latency: list[float] = []
        same = True
        lone = _ChunkTimer(stage)
        for i, x in enumerate(inputs):
            dist.barrier()
            lone.start(1)
            t_start = time.perf_counter()
            with torch.no_grad(), lone:
                out = one.step(x) if rank == 0 else one.step()
            t_end = time.perf_counter()
            if i >= 2:
                lone.keep(t_start, t_end)
            stamps: list[Any] = [None] * world
            dist.all_gather_object(stamps, (t_start, t_end))
            if i >= 2:  # the first steps pay for lazy initialisation
                latency.append(stamps[last][1] - stamps[0][0])
            if rank == last:
                same = same and _close(out, _reference(model, x))
        period_rows = []
        merge: dict[int, float] = {}
        timer = _ChunkTimer(stage)
        many = {m: ScheduleGPipe(stage, n_microbatches=m) for m in (run.microbatches, 2 * run.microbatches)}
        for r in range(run.throughput_rounds + 1):
            times = {}
            for m, schedule in many.items():
                batch = torch.cat([_example(run, run.seed + 1000 + j) for j in range(m)])
                dist.barrier()
                timer.start(m)
                t_start = time.perf_counter()
                # the warm-up round merges and checks the outputs; the measured ones leave each
                # micro-batch's output where it was made, as a stream hands it on: the merge
                # (``torch.cat`` of every chunk at the step's end, on the last rank) grows with
                # the micro-batches, so it does not cancel in the period and was read as ~10 ms
                # per micro-batch of GPT-2's logits; it is timed apart (``merge_seconds``)
                check = r == 0
                with torch.no_grad(), timer:
                    if rank == 0:
                        out = schedule.step(batch, return_outputs=check)
                    else:
                        out = schedule.step(return_outputs=check)
                t_end = time.perf_counter()
                if r > 0 and m == 2 * run.microbatches:
                    timer.keep(t_start, t_end)
                stamps = [None] * world
                dist.all_gather_object(stamps, (t_start, t_end))
                times[m] = stamps[last][1] - stamps[0][0]
                if rank == last and r == 0:
                    same = same and _close(out, _reference(model, batch))
                    t0 = time.perf_counter()
                    schedule._merge_outputs(stage.output_chunks)  # what the merge costs, timed apart
                    merge[m] = time.perf_counter() - t0
            if r > 0:  # the first round warms the schedules
                period_rows.append(times)
        computes: list[Any] = [None] * world
        dist.all_gather_object(computes, compute)
        fixes: list[Any] = [None] * world
        dist.all_gather_object(fixes, fixed)
        equal: list[Any] = [None] * world
        dist.all_gather_object(equal, same)
        busy: list[Any] = [None] * world
        dist.all_gather_object(busy, timer.summary())
        merges: list[Any] = [None] * world
        dist.all_gather_object(merges, merge)
        lone_busy: list[Any] = [None] * world
        dist.all_gather_object(lone_busy, lone.summary())
        stream_marks: list[Any] = [None] * world
        dist.all_gather_object(stream_marks, timer.marks())
        lone_marks: list[Any] = [None] * world
        dist.all_gather_object(lone_marks, lone.marks())
        if rank != 0:
            return None
        m1, m2 = run.microbatches, 2 * run.microbatches
        # a round whose longer step was not longer (a spell of load on a shared machine) counts
        # its longer step's time per micro-batch, fill and drain included, instead
        periods = [(t[m2] - t[m1]) / (m2 - m1) if t[m2] > t[m1] else t[m2] / m2 for t in period_rows]
        # the steady period: the last rank's median gap between consecutive forward ends over the
        # longer steps (the difference of the two step lengths above moves with every spell of
        # load on a shared machine; a spell moves a few gaps, not their median)
        period = busy[last].get("cycle") or statistics.median(periods)
        return {
            "k": world,
            "split_points": run.split_points,
            "pipe_build_seconds": build_seconds,
            "latency_seconds": statistics.median(latency),
            "latency_quartiles_seconds": _quartiles(latency),
            "latencies": latency,
            "period_seconds": period,
            "period_step_difference_seconds": statistics.median(periods),
            "periods": periods,
            "samples_per_second": 1.0 / max(period, 1e-12),
            "step_seconds": period_rows,
            "stage_compute_seconds": [c[0] for c in computes],
            "stage_compute_cold_seconds": [c[1] for c in computes],
            "stage_streaming_seconds": busy,
            "stage_lone_seconds": lone_busy,
            "boundary_transfer_stream_seconds": _transfers(stream_marks),
            "boundary_transfer_lone_seconds": _transfers(lone_marks),
            # the last rank's torch.cat of a step's outputs: per step of m micro-batches
            "merge_seconds": {str(m): v for m, v in merges[last].items()},
            "cpu_cores": os.cpu_count(),
            "cores_per_rank": len(os.sched_getaffinity(0)),
            "message_fixed_seconds": statistics.median([f for f in fixes if f is not None] or [0.0]),
            "outputs_equal_unsplit": bool(equal[last]),
        }
    finally:
        dist.destroy_process_group()


class _ChunkTimer:
    """Where a rank's time goes while a schedule streams, phase by phase, per micro-batch.

    Inside ``with``, patches ``torch.distributed.pipelining.schedules._sorted_batch_p2p`` (posting
    the receives, ``fwd_recv``, and the sends, ``fwd_send``), ``schedules._wait_batch_p2p`` (waiting
    on them) and the stage's ``forward_one_chunk``, and stamps each call's start and end on
    ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of the machine, so the
    ranks' timelines line up). ``summary()``: each phase's median per micro-batch over the kept
    steps, the step's wall time per micro-batch and what no phase accounts for (``outside``:
    the schedule's own Python, splitting the batch, the GIL), and one kept step's timeline."""

    PHASES = ("recv_post", "recv_wait", "forward", "send_post", "send_wait")

    def __init__(self, stage):
        self.stage = stage
        self.events: list[tuple[str, float, float]] = []
        self.step_span: tuple[float, float] = (0.0, 0.0)
        self.kept: list[dict] = []

    def keep(self, t_start: float, t_end: float) -> None:
        self.kept.append({"start": t_start, "end": t_end, "events": list(self.events)})

    def __enter__(self):
        from torch.distributed.pipelining import schedules

        self._post, self._wait = schedules._sorted_batch_p2p, schedules._wait_batch_p2p
        self._forward = self.stage.forward_one_chunk
        in_loop = [True]
        events = self.events

        def post(ops, desc=None):
            t0 = time.perf_counter()
            try:
                return self._post(ops, desc=desc)
            finally:
                if ops:
                    events.append(("send_post" if desc == "fwd_send" else "recv_post", t0, time.perf_counter()))

        def wait(work):
            t0 = time.perf_counter()
            try:
                return self._wait(work)
            finally:
                events.append(("recv_wait" if in_loop[0] else "send_wait", t0, time.perf_counter()))

        def forward(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self._forward(*args, **kwargs)
            finally:
                events.append(("forward", t0, time.perf_counter()))
                # the sends' waits come after the last micro-batch's forward and send
                in_loop[0] = args[0] < self._chunks - 1 if args else True

        schedules._sorted_batch_p2p = post
        schedules._wait_batch_p2p = wait
        self.stage.forward_one_chunk = forward
        return self

    def start(self, chunks: int) -> None:
        """Before a step of ``chunks`` micro-batches."""
        self._chunks = chunks
        self.events.clear()

    def __exit__(self, *exc) -> None:
        from torch.distributed.pipelining import schedules

        schedules._sorted_batch_p2p = self._post
        schedules._wait_batch_p2p = self._wait
        self.stage.forward_one_chunk = self._forward

    def marks(self) -> list[dict[str, list[float]]]:
        """Per kept step, per micro-batch in order, the absolute time its sends were all posted
        (``send_post``), its receives were all posted (``recv_post``) and all waited for
        (``recv_wait``); a stage receiving from two earlier stages posts and waits twice."""
        out = []
        for step in self.kept:
            marks: dict[str, dict[int, float]] = {"send_post": {}, "recv_post": {}, "recv_wait": {}}
            done = 0  # forwards seen: receives belong to the next chunk, sends to the last
            for kind, _, t1 in step["events"]:
                if kind == "forward":
                    done += 1
                elif kind in marks:
                    chunk = done - 1 if kind == "send_post" else done
                    marks[kind][chunk] = max(marks[kind].get(chunk, t1), t1)
            out.append({kind: [v[c] for c in sorted(v)] for kind, v in marks.items()})
        return out

    def summary(self) -> dict[str, Any]:
        """Per micro-batch, medians over the kept steps: each phase's seconds (summed over the
        step, over its micro-batches), ``step`` (the step's wall time over its micro-batches) and
        ``outside`` (step less every phase); ``forward`` alone is the median of single forwards.
        ``timeline``: the last kept step's events, relative to its start, in milliseconds."""
        if not self.kept:
            return {}
        rows = []
        singles: list[float] = []
        for step in self.kept:
            n = max(sum(1 for e in step["events"] if e[0] == "forward"), 1)
            row = {ph: sum(t1 - t0 for k, t0, t1 in step["events"] if k == ph) / n for ph in self.PHASES}
            row["step"] = (step["end"] - step["start"]) / n
            row["outside"] = row["step"] - sum(row[ph] for ph in self.PHASES)
            rows.append(row)
            singles += [t1 - t0 for k, t0, t1 in step["events"] if k == "forward"]
        out: dict[str, Any] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        out["forward_single"] = statistics.median(singles) if singles else 0.0
        # the steady cycle: the gaps between this rank's consecutive forward ends (fill, drain and
        # the step's own start and end fall outside them; a spell of load moves a few, not the median)
        gaps = [
            b - a
            for step in self.kept
            for a, b in itertools.pairwise([t1 for k, _, t1 in step["events"] if k == "forward"])
        ]
        out["cycle"] = statistics.median(gaps) if gaps else 0.0
        last = self.kept[-1]
        out["timeline"] = {
            "start": last["start"],
            "events": [
                [k, round((t0 - last["start"]) * 1e3, 3), round((t1 - last["start"]) * 1e3, 3)]
                for k, t0, t1 in last["events"]
            ],
        }
        return out


def _transfers(marks: list[list[dict[str, list[float]]]]) -> list[float]:
    """Per boundary b (rank b to b + 1), the median seconds a micro-batch's activations spent on
    the way: from when both ends were ready (rank b's send posted, rank b + 1's receive posted:
    gloo moves the bytes only then) to rank b + 1 holding them (its wait returning). ``marks``:
    per rank, per kept step, the ends of its ``send_post``, ``recv_post`` and ``recv_wait``."""
    out = []
    for b in range(len(marks) - 1):
        spans = []
        for sent, got in zip(marks[b], marks[b + 1]):
            for s_end, r_post, r_done in zip(sent["send_post"], got["recv_post"], got["recv_wait"]):
                spans.append(r_done - max(s_end, r_post))
        out.append(statistics.median(spans) if spans else 0.0)
    return out


def _reference(model, x):
    import torch

    with torch.no_grad():
        return model(x)


def _close(out, expected) -> bool:
    from trainmaster.partition.pipeline import _close as close

    if isinstance(out, (tuple, list)) and len(out) == 1 and not isinstance(expected, (tuple, list)):
        out = out[0]
    return close(out, expected)


CACHE_SWEEP_BYTES = 64 << 20  # twice the 32 MiB last-level cache of the machine this was measured on


def _stage_compute(pipe, rank: int, example, runs: int) -> tuple[float, float]:
    """Median seconds of this rank's stage submodule on its own input, captured by a forward
    hook while the whole split model runs here once: warm (run after run, its weights left in
    the cache) and cold (after writing ``CACHE_SWEEP_BYTES`` elsewhere, as in a pipeline, where
    the other stages' weights and activations pass through the shared cache between two of this
    stage's micro-batches: GPT-2-like's six blocks ran 19 ms warm and 26.5 ms in the pipeline)."""
    import torch

    mod = pipe.get_stage_module(rank)
    captured: list[tuple] = []
    handle = mod.register_forward_pre_hook(lambda _, args: captured.append(args))
    sweep = torch.zeros(CACHE_SWEEP_BYTES // 4)
    with torch.no_grad():
        try:
            pipe(example)
        finally:
            handle.remove()
        args = captured[0]
        mod(*args)  # warm-up
        warm, cold = [], []
        for _ in range(max(runs, 1)):
            t0 = time.perf_counter()
            mod(*args)
            warm.append(time.perf_counter() - t0)
            sweep.add_(1.0)
            t0 = time.perf_counter()
            mod(*args)
            cold.append(time.perf_counter() - t0)
    return statistics.median(warm), statistics.median(cold)


def _message_cost(rank: int, world: int, repeats: int = 20) -> float | None:
    """Half the round trip of a one-element tensor between this rank and the next (median):
    a gloo message's fixed cost; None on the last rank (no next)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(1)
    trips = []
    for _ in range(repeats + 2):
        dist.barrier()
        if rank % 2 == 0 and rank + 1 < world:
            t0 = time.perf_counter()
            dist.send(x, rank + 1)
            dist.recv(x, rank + 1)
            trips.append((time.perf_counter() - t0) / 2)
        elif rank % 2 == 1:
            dist.recv(x, rank - 1)
            dist.send(x, rank - 1)
    for _ in range(repeats + 2):  # the other pairs: odd ranks to their next
        dist.barrier()
        if rank % 2 == 1 and rank + 1 < world:
            t0 = time.perf_counter()
            dist.send(x, rank + 1)
            dist.recv(x, rank + 1)
            trips.append((time.perf_counter() - t0) / 2)
        elif rank % 2 == 0 and rank > 0:
            dist.recv(x, rank - 1)
            dist.send(x, rank - 1)
    return statistics.median(trips[2:]) if len(trips) > 2 else None


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 3 if values else []
    return [float(x) for x in statistics.quantiles(values, n=4, method="inclusive")]


def main() -> int:
    run = StageRun(**json.loads(os.environ["TM_STAGE_RUN"]))
    report = run_rank(
        int(os.environ["TM_RANK"]),
        int(os.environ["TM_WORLD"]),
        os.environ["TM_MASTER"],
        int(os.environ["TM_PORT"]),
        run,
    )
    if report is not None:
        out = Path(os.environ["TM_OUTPUT"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "run": asdict(run)}, indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
