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
  period is the difference over the extra micro-batches (the pipeline's fill and drain cancel);
  samples per second = 1 / period;
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
        compute = 0.0
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
        for i, x in enumerate(inputs):
            dist.barrier()
            t_start = time.perf_counter()
            with torch.no_grad():
                out = one.step(x) if rank == 0 else one.step()
            t_end = time.perf_counter()
            stamps: list[Any] = [None] * world
            dist.all_gather_object(stamps, (t_start, t_end))
            if i >= 2:  # the first steps pay for lazy initialisation
                latency.append(stamps[last][1] - stamps[0][0])
            if rank == last:
                same = same and _close(out, _reference(model, x))
        period_rows = []
        timer = _ChunkTimer(stage)
        many = {m: ScheduleGPipe(stage, n_microbatches=m) for m in (run.microbatches, 2 * run.microbatches)}
        for r in range(run.throughput_rounds + 1):
            times = {}
            for m, schedule in many.items():
                batch = torch.cat([_example(run, run.seed + 1000 + j) for j in range(m)])
                dist.barrier()
                timer.reset()
                t_start = time.perf_counter()
                with torch.no_grad(), timer:
                    out = schedule.step(batch) if rank == 0 else schedule.step()
                t_end = time.perf_counter()
                if r > 0 and m == 2 * run.microbatches:
                    timer.keep()
                stamps = [None] * world
                dist.all_gather_object(stamps, (t_start, t_end))
                times[m] = stamps[last][1] - stamps[0][0]
                if rank == last and r == 0:
                    same = same and _close(out, _reference(model, batch))
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
        if rank != 0:
            return None
        m1, m2 = run.microbatches, 2 * run.microbatches
        # a round whose longer step was not longer (a spell of load on a shared machine) counts
        # its longer step's time per micro-batch, fill and drain included, instead
        periods = [(t[m2] - t[m1]) / (m2 - m1) if t[m2] > t[m1] else t[m2] / m2 for t in period_rows]
        return {
            "k": world,
            "split_points": run.split_points,
            "pipe_build_seconds": build_seconds,
            "latency_seconds": statistics.median(latency),
            "latency_quartiles_seconds": _quartiles(latency),
            "latencies": latency,
            "period_seconds": statistics.median(periods),
            "periods": periods,
            "samples_per_second": 1.0 / max(statistics.median(periods), 1e-12),
            "step_seconds": period_rows,
            "stage_compute_seconds": computes,
            "stage_streaming_seconds": busy,
            "cpu_cores": os.cpu_count(),
            "cores_per_rank": len(os.sched_getaffinity(0)),
            "message_fixed_seconds": statistics.median([f for f in fixes if f is not None] or [0.0]),
            "outputs_equal_unsplit": bool(equal[last]),
        }
    finally:
        dist.destroy_process_group()


class _ChunkTimer:
    """Per micro-batch, while a schedule streams: the seconds this rank waits for its inputs
    (the receive posted and waited on before the chunk) and the seconds its forward takes
    (``forward_one_chunk``: the stage's compute beside every other rank's, on shared cores).
    Patches ``torch.distributed.pipelining.schedules._wait_batch_p2p`` and the stage's method
    inside ``with``; medians over the kept steps."""

    def __init__(self, stage):
        self.stage = stage
        self.waits: list[float] = []
        self.forwards: list[float] = []
        self.kept: dict[str, list[float]] = {"recv_wait": [], "forward": []}

    def reset(self) -> None:
        self.waits, self.forwards = [], []

    def keep(self) -> None:
        self.kept["recv_wait"] += self.waits
        self.kept["forward"] += self.forwards

    def __enter__(self):
        from torch.distributed.pipelining import schedules

        self._wait, self._forward = schedules._wait_batch_p2p, self.stage.forward_one_chunk

        def wait(work):
            t0 = time.perf_counter()
            try:
                return self._wait(work)
            finally:
                self.waits.append(time.perf_counter() - t0)

        def forward(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self._forward(*args, **kwargs)
            finally:
                self.forwards.append(time.perf_counter() - t0)

        schedules._wait_batch_p2p = wait
        self.stage.forward_one_chunk = forward
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.pipelining import schedules

        schedules._wait_batch_p2p = self._wait
        self.stage.forward_one_chunk = self._forward

    def summary(self) -> dict[str, float]:
        """Median forward per chunk, and every wait of the step (the receives before each
        forward, the sends' at the step's end) per chunk."""
        n = max(len(self.kept["forward"]), 1)
        return {
            "forward": statistics.median(self.kept["forward"]) if self.kept["forward"] else 0.0,
            "wait_total_per_chunk": sum(self.kept["recv_wait"]) / n,
        }


def _reference(model, x):
    import torch

    with torch.no_grad():
        return model(x)


def _close(out, expected) -> bool:
    from trainmaster.partition.pipeline import _close as close

    if isinstance(out, (tuple, list)) and len(out) == 1 and not isinstance(expected, (tuple, list)):
        out = out[0]
    return close(out, expected)


def _stage_compute(pipe, rank: int, example, runs: int) -> float:
    """Median seconds of this rank's stage submodule on its own input, captured by a forward
    hook while the whole split model runs here once."""
    import torch

    mod = pipe.get_stage_module(rank)
    captured: list[tuple] = []
    handle = mod.register_forward_pre_hook(lambda _, args: captured.append(args))
    with torch.no_grad():
        try:
            pipe(example)
        finally:
            handle.remove()
        args = captured[0]
        mod(*args)  # warm-up
        times = []
        for _ in range(max(runs, 1)):
            t0 = time.perf_counter()
            mod(*args)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
