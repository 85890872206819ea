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
"""How a module becomes a graph: ``export`` (torch.export, operator level: the default, since it
sees the aten ops that really run), ``fx`` (torch.fx symbolic tracing, module level: keeps modules
with a fused fast path such as nn.TransformerEncoder as one opaque node), ``onnx`` (the TorchScript
ONNX exporter, then the ONNX importer)."""


def check_link(bandwidth: float, latency: float = 0.0) -> None:
    """Edge cost is latency + bytes / bandwidth: a zero, negative or NaN bandwidth has no meaning."""
    if not (np.isfinite(bandwidth) and bandwidth > 0):
        raise UserError(f"--bandwidth {bandwidth}: give the link's bytes per second, a positive "
                        "finite number (e.g. 1e9)")
    if not (np.isfinite(latency) and latency >= 0):
        raise UserError(f"latency {latency}: give the per-message seconds, a finite number >= 0")


def _user_frame(exc: BaseException) -> str:
    """Where in the user's code tracing failed: the innermost traceback frame outside torch and
    trainmaster, else the "File ..., line N" torch.export quotes in its message."""
    import traceback

    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(skip) and "importlib" not in f.filename]
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
        details=[f"at {_user_frame(exc)}",
                 f"try --importer {' or '.join(other)}, or make that code traceable "
                 "(no data-dependent Python control flow on tensors)"])


def trace_module(module, example_inputs: tuple, tracer: str = "fx"):
    """A GraphModule for ``module``: torch.fx symbolic tracing, or torch.export's graph."""
    import torch

    if tracer == "fx":
        return torch.fx.symbolic_trace(module)
    if tracer == "export":
        return torch.export.export(module, example_inputs).module()
    raise UserError(f"unknown tracer {tracer!r}: use fx or export")


def from_module(module, example_inputs: tuple, bandwidth: float = 1e9,
                flops_per_second: float = DEFAULT_FLOPS_PER_SECOND, measure: bool = False,
                tracer: str = "fx", latency: float = 0.0) -> tuple[Graph, object]:
    """Trace ``module`` and profile every node once on ``example_inputs``; returns the graph
    (node ids are the fx node names) and the GraphModule it describes. An edge costs
    ``latency + bytes / bandwidth`` (the latency models a message's fixed overhead)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    check_link(bandwidth, latency)
    if not (np.isfinite(flops_per_second) and flops_per_second > 0):
        raise UserError(f"flops_per_second {flops_per_second}: give a positive finite FLOP rate")
    gm = trace_module(module, example_inputs, tracer)
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
            Profiler(gm).run(*example_inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
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
            ecost.append(latency + out_bytes.get(n.name, 0) / bandwidth)
    g = build_graph(ids, [costs.get(i, 0.0) for i in ids], src, dst, ecost, memory=mem,
                    names=[f"{n.op}:{n.target}" for n in nodes])
    return g, gm


def from_callable(spec: str, input_shape: tuple[int, ...], bandwidth: float = 1e9,
                  importer: str = "export") -> Graph:
    """``module:callable``: import the module, call the callable to get an nn.Module, and import
    it with ``importer`` (see IMPORTERS) on a random input of ``input_shape``."""
    import torch

    if importer not in IMPORTERS:
        raise UserError(f"--importer {importer!r}: choose one of {', '.join(IMPORTERS)}")
    check_link(bandwidth)
    mod_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot load {spec!r}: {exc}") from None
    try:
        module = factory() if not isinstance(factory, torch.nn.Module) else factory
    except Exception as exc:  # the user's factory: any failure is theirs to fix
        raise UserError(f"calling {spec}() to build the model failed: {type(exc).__name__}: {exc}",
                        details=[f"at {_user_frame(exc)}",
                                 "module:callable must name a callable that takes no arguments "
                                 "and returns an nn.Module"]) from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(f"{spec!r} did not give a torch.nn.Module")
    module.eval()
    example = (torch.randn(*input_shape),)
    if importer == "onnx":
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.onnx")
            try:
                torch.onnx.export(module, example, path, dynamo=False)
            except Exception as exc:  # the exporter raises many types; all mean "cannot export"
                raise trace_failure(spec, importer, exc) from None
            return from_onnx(path, bandwidth=bandwidth)
    try:
        graph, _ = from_module(module, example, bandwidth=bandwidth, tracer=importer)
    except UserError:
        raise
    except Exception as exc:  # tracers raise many unrelated types; all mean "cannot trace"
        raise trace_failure(spec, importer, exc) from None
    return graph


_DTYPE_BYTES = {1: 4, 2: 1, 3: 1, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2}


def from_onnx(path, bandwidth: float = 1e9,
              flops_per_second: float = DEFAULT_FLOPS_PER_SECOND) -> Graph:
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
    init_bytes = {i.name: int(np.prod(i.dims, dtype=np.int64)) * _DTYPE_BYTES.get(i.data_type, 4)
                  for i in g.initializer}
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
    return build_graph(ids, costs, src, dst, ecost, memory=mem,
                       names=[nd.op_type for nd in g.node])
