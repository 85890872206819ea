"""Graphs from real models: torch.fx / torch.export traces of an nn.Module, and ONNX files.

Node cost is compute time: FLOPs counted by ``torch.utils.flop_counter`` while each traced node
runs, divided by a device's FLOP rate (``flops_per_second``), or the node's measured wall time with
``measure=True``. Edge cost is the tensor's bytes divided by the link ``bandwidth``. Memory is the
parameter bytes a node owns plus its output bytes.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from trainmaster.errors import UserError
from trainmaster.partition.graph import Graph, build_graph

DEFAULT_FLOPS_PER_SECOND = 1e11  # a CPU-class device; only ratios matter to the partitioner


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


IMPORTERS = ("export", "fx", "onnx")
DEFAULT_IMPORTER = "export"
"""The one default of the library (``from_module``, ``trace_module``, ``from_callable``) and of
the CLI's ``--importer``: operator-level graphs, whose FLOPs are the ones that really run (an
nn.TransformerEncoder is ~100 operators, not the 3 module-level nodes torch.fx makes of it).

How a module becomes a graph: ``export`` (torch.export, operator level: the default, since it
sees the aten ops that really run), ``fx`` (torch.fx symbolic tracing, module level: keeps modules
with a fused fast path such as nn.TransformerEncoder as one opaque node), ``onnx`` (the TorchScript
ONNX exporter, then the ONNX importer)."""


def check_link(bandwidth: float, latency: float = 0.0) -> None:
    """Edge cost is latency + bytes / bandwidth: a zero, negative or NaN bandwidth has no meaning."""
    if not (np.isfinite(bandwidth) and bandwidth > 0):
        raise UserError(
            f"--bandwidth {bandwidth}: give the link's bytes per second, a positive finite number (e.g. 1e9)"
        )
    if not (np.isfinite(latency) and latency >= 0):
        raise UserError(f"latency {latency}: give the per-message seconds, a finite number >= 0")


def _user_frame(exc: BaseException) -> str:
    """Where in the user's code tracing failed: the innermost traceback frame outside torch and
    trainmaster, else the "File ..., line N" torch.export quotes in its message."""
    import traceback

    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(skip) and "importlib" not in f.filename
    ]
    if frames:
        f = frames[-1]
        return f"{f.filename}, line {f.lineno}: {f.line}"
    quoted = re.findall(r'File "([^"]+)", line (\d+)[^\n]*\n\s*(.*)', str(exc))
    quoted = [q for q in quoted if not q[0].startswith(skip)]
    if quoted:
        return f"{quoted[-1][0]}, line {quoted[-1][1]}: {quoted[-1][2].strip()}"
    return "unknown location"


def trace_failure(what: str, importer: str, exc: Exception) -> UserError:
    """A model that cannot be traced is the user's to change: say which op failed and where."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    other = [name for name in IMPORTERS if name != importer]
    return UserError(
        f"cannot trace {what} with the {importer} importer: {type(exc).__name__}: {first[:300]}",
        details=[
            f"at {_user_frame(exc)}",
            f"try --importer {' or '.join(other)}, or make that code traceable "
            "(no data-dependent Python control flow on tensors)",
        ],
    )


def trace_module(module, example_inputs: tuple, tracer: str = DEFAULT_IMPORTER):
    """A GraphModule for ``module``: torch.fx symbolic tracing, or torch.export's graph."""
    import torch

    if tracer == "fx":
        return torch.fx.symbolic_trace(module)
    if tracer == "export":
        return torch.export.export(module, example_inputs).module()
    raise UserError(f"unknown tracer {tracer!r}: use fx or export")


