"""The pipeline framework: a traced model split by a partition runs as stage roles under the
controller, passing tensors between processes; outputs equal the unsplit model's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainmaster.frameworks import get_framework


def test_pipeline_framework_validates_params():
    """Mechanism: the pipeline framework's roles and parameters are checked before running."""
    fw = get_framework("pipeline")
    errors = fw.validate(
        {"frameworkParams": {"model": "nocolon", "bogus": 1, "methods": ["nope"]}},
        [{"name": "stage", "replicas": 2}, {"name": "driver", "replicas": 2}],
    )
    text = "\n".join(errors)
    assert "model" in text and "bogus" in text and "nope" in text and "exactly 1" in text
    assert fw.validate({}, [{"name": "stage"}, {"name": "driver"}]) == []


@pytest.mark.timeout(280)
def test_pipeline_runs_under_controller(tmp_path: Path):
    """Mechanism: stages as controller roles run a torch.fx split of a real model for our
    partition and METIS's, k = 2; every output equals the unsplit model's."""
    job = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "pipe-test"},
        "spec": {
            "framework": "pipeline",
            "frameworkParams": {
                "model": "trainmaster.partition.models:inception",
                "input_shape": [1, 3, 16, 16],
                "samples": 4,
                "methods": ["trainmaster", "metis"],
            },
            "roles": [{"name": "stage", "replicas": 2}, {"name": "driver"}],
            "output": {"path": str(tmp_path / "out")},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "TRAINMASTER_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-m", "trainmaster", "run", str(path), "--interval", "0.2", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=270,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert report["k"] == 2 and set(report["runs"]) == {"trainmaster", "metis"}
    for run in report["runs"].values():
        assert run["outputs_equal_unsplit"] is True
        assert run["seconds_per_sample"] > 0
    from trainmaster.service.dashboard.capability import capability_views  # the dashboard's graph view

    view = next(v for v in capability_views(tmp_path / "out") if v.kind == "partition.plan")
    assert view.svg.count('class="capability partition-graph"') == 2 and "trainmaster: " in view.caption


def test_link_delays_each_message_by_latency_plus_bytes_over_bandwidth():
    """Mechanism: emulated link (pipeline.Link): a value message is available to its receiver
    latency + bytes / bandwidth after it was sent (the sender writes it at once, the receiver's
    mailbox holds it until due), messages overlap (no queueing behind each other, as the
    simulator prices edges), control messages pass at once."""
    import threading
    import time
    from multiprocessing.connection import Pipe

    from trainmaster.partition.pipeline import Link, Mailbox, _reader, _send

    recv, send = Pipe(duplex=False)
    box = Mailbox()
    threading.Thread(target=_reader, args=(recv, box), daemon=True).start()
    link = Link(send, latency=0.05, bandwidth=1e6)
    try:
        t0 = time.perf_counter()
        _send(link, ("value", 0, "x", b"x" * 100_000))  # due at 0.05 + ~0.1 = 0.15 s
        _send(link, ("value", 0, "y", b"y" * 10))  # due at ~0.05 s: not behind the first
        _send(link, ("ready", 1))  # control: at once
        assert box.take_control(timeout=5.0, kind="ready") == ("ready", 1)
        control = time.perf_counter() - t0
        assert box.take((0, "y"), timeout=5.0) == b"y" * 10
        small = time.perf_counter() - t0
        assert box.take((0, "x"), timeout=5.0) == b"x" * 100_000
        large = time.perf_counter() - t0
        assert control < 0.04
        assert 0.05 <= small < 0.14
        assert 0.15 <= large < 0.25 + 0.5  # generous upper bound: a loaded machine
        with pytest.raises(TimeoutError, match="'z' of sample 0"):
            box.take((0, "z"), timeout=0.01)
    finally:
        link.close()
        recv.close()


@pytest.mark.timeout(280)
def test_local_pipeline_with_measured_costs_and_emulated_links():
    """Mechanism: real pipeline comparison: stages as processes on loopback with emulated
    links and measured op costs; outputs equal the unsplit model's and each method reports a
    predicted makespan and a measured one-sample latency (which pays at least the emulated
    link of every cut the sample crosses)."""
    from trainmaster.partition.pipeline import PipelineRun, run_local

    run = PipelineRun(
        model="trainmaster.partition.models:mlp",
        input_shape=(4, 64),
        samples=3,
        latency_samples=3,
        costs="measured",
        emulate_link=True,
        bandwidth=1e7,
        latency=0.02,
        profile_runs=2,
        pin_cores=True,
        trace=True,
    )
    report = run_local(run, 2, timeout=120)
    assert report["cost_model"]["costs"] == "measured" and report["emulated_link"] is True
    # the calibration run measured a message's trips to and from the driver
    assert report["calibration"]["input_message"] > 0 and report["calibration"]["output_message"] > 0
    for method in ("trainmaster", "metis"):
        r = report["runs"][method]
        assert r["outputs_equal_unsplit"] is True
        assert r["simulated_makespan"] > 0 and r["latency_seconds"] > 0 and r["predicted_latency"] > 0
        stages = r["breakdown"]["stages"]
        assert [st["stage"] for st in stages] == [0, 1]
        assert all(st["measured_end"] >= st["measured_compute"] >= 0 for st in stages)
        if r["cut_count"] > 0:  # a sample crosses at least one emulated 20 ms link
            assert r["latency_seconds"] >= 0.02


def test_pipeline_framework_checks_costs_and_tracer():
    """Mechanism: the pipeline framework refuses unknown cost and tracer choices."""
    fw = get_framework("pipeline")
    errors = "\n".join(
        fw.validate({"frameworkParams": {"costs": "guess", "tracer": "jit"}}, [{"name": "stage"}, {"name": "driver"}])
    )
    assert "costs" in errors and "tracer" in errors


def test_pipeline_latency_model_by_hand():
    """Mechanism: pipeline latency model (pipeline.pipeline_latency): a stage runs its nodes in
    order when their inputs are in; a value sent elsewhere is pickled on the sender's thread,
    then costs the fixed trip, unpickling and the link (latency + lateness + bytes / bandwidth);
    the input reaches its readers after the measured input trip, the output reaches the driver
    after the output trip. A 3-layer MLP split 2 | 3 operators, every number chosen by hand."""
    import torch

    from trainmaster.partition.models import mlp
    from trainmaster.partition.pipeline import Calibration, Message, PipelineRun, pipeline_latency

    gm = torch.fx.symbolic_trace(mlp(8, 3, inputs=8, classes=4))
    names = [n.name for n in gm.graph.nodes]
    ops = [n for n in names if n not in ("x", "input", "output") and not n.startswith("input")]
    assert len(ops) == 5  # linear, relu, linear, relu, linear
    assignment = {n: (0 if i < 2 else 1) for i, n in enumerate(ops)}
    assignment.update({n: 0 for n in names if n not in assignment})
    run = PipelineRun(model="m:f", input_shape=(1, 8), latency=0.5, bandwidth=100.0, emulate_link=True)
    latency = pipeline_latency(
        gm,
        assignment,
        names,
        {n: 1.0 for n in ops},
        {n: Message(size=100, dumps=0.1, loads=0.2) for n in names},
        run,
        Calibration(node_seconds={}, input_message=0.3, output_message=0.4),
        late=0.05,
    )
    # input 0.3; stage 0: 0.3 -> 2.3, pickles 0.1; the message: 0.3 + 0.2 + 0.5 + 0.05 + 1.0;
    # stage 1: 4.45 -> 7.45, pickles 0.1, the output trip 0.4
    assert latency == pytest.approx(7.95)


def test_mailbox_control_by_kind():
    """Mechanism: control messages by kind (Mailbox.take_control): a stage with nothing to
    compute reports its trace before another stage says it is ready; the driver takes each
    kind in turn, and a wait for a message that never comes ends with a timeout naming it."""
    from trainmaster.partition.pipeline import Mailbox

    box = Mailbox()
    box.put_control(("trace", 1, [], {}))
    box.put_control(("ready", 0))
    assert box.take_control(kind="ready") == ("ready", 0)
    assert box.take_control(kind="trace")[0] == "trace"
    with pytest.raises(TimeoutError, match="ready"):
        box.take_control(timeout=0.01, kind="ready")
