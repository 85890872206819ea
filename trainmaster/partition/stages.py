"""Pipeline split mode: contiguous stages of an exported model, as split points that
``torch.distributed.pipelining`` takes.

``torch.distributed.pipelining.pipeline(module, mb_args, split_spec={fqn: SplitPoint.BEGINNING})``
splits a model into stages before the named submodules' calls. Which submodules is left to the
user, and the splitters users reach for have no cost model: torchtitan splits by equal layer
counts (the embedding and the output each weighing one layer), PiPPy split by equal parameter
size. This module reads the model's exported graph (torch.export, operator level), places every
operator in execution order, and prices each possible split point: the compute on each side
(FLOP estimates or measured operator times) and the bytes of every value alive across it
(activations a later stage reads, the model's inputs it still needs; parameters travel with
their stage). Then:

- ``trainmaster``: the split points that minimise the pipeline's period, the busiest stage, a
  stage taking its input's transfer (``overhead`` per tensor + bytes / bandwidth) plus its
  compute per micro-batch: ``torch.distributed.pipelining``'s schedules post a stage's receive
  only after its previous forward, and gloo moves a message's bytes only once the receiver has
  posted it, so a transfer never overlaps the receiving stage's compute. With k stages on fewer
  cores, the whole compute over the cores bounds it too. That period bounds the samples per second a stream of micro-batches reaches; among splits within 2%
  of the best period, the one with the lowest latency of one sample (exact dynamic programme
  over the split points).
- ``layers``: torchtitan's rule, the repeated blocks (the longest run of same-class siblings,
  e.g. GPT-2's ``transformer.h``, a ResNet's blocks) dealt out evenly with the modules before
  and after them weighing one block each, the remainder to the first stages.
- ``params``: PiPPy's rule, a split where the parameter bytes so far first reach each k-th of
  the total.

Stages are contiguous in the execution order, so the stage graph is a chain (acyclic) and
every split is one ``torch.distributed.pipelining`` builds as it is (``StagePlan.split_spec``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainmaster.errors import UserError

SPLITTERS = ("trainmaster", "layers", "params")
PERIOD_SLACK = 0.02  # ours: among splits this close to the best period, the lowest latency


@dataclass
class ModelLayout:
    """An exported model as a sequence of operators and the places it can be split.

    ``names``/``cost`` (seconds)/``out_bytes``: the compute operators in execution order;
    ``candidates``: (position, module FQN) pairs, a split before the operator at ``position``
    being ``SplitPoint.BEGINNING`` on that module (the outermost module starting there, called
    once); ``live_bytes[j]``/``live_count[j]``: bytes and tensors alive across candidate j;
    ``param_bytes``: parameter bytes per operator (at the first operator reading them);
    ``module_span``: for each module FQN called once, its first and one-past-last position."""

    names: list[str]
    cost: np.ndarray
    out_bytes: np.ndarray
    param_bytes: np.ndarray
    candidates: list[tuple[int, str]]
    live_bytes: np.ndarray
    live_count: np.ndarray
    module_span: dict[str, tuple[int, int]]
    module_class: dict[str, str]
    gm: Any = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return len(self.names)


@dataclass
class StagePlan:
    """k contiguous stages: ``split_points`` (module FQNs, a split at the beginning of each), the
    operator positions where stages start, and the cost model's view of each stage and
    boundary; ``period``: the busiest stage, its input's transfer included, or the whole compute
    over the shared cores (seconds per sample when micro-batches stream), ``latency``: one sample through every stage and boundary."""

    method: str
    k: int
    split_points: list[str]
    starts: list[int]
    stage_compute: list[float]
    stage_param_bytes: list[int]
    boundary_bytes: list[int]
    boundary_tensors: list[int]
    boundary_seconds: list[float]
    period: float
    latency: float

    def split_spec(self) -> dict[str, Any]:
        """``{fqn: SplitPoint.BEGINNING}``, as ``torch.distributed.pipelining.pipeline`` takes it."""
        from torch.distributed.pipelining import SplitPoint

        return {fqn: SplitPoint.BEGINNING for fqn in self.split_points}

    def summary(self) -> dict:
        return {
            "method": self.method,
            "k": self.k,
            "split_points": list(self.split_points),
            "stage_compute": list(self.stage_compute),
            "stage_param_bytes": list(self.stage_param_bytes),
            "boundary_bytes": list(self.boundary_bytes),
            "boundary_tensors": list(self.boundary_tensors),
            "boundary_seconds": list(self.boundary_seconds),
            "period": self.period,
            "latency": self.latency,
        }


def model_layout(
    model,
    example_args: tuple,
    costs: str = "flops",
    flops_per_second: float | None = None,
    node_seconds: dict[str, float] | None = None,
) -> ModelLayout:
    """Export ``model`` on ``example_args`` (one micro-batch) and lay it out for splitting.
    Operator costs: FLOP estimates (``costs="flops"``, FLOPs / ``flops_per_second``),
    torch.profiler times (``"profiler"``), or ``node_seconds`` given by name."""
    from trainmaster.partition.importers import DEFAULT_FLOPS_PER_SECOND, from_module

    graph, gm = from_module(
        model,
        example_args,
        bandwidth=1.0,  # edge costs in bytes
        flops_per_second=flops_per_second or DEFAULT_FLOPS_PER_SECOND,
        tracer="export",
        costs=costs,
    )
    index = {name: v for v, name in enumerate(graph.node_ids)}
    out_bytes_by_node = np.zeros(graph.n)
    out_bytes_by_node[graph.src] = graph.edge_cost
    nodes = list(gm.graph.nodes)
    compute = [nd for nd in nodes if nd.op == "call_function"]
    if len(compute) < 2:
        raise UserError("the model has fewer than two operators: nothing to split")
    pos = {nd.name: i for i, nd in enumerate(compute)}
    n = len(compute)
    names = [nd.name for nd in compute]
    cost = np.asarray([graph.cost[index[nd.name]] for nd in compute], dtype=float)
    if node_seconds is not None:
        cost = np.asarray([float(node_seconds.get(name, 0.0)) for name in names])
    out_bytes = np.asarray([out_bytes_by_node[index[name]] for name in names], dtype=float)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    param_bytes = np.zeros(n)
    # values alive across a split before position p: defined before p (the inputs at -1), read
    # at p or later (the output node reads at n); parameters and buffers move with their stage
    last_use: dict[str, int] = {}
    define: dict[str, int] = {}
    sizes: dict[str, float] = {}
    for nd in nodes:
        if nd.op == "get_attr":
            tensor = params.get(str(nd.target), buffers.get(str(nd.target)))
            readers = [pos[u.name] for u in nd.users if u.name in pos]
            if tensor is not None and readers:
                param_bytes[min(readers)] += tensor.numel() * tensor.element_size()
            continue
        if nd.op == "placeholder":
            define[nd.name] = -1
            sizes[nd.name] = out_bytes_by_node[index[nd.name]] if nd.name in index else 0.0
        elif nd.op == "call_function":
            define[nd.name] = pos[nd.name]
            sizes[nd.name] = out_bytes[pos[nd.name]]
        if nd.op not in ("call_function", "output"):
            continue  # e.g. torch.export's input guards (a call_module reading the inputs)
        at = n if nd.op == "output" else pos[nd.name]
        for arg in nd.all_input_nodes:
            if arg.op in ("placeholder", "call_function"):
                last_use[arg.name] = max(last_use.get(arg.name, -1), at)
    spans, classes = _module_spans(compute)
    by_position: dict[int, str] = {}
    for fqn, (lo, _) in sorted(spans.items(), key=lambda kv: (kv[1][0], len(kv[0]), kv[0])):
        if fqn and 0 < lo < n and lo not in by_position:
            by_position[lo] = fqn
    candidates = sorted(by_position.items())
    # a value defined at d (the inputs at -1) and last read at e crosses a split before p when
    # d < p <= e: +size from p = d + 1, -size from p = e + 1
    diff_bytes = np.zeros(n + 2)
    diff_count = np.zeros(n + 2)
    for name, d in define.items():
        end = last_use.get(name)
        if end is None or end <= d:
            continue
        diff_bytes[d + 1] += sizes[name]
        diff_bytes[end + 1] -= sizes[name]
        diff_count[d + 1] += 1
        diff_count[end + 1] -= 1
    alive_bytes, alive_count = np.cumsum(diff_bytes), np.cumsum(diff_count)
    live_bytes = np.asarray([alive_bytes[p] for p, _ in candidates])
    live_count = np.asarray([alive_count[p] for p, _ in candidates])
    return ModelLayout(names, cost, out_bytes, param_bytes, candidates, live_bytes, live_count, spans, classes, gm)


def _module_spans(compute: list) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Each module called once (one call key, its operators one contiguous run): its span of
    positions; and each module's class name."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    keys: dict[str, set] = {}
    classes: dict[str, str] = {}
    for i, nd in enumerate(compute):
        for key, (fqn, typ) in (nd.meta.get("nn_module_stack") or {}).items():
            keys.setdefault(fqn, set()).add(key)
            first.setdefault(fqn, i)
            last[fqn] = i
            count[fqn] = count.get(fqn, 0) + 1
            classes[fqn] = typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1].strip("'>")
    spans = {
        fqn: (first[fqn], last[fqn] + 1)
        for fqn in first
        if len(keys[fqn]) == 1 and last[fqn] + 1 - first[fqn] == count[fqn]
    }
    return spans, classes


def calibrated(layout: ModelLayout, wall_seconds: float) -> ModelLayout:
    """``layout`` with its operator costs moved so they sum to ``wall_seconds``, the measured
    forward time of the model as the stages run it (``torch.distributed.pipelining``'s split
    graph modules, one intra-op thread). The profile gives each operator's own time; what it
    does not see is the time between operators (the graph module's Python and the dispatcher),
    about the same for an addition as for a matrix product, so the difference is spread as an
    equal time per operator, not in proportion to cost: scaled in proportion, GPT-2-like's six
    blocks (~45 operators each) were priced at 1.6x its vocabulary head (3 operators) where the
    stages measured 2.2x, and the split put every block on one stage. Where the wall time is
    below the profile (the profiler's own recording cost), the operators give back an equal time
    each, none below zero, the rest in proportion."""
    if not (np.isfinite(wall_seconds) and wall_seconds > 0):
        raise UserError(f"wall_seconds {wall_seconds}: give the model's measured forward time (> 0, finite)")
    total = float(layout.cost.sum())
    if total <= 0:
        raise UserError("the layout's operators cost nothing: nothing to calibrate")
    cost = np.maximum(layout.cost + (wall_seconds - total) / layout.n, 0.0)
    return replace(layout, cost=cost * (wall_seconds / float(cost.sum())))


def split(
    layout: ModelLayout,
    k: int,
    method: str = "trainmaster",
    bandwidth: float = 1.25e7,
    overhead: float = 0.0,
    cores: int | None = None,
) -> StagePlan:
    """k stages of ``layout`` by ``method`` (``SPLITTERS``); boundaries are priced at
    ``overhead`` per tensor + bytes / ``bandwidth`` (bytes per second). ``cores``: the cores
    every stage shares (stages on one machine, or hosts that are namespaces of one machine);
    fewer than k, the period is at least the whole compute over the cores (``StagePlan.period``).
    The split's choice does not change with it (that term is the same for every split)."""
    if method not in SPLITTERS:
        raise UserError(f"unknown pipeline splitter {method!r}", details=[f"choose one of {', '.join(SPLITTERS)}"])
    if k < 1:
        raise UserError(f"stages: give at least 1, got {k}")
    if k > len(layout.candidates) + 1:
        raise UserError(
            f"{k} stages: the model has only {len(layout.candidates)} places to split at (module boundaries)"
        )
    if not (np.isfinite(bandwidth) and bandwidth > 0) or not (np.isfinite(overhead) and overhead >= 0):
        raise UserError(f"bandwidth {bandwidth} must be > 0 and overhead {overhead} >= 0 (finite)")
    link = overhead * layout.live_count + layout.live_bytes / bandwidth
    if cores is not None and cores < 1:
        raise UserError(f"cores {cores}: give at least 1 (or none: a core per stage)")
    if method == "trainmaster":
        chosen = _best_period(layout, k, link)
    elif method == "layers":
        chosen = _equal_layers(layout, k)
    else:
        chosen = _equal_params(layout, k)
    return _plan(layout, k, method, chosen, link, cores)


def _plan(
    layout: ModelLayout, k: int, method: str, chosen: list[int], link: np.ndarray, cores: int | None = None
) -> StagePlan:
    """The plan of candidate indices ``chosen`` (increasing)."""
    starts = [0] + [layout.candidates[j][0] for j in chosen]
    ends = starts[1:] + [layout.n]
    prefix = np.concatenate([[0.0], np.cumsum(layout.cost)])
    pprefix = np.concatenate([[0.0], np.cumsum(layout.param_bytes)])
    compute = [float(prefix[b] - prefix[a]) for a, b in zip(starts, ends)]
    boundary = [float(link[j]) for j in chosen]
    return StagePlan(
        method=method,
        k=k,
        split_points=[layout.candidates[j][1] for j in chosen],
        starts=starts,
        stage_compute=compute,
        stage_param_bytes=[int(pprefix[b] - pprefix[a]) for a, b in zip(starts, ends)],
        boundary_bytes=[int(layout.live_bytes[j]) for j in chosen],
        boundary_tensors=[int(layout.live_count[j]) for j in chosen],
        boundary_seconds=boundary,
        period=max(
            [compute[0]]
            + [b + c for b, c in zip(boundary, compute[1:])]
            + ([sum(compute) / cores] if cores and cores < k else [])
        ),
        latency=sum(compute) + sum(boundary),
    )


def _best_period(layout: ModelLayout, k: int, link: np.ndarray) -> list[int]:
    """Candidate indices of the split with the least period, then (within PERIOD_SLACK of it)
    the least latency: two dynamic programmes over (stage, last split point). A stage's time per
    micro-batch is its input's transfer plus its compute (``_plan``)."""
    prefix = np.concatenate([[0.0], np.cumsum(layout.cost)])
    pos = [p for p, _ in layout.candidates]
    m = len(pos)
    inf = float("inf")

    def compute(a: int, b: int) -> float:  # positions
        return float(prefix[b] - prefix[a])

    def stage(i: int, j: int) -> float:  # the stage from candidate i to candidate j (j = m: the end)
        return float(link[i]) + compute(pos[i], pos[j] if j < m else layout.n)

    if k == 1:
        return []
    # pass 1: the least period; f[j] = best period of the stages so far, the last ending at candidate j
    f = [compute(0, pos[j]) for j in range(m)]
    for _ in range(k - 2):
        g = [inf] * m
        for j in range(m):
            for i in range(j):
                v = max(f[i], stage(i, j))
                if v < g[j]:
                    g[j] = v
        f = g
    best = min(max(f[j], stage(j, m)) for j in range(m))
    limit = best * (1 + PERIOD_SLACK)
    # pass 2: the least latency among splits whose every stage is within the limit
    lat = [compute(0, pos[j]) if compute(0, pos[j]) <= limit else inf for j in range(m)]
    back: list[list[int]] = []
    for _ in range(k - 2):
        g = [inf] * m
        arg = [-1] * m
        for j in range(m):
            for i in range(j):
                if lat[i] == inf:
                    continue
                c = stage(i, j)
                if c > limit:
                    continue
                v = lat[i] + c
                if v < g[j]:
                    g[j], arg[j] = v, i
        back.append(arg)
        lat = g
    end, end_v = -1, inf
    for j in range(m):
        tail = stage(j, m)
        if lat[j] < inf and tail <= limit and lat[j] + tail < end_v:
            end, end_v = j, lat[j] + tail
    assert end >= 0, "the least period's own split meets its limit"
    chosen = [end]
    for arg in reversed(back):
        chosen.append(arg[chosen[-1]])
    return sorted(chosen)


def repeated_blocks(layout: ModelLayout) -> list[str]:
    """The model's layers as torchtitan counts them: the longest run of sibling modules
    ``parent.0``, ``parent.1``, ... of one class (GPT-2's ``transformer.h``, a ResNet's blocks in
    an ``nn.Sequential``), each called once, in execution order."""
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for fqn, (lo, _) in layout.module_span.items():
        parent, _, last = fqn.rpartition(".")
        if last.isdigit():
            groups.setdefault((parent, layout.module_class.get(fqn, "")), []).append((lo, fqn))
    if not groups:
        raise UserError("no repeated blocks (numbered siblings of one class) to split by layer count")
    best = max(groups.values(), key=len)
    return [fqn for _, fqn in sorted(best)]


def _equal_layers(layout: ModelLayout, k: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """torchtitan's rule (see module docstring). The model is a sequence of units: the input
    modules (before the first block), the blocks, the output modules (after the last block);
    stage sizes are counted in layers, the input and output units weighing ``input_weight`` /
    ``output_weight`` layers and the remainder going to the first stages; a stage starts at its
    first unit (the output unit starts at the first operator after the last block)."""
    blocks = repeated_blocks(layout)
    layers = len(blocks)
    if k > layers + 1:
        raise UserError(f"{k} stages: the model has {layers} repeated blocks; equal-layers needs k <= blocks + 1")
    per, extra = divmod(layers + input_weight + output_weight, k)
    sizes = [per + (1 if s < extra else 0) for s in range(k)]  # in layers, the extra to the first
    starts = [layout.module_span[b][0] for b in blocks] + [layout.module_span[blocks[-1]][1]]
    unit, firsts = 0, list[int]()  # unit i >= 1 starts at starts[i - 1]; unit 0 is the input modules
    for s in range(k - 1):
        unit += sizes[s] - (input_weight - 1 if s == 0 else 0)
        unit = min(max(unit, firsts[-1] + 1 if firsts else 1), layers + 1 - (k - 2 - s))
        firsts.append(unit)
    return [_candidate_from(layout, starts[u - 1]) for u in firsts]


def _equal_params(layout: ModelLayout, k: int) -> list[int]:
    """PiPPy's rule: walking the split points in order, split where the parameter bytes before
    the point first reach j / k of the total (j = 1 .. k - 1); never twice at one point."""
    prefix = np.concatenate([[0.0], np.cumsum(layout.param_bytes)])
    total = prefix[-1]
    chosen: list[int] = []
    for j in range(1, k):
        target = total * j / k
        pick = next(
            (i for i, (p, _) in enumerate(layout.candidates) if prefix[p] >= target and (not chosen or i > chosen[-1])),
            None,
        )
        if pick is None:  # the rest holds less than a share: the last points left
            pick = len(layout.candidates) - (k - j)
            pick = max(pick, chosen[-1] + 1 if chosen else 0)
        chosen.append(pick)
    return chosen


def _candidate_from(layout: ModelLayout, position: int) -> int:
    """The index of the first candidate split point at or after ``position``."""
    positions = [p for p, _ in layout.candidates]
    i = bisect.bisect_left(positions, position)
    if i == len(positions):
        raise UserError(f"no split point at or after operator position {position}")
    return i


def build_pipe(model, example_args: tuple, split_points: list[str]):
    """``torch.distributed.pipelining.pipeline`` on a copy of ``model``, split at the beginning
    of each module in ``split_points`` (``StagePlan.split_points``; the call wraps the named
    submodules' forwards in place, so a second plan on the same model object would split at
    both); the ``Pipe``, checked to have one stage more than split points."""
    import copy

    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {fqn: SplitPoint.BEGINNING for fqn in split_points}
    pipe = pipeline(copy.deepcopy(model), mb_args=example_args, split_spec=spec)
    if pipe.num_stages != len(split_points) + 1:
        raise RuntimeError(
            f"torch.distributed.pipelining made {pipe.num_stages} stages of {len(split_points)} split points"
        )
    return pipe


def plan_for_callable(
    spec: str,
    input_shape: tuple[int, ...],
    k: int,
    splitter: str = "trainmaster",
    bandwidth: float = 1.25e7,
    costs: str = "flops",
    input_dtype: str | None = None,
    overhead: float = 0.0,
) -> StagePlan:
    """The CLI's ``--split-points``: ``module:callable`` built, one micro-batch of
    ``input_shape`` (``input_dtype`` ``tokens:V`` for token ids), laid out and split."""
    import importlib

    import torch

    from trainmaster.partition.importers import trace_failure
    from trainmaster.partition.pipeline import example_input

    mod_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot load {spec!r}: {exc}") from None
    try:
        model = factory() if not isinstance(factory, torch.nn.Module) else factory
    except Exception as exc:  # the user's factory: any failure is theirs to fix
        raise UserError(f"calling {spec}() to build the model failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{spec!r} did not give a torch.nn.Module")
    if input_dtype is not None and not (input_dtype.startswith("tokens:") and input_dtype[7:].isdigit()):
        raise UserError(f"--input-dtype {input_dtype!r}: give tokens:V (token ids below V) or leave it out")
    model.eval()
    example = example_input(input_shape, input_dtype, 0)
    try:
        layout = model_layout(model, (example,), costs=costs)
    except UserError:
        raise
    except Exception as exc:  # tracers raise many unrelated types; all mean "cannot trace"
        raise trace_failure(spec, "export", exc) from None
    return split(layout, k, splitter, bandwidth=bandwidth, overhead=overhead)