def from_module(
    module,
    example_inputs: tuple,
    bandwidth: float = 1e9,
    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
    measure: bool = False,
    tracer: str = DEFAULT_IMPORTER,
    latency: float = 0.0,
    costs: str = "flops",
    profile_runs: int = 5,
) -> tuple[Graph, Any]:
    """Trace ``module`` (``tracer``: torch.export by default, operator level, as the CLI does;
    ``"fx"`` for module-level nodes) and profile every node once on ``example_inputs``; returns
    the graph (node ids are the fx node names) and the GraphModule it describes. An edge costs
    ``latency + bytes / bandwidth`` (the latency models a message's fixed overhead). A node
    costs its FLOPs / ``flops_per_second``, or with ``costs="profiler"`` the CPU time
    torch.profiler records for it, mean of ``profile_runs`` runs (``node_times``)."""
    check_link(bandwidth, latency)
    _check_rate(flops_per_second)
    _check_costs(costs, profile_runs)
    gm = trace_module(module, example_inputs, tracer)
    profile = _profile(gm, example_inputs, flops_per_second, measure, profile_runs if costs == "profiler" else 0)
    return _graph_of(gm, profile, bandwidth, latency), gm


COSTS = ("flops", "profiler")


def _check_costs(costs: str, profile_runs: int) -> None:
    if costs not in COSTS:
        raise UserError(f"--costs {costs!r}: choose one of {', '.join(COSTS)}")
    if costs == "profiler" and profile_runs < 1:
        raise UserError(f"profile_runs {profile_runs}: give at least 1 run to profile")


def node_times(gm, args: tuple, runs: int, profiler: bool = False) -> dict[str, float]:
    """Mean seconds per fx node over ``runs`` runs of ``gm`` node by node (one more run first,
    dropped: it warms caches and lazy initialisation), with the intra-op threads the caller
    set. Without ``profiler`` the wall time around ``run_node`` (the Interpreter's own per-node
    overhead included); with it, each node is a ``record_function`` range and its time is the
    CPU time torch.profiler records for that range (the ops it ran and the Python between
    them) less what recording costs: the range's own and each recorded op's, measured in the
    same profiling session (``_ProfilerOverhead``). Left in, that overhead made GPT-2 4x256's
    ops ~25% dearer than a stage runs them (~8 us on each of 263 nodes, most of them views
    and small elementwise ops)."""
    import statistics

    import torch

    wall: dict[str, list[float]] = {}

    class Timer(torch.fx.Interpreter):
        def run_node(self, n):
            if profiler:
                with torch.profiler.record_function(f"tm::{n.name}"):
                    return super().run_node(n)
            t0 = time.perf_counter()
            result = super().run_node(n)
            wall.setdefault(n.name, []).append(time.perf_counter() - t0)
            return result

    with torch.no_grad():
        Timer(gm).run(*args)
        wall.clear()
        if not profiler:
            for _ in range(max(runs, 1)):
                Timer(gm).run(*args)
            return {name: statistics.fmean(ts) for name, ts in wall.items()}
        plain = _ProfilerOverhead.plain_op_seconds()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(max(runs, 1)):
                Timer(gm).run(*args)
            _ProfilerOverhead.probe()
    overhead = _ProfilerOverhead.from_events(prof.events(), plain)
    seconds: dict[str, list[float]] = {}
    for event in prof.events():
        if event.name.startswith("tm::"):  # microseconds
            raw = event.cpu_time_total / 1e6
            net = raw - overhead.per_range - overhead.per_op * _descendants(event)
            seconds.setdefault(event.name[4:], []).append(max(net, 1e-9))
    return {name: statistics.fmean(ts) for name, ts in seconds.items()}


def _descendants(event) -> int:
    """How many op events torch.profiler recorded inside ``event`` (each cost a record)."""
    return sum(1 + _descendants(child) for child in event.cpu_children)


