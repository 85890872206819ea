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
    link of every cut the sample crosses); in rounds, each predicted from costs measured again
    just before it."""
    from trainmaster.partition.pipeline import PipelineRun, run_local

    run = PipelineRun(
        model="trainmaster.partition.models:mlp",
        # not the callable's defaults: a stage that built the model without them would not run
        model_args={"width": 48, "depth": 4},
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
        rounds=2,
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
        q1, median, q3 = r["latency_quartiles_seconds"]
        assert q1 <= median <= q3 and median == pytest.approx(r["latency_seconds"])
        # each round predicted from costs measured again just before it
        assert len(r["predicted_latency_rounds"]) == 2 and all(p > 0 for p in r["predicted_latency_rounds"])
        q1, median, q3 = r["latency_over_predicted_quartiles"]
        assert 0 < q1 <= median <= q3


def test_pipeline_framework_checks_costs_and_tracer():
    """Mechanism: the pipeline framework refuses unknown cost and tracer choices and model
    arguments that are not a mapping, and links asked to be both emulated and real."""
    fw = get_framework("pipeline")
    params = {"costs": "guess", "tracer": "jit", "model_args": [3], "emulate_link": True, "real_links": True}
    errors = "\n".join(fw.validate({"frameworkParams": params}, [{"name": "stage"}, {"name": "driver"}]))
    assert "costs" in errors and "tracer" in errors and "model_args" in errors
    assert "spec.frameworkParams.real_links" in errors


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

    def predict(run: PipelineRun, fixed: float, late: float) -> float:
        return pipeline_latency(
            gm,
            assignment,
            names,
            {n: 1.0 for n in ops},
            {n: Message(size=100, dumps=0.1, loads=0.2) for n in names},
            run,
            Calibration(node_seconds={}, input_message=0.3, output_message=0.4, fixed=fixed),
            late=late,
        )

    emulated = PipelineRun(model="m:f", input_shape=(1, 8), latency=0.5, bandwidth=100.0, emulate_link=True)
    # input 0.3; stage 0: 0.3 -> 2.3, pickles 0.1; the message: 0.3 + 0.2 + 0.5 + 0.05 + 1.0;
    # stage 1: 4.45 -> 7.45, pickles 0.1, the output trip 0.4
    assert predict(emulated, fixed=0.3, late=0.05) == pytest.approx(7.95)
    # real links (a testbed): the same link price, no emulation lateness, and the fixed part of
    # a message is what the input's trip left after its own time on the link (here 0.1)
    real = PipelineRun(model="m:f", input_shape=(1, 8), latency=0.5, bandwidth=100.0, real_links=True)
    assert predict(real, fixed=0.1, late=0.0) == pytest.approx(7.7)
    # neither: messages cost their fixed part, pickling and unpickling only
    bare = PipelineRun(model="m:f", input_shape=(1, 8), latency=0.5, bandwidth=100.0)
    assert predict(bare, fixed=0.3, late=0.05) == pytest.approx(6.4)


def test_pipeline_latency_queues_messages_on_real_links():
    """Mechanism: link contention on real links (pipeline_latency with ``real_links``): two
    values stage 0 sends to stage 1 one after the other share stage 0's link to the switch and
    stage 1's link from it, so the second starts on the wire when the first has left it; an
    emulated link (like the partitioner's simulator) gives each message a link of its own."""
    import torch

    from trainmaster.partition.pipeline import Calibration, Message, PipelineRun, pipeline_latency

    class Fork(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x) + self.b(x)

    gm = torch.fx.symbolic_trace(Fork())
    names = [n.name for n in gm.graph.nodes]
    assert names == ["x", "a", "b", "add", "output"]
    assignment = {"x": 0, "a": 0, "b": 0, "add": 1, "output": 0}

    def predict(run: PipelineRun) -> float:
        return pipeline_latency(
            gm,
            assignment,
            names,
            {"a": 1.0, "b": 1.0, "add": 1.0},
            {n: Message(size=100, dumps=0.1, loads=0.2) for n in names},
            run,
            Calibration(node_seconds={}, input_message=0.3, output_message=0.4, fixed=0.1),
            late=0.0,
        )

    link = dict(model="m:f", input_shape=(1, 8), latency=0.5, bandwidth=100.0)
    # a: 0.3 -> 1.3, pickled by 1.4, on the wire 1.4 -> 2.9, ready 3.2; b: 1.4 -> 2.4, pickled by
    # 2.5, waits for the wire until 2.9, off it at 4.4, ready 4.7; add 4.7 -> 5.7, pickled 5.8,
    # the output trip 0.4
    assert predict(PipelineRun(**link, real_links=True)) == pytest.approx(6.2)
    # emulated: b's message has its own link: ready 2.5 + 0.1 + 0.2 + 0.5 + 1.0 = 4.3
    assert predict(PipelineRun(**link, emulate_link=True)) == pytest.approx(5.8)


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


def test_stage_frees_each_value_after_its_last_local_use():
    """Mechanism: a stage frees every value once its last local reader has run
    (pipeline.last_local_uses), as the unsplit model does, instead of holding a sample's values
    to its end (which made the heap be given back and page-faulted in again every sample, at a
    cost that depended on how many values a stage held). Run as a stage runs its share, with
    the other stage's values handed in: same output, each value dropped exactly once and never
    before a local reader, and no more than a few values held at a time."""
    import torch

    from trainmaster.partition.models import mlp
    from trainmaster.partition.pipeline import last_local_uses

    model = mlp(16, 8, inputs=8, classes=4).eval()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 8)
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_module"]
    mine = calls[3:]  # the second stage: its first input comes from the other one
    release = last_local_uses(mine)
    dropped = [v for vs in release.values() for v in vs]
    assert len(dropped) == len(set(dropped))
    assert set(dropped) == set(mine) | {a for n in mine for a in n.all_input_nodes}
    position = {n.name: i for i, n in enumerate(mine)}
    for reader, values in release.items():
        for v in values:
            assert all(position[u.name] <= position[reader] for u in v.users if u.name in position)
    with torch.no_grad():
        upstream = torch.fx.Interpreter(gm)
        upstream.env = {}
        upstream.run(x)  # garbage-collects; recompute the handed-in value below
        handed = calls[2]
        value = x
        for n in calls[:3]:
            value = getattr(gm, n.target)(value)
        interp = torch.fx.Interpreter(gm)
        interp.env = {handed: value}
        held = []
        for n in mine:
            out = interp.env[n] = interp.run_node(n)
            for v in release.get(n.name, ()):
                del interp.env[v]
            held.append(len(interp.env))
        assert torch.allclose(out, model(x)) and interp.env == {}
    assert max(held) <= 2


