"""Pipeline split mode: split points torch.distributed.pipelining takes, ours against the
equal-layers and equal-parameters splitters, and a real two-stage pipeline over gloo."""

import itertools
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

from trainmaster.cli.main import main
from trainmaster.partition.models import gpt2_lm, resnet_like
from trainmaster.errors import UserError
from trainmaster.partition.stages import build_pipe, calibrated, model_layout, repeated_blocks, split


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as code:
        return int(code.code or 0)
    return 0


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    model = gpt2_lm(layers=4, width=64, heads=2, vocab=512, positions=32).eval()
    args = (torch.randint(0, 512, (1, 16)),)
    return model, args, model_layout(model, args)


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = resnet_like(8).eval()
    args = (torch.randn(1, 3, 16, 16),)
    return model, args, model_layout(model, args)


@pytest.mark.parametrize("which", ["gpt2", "resnet"])
@pytest.mark.parametrize("method", ["trainmaster", "layers", "params"])
def test_split_points_build_a_pipeline_of_k_stages_equal_to_the_model(which, method, request):
    """Mechanism: the split points are module FQNs that torch.distributed.pipelining.pipeline
    takes as SplitPoint.BEGINNING: the Pipe has exactly k stages, contiguous in execution order
    (a chain), and running it gives the unsplit model's output."""
    model, args, layout = request.getfixturevalue(which)
    for k in (3,):
        plan = split(layout, k, method, bandwidth=1.25e7)
        assert len(plan.split_points) == k - 1 and plan.starts == sorted(plan.starts)
        pipe = build_pipe(model, args, plan.split_points)
        assert pipe.num_stages == k
        with torch.no_grad():
            out, ref = pipe(*args), model(*args)
        out = out[0] if isinstance(out, (tuple, list)) else out
        assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("which", ["gpt2", "resnet"])
def test_ours_has_the_least_period_of_every_split(which, request):
    """Mechanism: ours's dynamic programme finds the exact least period (the busiest stage, its
    input's transfer plus its compute: the receive is posted after the previous forward and the
    bytes move only then) over every choice of split points, checked by trying them all; among
    splits within 2% of it, none has a lower latency; and never above the baselines'."""
    _, _, layout = request.getfixturevalue(which)
    bandwidth, overhead = 2e6, 1e-4
    link = overhead * layout.live_count + layout.live_bytes / bandwidth
    prefix = np.concatenate([[0.0], np.cumsum(layout.cost)])
    pos = [p for p, _ in layout.candidates]
    k = 3
    best_period, best_latency = float("inf"), float("inf")
    for combo in itertools.combinations(range(len(pos)), k - 1):
        starts = [0] + [pos[j] for j in combo] + [layout.n]
        compute = [prefix[b] - prefix[a] for a, b in zip(starts, starts[1:])]
        period = max([compute[0]] + [link[j] + c for j, c in zip(combo, compute[1:])])
        latency = sum(compute) + sum(link[j] for j in combo)
        best_period = min(best_period, period)
        best_latency = min(best_latency, latency) if period <= best_period * 1.02 else best_latency
    ours = split(layout, k, "trainmaster", bandwidth=bandwidth, overhead=overhead)
    # the least period, or (the latency's pass) a split within 2% of it, never a worse one
    assert best_period * (1 - 1e-9) <= ours.period <= best_period * 1.02 * (1 + 1e-9)
    for combo in itertools.combinations(range(len(pos)), k - 1):
        starts = [0] + [pos[j] for j in combo] + [layout.n]
        compute = [prefix[b] - prefix[a] for a, b in zip(starts, starts[1:])]
        if max([compute[0]] + [link[j] + c for j, c in zip(combo, compute[1:])]) <= best_period * 1.02:
            assert ours.latency <= sum(compute) + sum(link[j] for j in combo) + 1e-12
    for method in ("layers", "params"):
        assert ours.period <= split(layout, k, method, bandwidth=bandwidth, overhead=overhead).period + 1e-12


def test_equal_layers_follows_torchtitan_s_rule(gpt2):
    """Mechanism (equal-layers baseline): the repeated blocks (GPT-2's transformer.h.*) dealt
    out with the embedding and the output each weighing one layer, the extra to the first
    stages: 4 blocks + 2 = 6 units; k = 2: 3 + 3, k = 3: 2 + 2 + 2, k = 4: 2 + 2 + 1 + 1 (the
    last stage holds only the output modules)."""
    _, _, layout = gpt2
    assert repeated_blocks(layout) == [f"transformer.h.{i}" for i in range(4)]
    assert split(layout, 2, "layers").split_points == ["transformer.h.2"]
    assert split(layout, 3, "layers").split_points == ["transformer.h.1", "transformer.h.3"]
    assert split(layout, 4, "layers").split_points == ["transformer.h.1", "transformer.h.3", "transformer.ln_f"]


def test_equal_params_splits_where_the_parameters_reach_each_share(resnet):
    """Mechanism (equal-parameters baseline, PiPPy's rule): each split is the first split point
    where the parameter bytes before it reach j / k of the total."""
    _, _, layout = resnet
    prefix = np.concatenate([[0.0], np.cumsum(layout.param_bytes)])
    total = prefix[-1]
    plan = split(layout, 3, "params")
    for j, start in enumerate(plan.starts[1:], 1):
        assert prefix[start] >= total * j / 3
        earlier = [p for p, _ in layout.candidates if p < start]
        assert all(prefix[p] < total * j / 3 for p in earlier[-1:])
    assert sum(plan.stage_param_bytes) == pytest.approx(total)