@dataclass
class _ProfilerOverhead:
    """Seconds torch.profiler adds to a ``record_function`` range's CPU time: ``per_range`` for
    the range itself, ``per_op`` for each op recorded inside it. Measured by probes run in the
    profiling session being corrected (same process, core, load): empty ranges, and ranges
    around ``PROBE_OPS`` trivial ops (a view) whose unprofiled time is subtracted."""

    per_range: float
    per_op: float

    PROBE_OPS = 4
    PROBES = 300

    @staticmethod
    def _views(n: int) -> None:
        import torch

        x = torch.zeros(4)
        for _ in range(n):
            torch.ops.aten.view.default(x, [4])

    @classmethod
    def plain_op_seconds(cls) -> float:
        """One view's unprofiled time (median of batches, the first dropped as a warm-up)."""
        import statistics

        per = []
        for _ in range(6):
            t0 = time.perf_counter()
            cls._views(cls.PROBES)
            per.append((time.perf_counter() - t0) / cls.PROBES)
        return statistics.median(per[1:])

    @classmethod
    def probe(cls) -> None:
        """The probes, inside the caller's profiling session."""
        import torch

        for _ in range(cls.PROBES):
            with torch.profiler.record_function("tm-probe::empty"):
                pass
            with torch.profiler.record_function("tm-probe::ops"):
                cls._views(cls.PROBE_OPS)

    @classmethod
    def from_events(cls, events, plain_op: float) -> "_ProfilerOverhead":
        import statistics

        empty = [e.cpu_time_total / 1e6 for e in events if e.name == "tm-probe::empty"]
        ops = [e.cpu_time_total / 1e6 for e in events if e.name == "tm-probe::ops"]
        if not empty or not ops:
            return cls(0.0, 0.0)
        per_range = statistics.median(empty)
        per_op = (statistics.median(ops) - per_range) / cls.PROBE_OPS - plain_op
        return cls(max(per_range, 0.0), max(per_op, 0.0))


def _check_rate(flops_per_second: float) -> None:
    if not (np.isfinite(flops_per_second) and flops_per_second > 0):
        raise UserError(f"flops_per_second {flops_per_second}: give a positive finite FLOP rate")


@dataclass
class _Profile:
    """Per fx node name: compute cost (seconds) and output bytes."""

    costs: dict[str, float]
    out_bytes: dict[str, int]