def test_profiler_overhead_is_measured_and_taken_off():
    """Mechanism: profiler costs less the profiler's own recording cost
    (importers._ProfilerOverhead): from the probe ranges recorded in the same session, the cost
    of a range (the empty probes' median) and of each op recorded in it (the op probes' median,
    less the range's and the ops' unprofiled time); a node's range counts every op event nested
    in it."""
    from types import SimpleNamespace

    from trainmaster.partition.importers import _descendants, _ProfilerOverhead

    def event(name, us, children=()):
        return SimpleNamespace(name=name, cpu_time_total=us, cpu_children=list(children))

    ops = _ProfilerOverhead.PROBE_OPS
    # a range costs 3 us to record, an op 0.5 us on top of its own 1 us
    events = [event("tm-probe::empty", us) for us in (3.0, 2.9, 3.1, 30.0, 3.0)]
    events += [event("tm-probe::ops", 3.0 + ops * 1.5 + d) for d in (0.0, -0.1, 0.1, 40.0, 0.0)]
    overhead = _ProfilerOverhead.from_events(events, plain_op=1e-6)
    assert overhead.per_range == pytest.approx(3e-6) and overhead.per_op == pytest.approx(0.5e-6)
    assert _ProfilerOverhead.from_events([], 1e-6) == _ProfilerOverhead(0.0, 0.0)
    nested = event("tm::linear", 20.0, [event("aten::linear", 15.0, [event("aten::addmm", 14.0)]), event("aten::t", 1)])
    assert _descendants(nested) == 3


def test_pipeline_report_separates_out_of_sample_cases(tmp_path: Path):
    """Mechanism: the pipeline comparison's verdict (bench/partition.py ``write_pipeline``):
    'N of M within 20%' counted apart for in-sample and out-of-sample cases, the spread of the
    lone samples (IQR of measured / predicted) and each case's load in the table, and a plot
    with every case; on rows written by hand."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_partition", Path(__file__).parents[2] / "bench/partition.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)

    def row(case, method, predicted, measured, in_sample):
        return {
            "case": case,
            "in_sample": in_sample,
            "k": 2,
            "method": method,
            "load": 1.5,
            "cut_count": 3,
            "predicted_latency": predicted,
            "predicted_makespan": predicted,
            "measured_latency": measured,
            "measured_latency_quartiles": [measured * 0.9, measured, measured * 1.1],
            "predicted_max_load": predicted / 3,
            "measured_seconds_per_sample": predicted / 3,
            "outputs_equal_unsplit": True,
            "breakdown": None,
        }

    rows = [
        row("a", "trainmaster", 0.010, 0.011, True),
        row("a", "metis", 0.020, 0.030, True),  # 1.5x: outside
        row("b", "trainmaster", 0.010, 0.0095, False),
        row("b", "metis", 0.012, 0.012, False),
    ]
    assert bench._verdict(rows) == "1 of 2 in-sample; 2 of 2 out-of-sample"
    doc = {"rows": rows, "link": bench.PIPELINE_LINK, "samples": 2, "latency_samples": 4, "rounds": 1}
    doc.update(load="1.5, 1.0, 0.5", cpus=2, command="python bench/partition.py --pipeline-only")
    bench.write_pipeline(doc, tmp_path / "pipe")
    md = (tmp_path / "pipe.md").read_text()
    assert "1 of 2 in-sample; 2 of 2 out-of-sample" in md and "a (metis, 1.50x)" in md
    assert "| b | out | 1.5 | trainmaster |" in md and "0.95 (0.85-1.05)" in md
    assert json.loads((tmp_path / "pipe.json").read_text())["rows"][2]["in_sample"] is False
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the bench extra) is not installed: table and JSON checked, the plot not drawn")
    assert (tmp_path / "pipe.png").stat().st_size > 0