def test_a_split_inside_a_residual_block_sends_the_skip_too(resnet):
    """Mechanism (boundary bytes): every value alive across a split is sent: before a block's
    second convolution, the first one's output and the block's input (the residual) cross."""
    model, args, layout = resnet
    at = dict((fqn, j) for j, (_, fqn) in enumerate(layout.candidates))
    inside = at["3.conv2"]
    before = at["3"]
    assert layout.live_count[inside] == 2 and layout.live_count[before] == 1
    assert layout.live_bytes[inside] == pytest.approx(2 * layout.live_bytes[before])


def test_calibrated_costs_and_shared_cores_set_the_period(gpt2):
    """Mechanism (pipeline period model): operator costs are moved to sum to the forward's
    measured wall time, so compute weighs right against the links; the time the profile does not
    see is spread as an equal time per operator (dispatch between operators), and a wall time
    below the profile takes an equal time back from each, none below zero; with k stages on
    fewer cores, the period is at least the whole compute over the cores, for every split alike
    (the choice of split points does not change)."""
    _, _, layout = gpt2
    total = float(layout.cost.sum())
    slower = calibrated(layout, 2 * total)
    assert slower.cost.sum() == pytest.approx(2 * total)
    assert np.allclose(slower.cost - layout.cost, total / layout.n)  # the same added to every operator
    faster = calibrated(layout, 0.5 * total)
    assert faster.cost.sum() == pytest.approx(0.5 * total) and (faster.cost >= 0).all()
    assert (np.diff(faster.cost[np.argsort(layout.cost)]) >= -1e-15).all()  # the order of costs kept
    scaled = calibrated(layout, 0.02)
    assert scaled.cost.sum() == pytest.approx(0.02)
    for k in (2, 3, 4):
        free = split(scaled, k, "trainmaster", bandwidth=1e9)
        shared = split(scaled, k, "trainmaster", bandwidth=1e9, cores=2)
        assert shared.split_points == free.split_points
        assert shared.period == pytest.approx(max(free.period, 0.02 / 2 if k > 2 else 0.0))
    with pytest.raises(UserError):
        calibrated(layout, 0.0)
    with pytest.raises(UserError):
        split(scaled, 2, cores=0)


def test_stage_runner_runs_a_real_two_stage_pipeline_over_gloo(tmp_path):
    """Mechanism (real pipelines): two processes, a gloo process group, each builds the model,
    splits it at the plan's split point with torch.distributed.pipelining and runs its stage
    under ScheduleGPipe; the report has the measured latency, throughput, stage compute and
    message cost, and the outputs equal the unsplit model's."""
    from trainmaster.partition.stage_runner import StageRun

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = StageRun(
        model="trainmaster.partition.models:mlp",
        input_shape=[2, 64],
        split_points=["6"],
        model_args={"width": 64, "depth": 6},
        microbatches=2,
        throughput_rounds=1,
        latency_samples=2,
        calibration_runs=2,
    )
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "TM_WORLD": "2",
        "TM_MASTER": "127.0.0.1",
        "TM_PORT": str(port),
        "TM_STAGE_RUN": json.dumps(asdict(run)),
        "TM_OUTPUT": str(report),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    argv = [sys.executable, "-m", "trainmaster.partition.stage_runner"]
    procs = [subprocess.Popen(argv, env={**env, "TM_RANK": str(r)}, stderr=subprocess.PIPE) for r in range(2)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    doc = json.loads(report.read_text())
    assert doc["outputs_equal_unsplit"] and doc["k"] == 2
    assert doc["latency_seconds"] > 0 and doc["samples_per_second"] > 0
    assert len(doc["stage_compute_seconds"]) == 2 and doc["message_fixed_seconds"] > 0
    assert len(doc["stage_compute_cold_seconds"]) == 2 and all(c > 0 for c in doc["stage_compute_cold_seconds"])
    # the streaming breakdown: each rank's phases per micro-batch as it ran beside the other, and
    # what none of them accounts for; the receiving rank posts and waits on receives, the sender sends
    first, second = doc["stage_streaming_seconds"]
    for b in (first, second):
        assert b["forward"] > 0 and b["step"] >= b["forward"]
        assert b["step"] == pytest.approx(
            sum(b[p] for p in ("recv_post", "recv_wait", "forward", "send_post", "send_wait", "outside"))
        )
        assert [e[0] for e in b["timeline"]["events"]].count("forward") == 2 * run.microbatches
    assert first["send_post"] > 0 and first["recv_wait"] == 0 and second["recv_wait"] > 0 and second["send_post"] == 0
    assert doc["cores_per_rank"] >= 1


def test_split_points_on_the_command_line(capsys):
    """Mechanism (CLI): --split-points prints the stages and the split_spec to pass to
    torch.distributed.pipelining.pipeline; a bad splitter or a graph file is refused (exit 2)."""
    model = "trainmaster.partition.models:mlp"
    assert run_cli(["partition", model, "-k", "2", "--input-shape", "4,64", "--split-points", "layers", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["split_points"]) == 1 and doc["method"] == "layers"
    assert run_cli(["partition", model, "-k", "2", "--input-shape", "4,64", "--split-points", "trainmaster"]) == 0
    assert "SplitPoint.BEGINNING" in capsys.readouterr().out
    assert run_cli(["partition", model, "-k", "2", "--input-shape", "4,64", "--split-points", "equal"]) == 2
    assert run_cli(["partition", "examples/partition-inception.json", "-k", "2", "--split-points", "layers"]) == 2
    assert run_cli(["partition", model, "-k", "2", "--split-points", "layers"]) == 2  # no --input-shape