def _profile(gm, args: tuple, flops_per_second: float, measure: bool, profile_runs: int = 0) -> _Profile:
    """Run ``gm`` once on ``args`` node by node, counting each node's FLOPs (or timing it);
    with ``profile_runs``, the costs are torch.profiler's CPU times instead (``node_times``),
    the bytes still from the counting run."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    costs: dict[str, float] = {}
    out_bytes: dict[str, int] = {}

    class Profiler(torch.fx.Interpreter):
        def run_node(self, n):
            counter = FlopCounterMode(display=False)
            t0 = time.perf_counter()
            with counter:
                result = super().run_node(n)
            elapsed = time.perf_counter() - t0
            out_bytes[n.name] = _tensor_bytes(result)
            # elementwise ops count no FLOPs in the counter; charge them one per output element
            flops = counter.get_total_flops() if n.op.startswith("call") else 0
            if n.op.startswith("call") and flops == 0:
                flops = out_bytes[n.name] // 4
            costs[n.name] = elapsed if measure else flops / flops_per_second
            return result

    # The fused inference path of attention modules runs one opaque kernel that FlopCounterMode
    # counts as 0 FLOPs; with it off, an fx leaf such as nn.TransformerEncoder is charged its
    # real matmuls (export graphs hold the unfused operators anyway).
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            Profiler(gm).run(*args)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    if profile_runs:
        timed = node_times(gm, args, profile_runs, profiler=True)
        costs = {n.name: timed.get(n.name, 0.0) if n.op.startswith("call") else 0.0 for n in gm.graph.nodes}
    return _Profile(costs, out_bytes)


def _graph_of(
    gm,
    profile: _Profile,
    bandwidth: float,
    latency: float,
    extra: "_Extra | None" = None,
    phase: dict[str, str] | None = None,
    free_edges: frozenset[tuple[str, str]] = frozenset(),
) -> Graph:
    """The Graph of a profiled GraphModule: a node per fx node, an edge per use; ``extra``
    nodes and edges appended (the optimizer step), ``phase`` prefixed to the names;
    ``free_edges`` (src, dst) cost nothing (an order, not a transfer)."""
    costs, out_bytes = profile.costs, profile.out_bytes
    nodes = [n for n in gm.graph.nodes]
    ids = [n.name for n in nodes]
    mem = []
    for n in nodes:
        owned = 0
        if n.op == "call_module":
            owned = sum(p.numel() * p.element_size() for p in gm.get_submodule(n.target).parameters())
        elif n.op == "get_attr":
            owned = out_bytes.get(n.name, 0)
        mem.append(float(owned + out_bytes.get(n.name, 0)))
    src, dst, ecost = [], [], []
    for n in nodes:
        for user in n.users:
            src.append(n.name)
            dst.append(user.name)
            free = (n.name, user.name) in free_edges
            ecost.append(0.0 if free else latency + out_bytes.get(n.name, 0) / bandwidth)
    names = [f"{n.op}:{n.target}" for n in nodes]
    if phase is not None:
        names = [f"{phase.get(i, '')}{name}" for i, name in zip(ids, names)]
    cost = [costs.get(i, 0.0) for i in ids]
    group = None
    if extra is not None:
        group = [extra.group.get(i, -1) for i in ids] + [extra.group.get(i, -1) for i in extra.ids]
        ids, cost, mem, names = (ids + extra.ids, cost + extra.cost, mem + extra.memory, names + extra.names)
        src, dst, ecost = src + extra.src, dst + extra.dst, ecost + extra.edge_cost
    return build_graph(ids, cost, src, dst, ecost, memory=mem, names=names, group=group)


@dataclass
class _Extra:
    """Nodes and edges added to a traced graph (the optimizer step), as build_graph takes them."""

    ids: list[str] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    memory: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    src: list[str] = field(default_factory=list)
    dst: list[str] = field(default_factory=list)
    edge_cost: list[float] = field(default_factory=list)
    group: dict[str, int] = field(default_factory=dict)


class _LossOf:
    """Wraps a model as ``(mean of its first output squared,)``: aot_autograd's joint graph
    needs one scalar loss; any differentiable scalar gives the same backward structure."""

    @staticmethod
    def wrap(module):
        import torch

        class LossOf(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = module

            def forward(self, *args):
                out = self.model(*args)
                while not isinstance(out, torch.Tensor):  # tuples, ModelOutput, dicts
                    out = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
                return (out.float().pow(2).mean(),)

        return LossOf()


def from_module_training(
    module,
    example_inputs: tuple,
    bandwidth: float = 1e9,
    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
    measure: bool = False,
    latency: float = 0.0,
    optimizer_step: bool = True,
    costs: str = "flops",
    profile_runs: int = 5,
) -> tuple[Graph, Any]:
    """One training step as one graph: forward, backward and (``optimizer_step``) an SGD update
    per parameter, from one export (aot_autograd's joint graph of ``module`` under a scalar
    loss, operator level).

    Why one graph: the backward of a layer needs that layer's activations, so where a forward
    operator runs decides where its gradient is cheapest to compute; partitioning forward and
    backward apart would hide those edges. Each activation the backward reads is an edge from
    the forward operator that made it to the backward one, and its bytes stay in the forward
    operator's memory (node memory = output bytes) until then: the per-device memory sum counts
    every activation held for the backward. Parameters are placeholder nodes (their bytes as
    memory); each parameter's update node (2 FLOPs per element: p -= lr * g) reads its gradient
    and shares a co-location class with the parameter (an update runs where its weights live).
    Node names are prefixed ``fwd:``, ``bwd:`` or ``opt:``."""
    import torch
    from torch._functorch.aot_autograd import aot_export_module

    check_link(bandwidth, latency)
    _check_rate(flops_per_second)
    _check_costs(costs, profile_runs)
    module.train()
    wrapped = _LossOf.wrap(module)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        gm, sig = aot_export_module(wrapped, tuple(example_inputs), trace_joint=True, output_loss_index=0)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    gm = cast("torch.fx.GraphModule", gm)  # aot_export_module's return type names a callable too
    params: dict[str, Any] = dict(wrapped.named_parameters())
    buffers = dict(wrapped.named_buffers())
    flat = (
        [params[name].detach() for name in sig.parameters]
        + [buffers[name].detach() for name in sig.buffers]
        + list(example_inputs)
    )
    # with costs="profiler" the SGD updates added below stay FLOP estimates (not in the export)
    profile = _profile(gm, tuple(flat), flops_per_second, measure, profile_runs if costs == "profiler" else 0)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_node: dict[str, str] = {name: placeholders[i].name for i, name in enumerate(sig.parameters)}
    loss_name = sig.user_outputs[0] if sig.user_outputs else None
    phase = _phases(gm, loss_name)
    extra = _Extra()
    grads = sig.backward_signature.gradients_to_parameters if sig.backward_signature else {}
    if optimizer_step:
        for cls, (grad, pname) in enumerate(sorted(grads.items(), key=lambda x: x[1])):
            numel = int(params[pname].numel())
            step = f"sgd_step_{re.sub(r'[^0-9A-Za-z_]', '_', pname)}"
            extra.ids.append(step)
            extra.cost.append(0.0 if measure else 2.0 * numel / flops_per_second)
            extra.memory.append(0.0)  # an in-place update: the parameter's bytes are counted once
            extra.names.append(f"opt:sgd:{pname}")
            extra.src.append(grad)
            extra.dst.append(step)
            extra.edge_cost.append(latency + profile.out_bytes.get(grad, 0) / bandwidth)
            extra.group[step] = cls
            extra.group[param_node[pname]] = cls
    # The joint graph returns every gradient through its one output node; in a training step
    # the gradients stay where they are computed (the update reads them there), so those edges
    # order the step's end but move nothing (priced, they were 1 MB transfers per 512x512 layer
    # into one device and made the 12-layer MLP's step 2.3x its lower bound at k = 2)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    free = frozenset((a.name, out.name) for a in out.all_input_nodes if a.name != loss_name)
    return _graph_of(gm, profile, bandwidth, latency, extra, phase, free), gm


def _phases(gm, loss_name: str | None) -> dict[str, str]:
    """Per fx node: ``fwd:`` when the loss depends on it (or it is an input), else ``bwd:``."""
    nodes = {n.name: n for n in gm.graph.nodes}
    forward: set[str] = set()
    stack = [nodes[loss_name]] if loss_name in nodes else []
    while stack:
        n = stack.pop()
        if n.name in forward:
            continue
        forward.add(n.name)
        stack.extend(n.all_input_nodes)
    return {name: "fwd:" if name in forward or n.op == "placeholder" else "bwd:" for name, n in nodes.items()}


def from_callable(
    spec: str,
    input_shape: tuple[int, ...],
    bandwidth: float = 1e9,
    importer: str = DEFAULT_IMPORTER,
    training: bool = False,
    costs: str = "flops",
) -> Graph:
    """``module:callable``: import the module, call the callable to get an nn.Module, and import
    it with ``importer`` (see IMPORTERS) on a random input of ``input_shape``; with
    ``training``, one training step (``from_module_training``; the export importer only).
    ``costs``: FLOP estimates or torch.profiler times (``from_module``; not for onnx)."""
    import torch

    _check_costs(costs, 5)
    if costs != "flops" and importer == "onnx":
        raise UserError(
            f"--costs {costs}: the onnx importer estimates costs from shapes; profile with --importer export or fx"
        )

    if importer not in IMPORTERS:
        raise UserError(f"--importer {importer!r}: choose one of {', '.join(IMPORTERS)}")
    if training and importer != "export":
        raise UserError(
            f"--training builds the forward + backward graph with torch's "
            f"aot_autograd (the export route); --importer {importer} cannot",
            details=["leave --importer at its default (export)"],
        )
    check_link(bandwidth)
    mod_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot load {spec!r}: {exc}") from None
    try:
        module = factory() if not isinstance(factory, torch.nn.Module) else factory
    except Exception as exc:  # the user's factory: any failure is theirs to fix
        raise UserError(
            f"calling {spec}() to build the model failed: {type(exc).__name__}: {exc}",
            details=[
                f"at {_user_frame(exc)}",
                "module:callable must name a callable that takes no arguments and returns an nn.Module",
            ],
        ) from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(f"{spec!r} did not give a torch.nn.Module")
    example = (torch.randn(*input_shape),)
    if training:
        try:
            graph, _ = from_module_training(module, example, bandwidth=bandwidth, costs=costs)
        except UserError:
            raise
        except Exception as exc:  # tracers raise many unrelated types; all mean "cannot trace"
            raise trace_failure(f"{spec} (training step)", "export", exc) from None
        return graph
    module.eval()
    if importer == "onnx":
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.onnx")
            try:
                torch.onnx.export(module, example, path, dynamo=False)
            except Exception as exc:  # the exporter raises many types; all mean "cannot export"
                raise trace_failure(spec, importer, exc) from None
            return from_onnx(path, bandwidth=bandwidth)
    try:
        graph, _ = from_module(module, example, bandwidth=bandwidth, tracer=importer, costs=costs)
    except UserError:
        raise
    except Exception as exc:  # tracers raise many unrelated types; all mean "cannot trace"
        raise trace_failure(spec, importer, exc) from None
    return graph


_DTYPE_BYTES = {1: 4, 2: 1, 3: 1, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2}


def from_onnx(path, bandwidth: float = 1e9, flops_per_second: float = DEFAULT_FLOPS_PER_SECOND) -> Graph:
    """ONNX graph: one node per operator; an edge per tensor from its producer to each consumer.
    Cost: 2*MACs for Conv/Gemm/MatMul from inferred shapes, otherwise the output's element count."""
    import onnx
    from onnx import shape_inference

    check_link(bandwidth)
    try:
        model = shape_inference.infer_shapes(onnx.load(str(path)))
    except Exception as exc:  # onnx raises several unrelated types for bad files
        raise UserError(f"cannot read ONNX file {path}: {exc}") from None
    g = model.graph
    shapes: dict[str, tuple[list[int], int]] = {}
    for vi in list(g.value_info) + list(g.output) + list(g.input):
        t = vi.type.tensor_type
        dims = [d.dim_value if d.dim_value > 0 else 1 for d in t.shape.dim]
        shapes[vi.name] = (dims, _DTYPE_BYTES.get(t.elem_type, 4))
    init_bytes = {
        i.name: int(np.prod(i.dims, dtype=np.int64)) * _DTYPE_BYTES.get(i.data_type, 4) for i in g.initializer
    }
    for i in g.initializer:
        shapes.setdefault(i.name, (list(i.dims), _DTYPE_BYTES.get(i.data_type, 4)))
    ids = [nd.name or f"{nd.op_type}_{i}" for i, nd in enumerate(g.node)]
    producer = {out: ids[i] for i, nd in enumerate(g.node) for out in nd.output}

    def numel(name: str) -> int:
        return int(np.prod(shapes.get(name, ([0], 4))[0], dtype=np.int64))

    def nbytes(name: str) -> int:
        dims, size = shapes.get(name, ([0], 4))
        return int(np.prod(dims, dtype=np.int64)) * size

    costs, mem, src, dst, ecost = [], [], [], [], []
    for i, nd in enumerate(g.node):
        out = nd.output[0] if nd.output else ""
        flops = float(numel(out))
        if nd.op_type in ("Conv", "Gemm", "MatMul") and len(nd.input) >= 2:
            w = shapes.get(nd.input[1], ([1], 4))[0]
            if nd.op_type == "Conv":
                flops = 2.0 * numel(out) * float(np.prod(w[1:], dtype=np.int64))
            else:
                a = shapes.get(nd.input[0], ([1], 4))[0]
                flops = 2.0 * numel(out) * float(a[-1] if a else 1)
        costs.append(flops / flops_per_second)
        mem.append(float(sum(init_bytes.get(x, 0) for x in nd.input) + nbytes(out)))
        for x in nd.input:
            if x in producer:
                src.append(producer[x])
                dst.append(ids[i])
                ecost.append(nbytes(x) / bandwidth)
    if not ids:
        raise UserError(f"ONNX file {path} has no operators")
    return build_graph(ids, costs, src, dst, ecost, memory=mem, names=[nd.op_type for nd in g.node])
