"""Run a partitioned torch.fx graph for real: one process per device, tensors over sockets.

Each stage process holds the same traced model (same constructor, same seed, so the same
weights) and executes only the fx nodes its device was assigned, in graph order, one sample after
another. A value needed by a node on another stage is sent there as soon as it is computed; a
stage blocks (with a timeout) until the values it needs arrive. The driver owns the graph's inputs
and outputs: it sends every sample's input to the stages that read it and collects the outputs,
so stages overlap on different samples as a pipeline does, and any partition (even one whose
device graph has a cycle) runs correctly.

Roles: ``python -m trainmaster.partition.pipeline stage`` (listens on TM_PORT) and
``python -m trainmaster.partition.pipeline driver`` (reads TM_SERVICE_STAGE, partitions the
model with each method, streams samples, checks outputs equal the unsplit model's and writes
``pipeline.json`` into TM_OUTPUT_DIR). Wire format: ``multiprocessing.connection`` (pickled
messages, length-framed), loopback only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

DRIVER = -1
TIMEOUT_S = 60.0
# the GIL switch interval in stages (Python's default is 5 ms, as long as a whole stage's work)
SWITCH_INTERVAL_S = 2e-4
AUTHKEY = b"trainmaster-pipeline"


def build_model(spec: str, seed: int, args: dict[str, Any] | None = None):
    """The model ``module:callable`` builds (with keyword ``args``), its weights drawn from
    ``seed``: every process that builds it gets the same weights."""
    import torch

    mod_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(mod_name), attr)
    torch.manual_seed(seed)
    model = factory(**(args or {}))
    model.eval()
    return model


def _parse_address(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _dial(addr: str, deadline: float) -> Connection:
    """Connect, retrying while the peer has not started listening yet."""
    while True:
        try:
            return Client(_parse_address(addr), authkey=AUTHKEY)
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline: could not reach {addr} within {TIMEOUT_S}s")
            time.sleep(0.05)


class Mailbox:
    """Values that arrived from other processes, keyed by (sample, node name). A value that came
    over an emulated link is held until it is due (``put``'s ``due``): the receiver, which is
    waiting for it anyway, does the delaying."""

    def __init__(self) -> None:
        self._items: dict[tuple[int, str], tuple[Any, float]] = {}
        self._cond = threading.Condition()
        self.control: list[Any] = []
        self.arrived: dict[tuple[int, str], float] = {}  # when each value became available (traces)

    def put(self, key, value, due: float = 0.0) -> None:
        """``value`` under ``key``, available from ``due`` (a ``time.perf_counter`` time) on."""
        with self._cond:
            self._items[key] = (value, due)
            self.arrived[key] = max(time.perf_counter(), due)
            self._cond.notify_all()

    def put_control(self, msg) -> None:
        with self._cond:
            self.control.append(msg)
            self._cond.notify_all()

    def take(self, key, timeout: float = TIMEOUT_S):
        """The value under ``key`` once it is there and due; the wait sleeps until whichever
        comes first of: a new arrival, the value's due time, the timeout."""
        deadline = time.perf_counter() + timeout
        with self._cond:
            while True:
                now = time.perf_counter()
                item = self._items.get(key)
                if item is not None and item[1] <= now:
                    del self._items[key]
                    return item[0]
                if now >= deadline:
                    raise TimeoutError(f"pipeline: value {key[1]!r} of sample {key[0]} never arrived within {timeout}s")
                self._cond.wait(timeout=min(deadline, item[1] if item is not None else deadline) - now)

    def take_control(self, timeout: float = TIMEOUT_S, kind: str | None = None):
        """The first control message (of ``kind``, when given: a stage with nothing to compute
        may report its trace before another stage says it is ready)."""

        def first() -> int | None:
            return next((i for i, m in enumerate(self.control) if kind is None or m[0] == kind), None)

        with self._cond:
            if not self._cond.wait_for(lambda: first() is not None, timeout=timeout):
                raise TimeoutError(f"pipeline: no {kind or 'instruction'} message within {timeout}s")
            index = first()
            assert index is not None
            return self.control.pop(index)


# a message's first bytes: ``_NOW`` then the pickle, or ``_DELAYED``, its send time, the link's
# latency and bandwidth (three doubles), then the pickle
_NOW, _DELAYED = b"N", b"D"
_HEADER = struct.Struct("!ddd")


def _send(conn: "Connection | Link", msg) -> None:
    """Plain pickle, not Connection.send: torch registers a ForkingPickler reduction that passes
    tensors as shared-memory handles, which only works between related processes."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if isinstance(conn, Link):
        conn.send_bytes(data, delayed=msg[0] == "value")
    else:
        conn.send_bytes(_NOW + data)


class Link:
    """A connection with an emulated slower link: each value message becomes available to its
    receiver ``latency + bytes / bandwidth`` after it was sent (control messages at once).

    Why the receiver delays it: the sender writes the message at once with its send time and
    the link's figures in a header, and the receiver's mailbox holds the value until it is due
    (``Mailbox.take`` sleeps until then). A delivery thread in the sender, as this class had,
    woke on the sender's core while it computed and cost it ~0.3 ms per message on a loaded
    machine (GIL and scheduler hand-offs), which no cost model priced. Messages overlap, none
    queues behind another: the makespan simulator charges every cut edge its own transfer time
    (no link contention). Send times are ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for
    every process of a host: the pipeline runs on loopback)."""

    def __init__(self, conn: Connection, latency: float = 0.0, bandwidth: float = float("inf")) -> None:
        self.conn = conn
        self._lock = threading.Lock()  # one writer on the socket at a time
        self.configure(latency, bandwidth)

    def configure(self, latency: float, bandwidth: float) -> None:
        """The emulated link for the messages sent from now on."""
        if not (latency >= 0 and bandwidth > 0):
            raise ValueError(f"link: latency {latency} must be >= 0, bandwidth {bandwidth} > 0")
        self.latency, self.bandwidth = latency, bandwidth
        self.emulated = latency > 0 or bandwidth != float("inf")

    def send_bytes(self, data: bytes, delayed: bool = True) -> None:
        if delayed and self.emulated:
            header = _DELAYED + _HEADER.pack(time.perf_counter(), self.latency, self.bandwidth)
        else:
            header = _NOW
        with self._lock:
            self.conn.send_bytes(header + data)

    def close(self) -> None:
        self.conn.close()


def _reader(conn: Connection, box: Mailbox) -> None:
    """Read messages into ``box``: values (held until due when they came over an emulated link)
    and control messages."""
    try:
        while True:
            raw = conn.recv_bytes()
            due = 0.0
            if raw[:1] == _DELAYED:
                sent, latency, bandwidth = _HEADER.unpack_from(raw, 1)
                payload = raw[1 + _HEADER.size :]
                due = sent + latency + len(payload) / bandwidth
            else:
                payload = raw[1:]
            msg = pickle.loads(payload)
            if msg[0] == "value":
                box.put((msg[1], msg[2]), msg[3], due)
            else:
                box.put_control(msg)
    except (EOFError, OSError):
        return


def _serve(listener: Listener, box: Mailbox) -> None:
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return
        threading.Thread(target=_reader, args=(conn, box), daemon=True).start()


def example_input(shape, dtype: str | None, seed: int = 0):
    """An input of ``shape``: floats from N(0, 1), or with ``dtype`` ``tokens:V`` token ids
    below V (a language model's input)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dtype and dtype.startswith("tokens:"):
        return torch.randint(0, int(dtype.split(":", 1)[1]), tuple(shape), generator=gen)
    return torch.randn(*shape, generator=gen)


def trace_for_pipeline(model, tracer: str, example):
    """The GraphModule the driver partitions and every stage runs its share of: the same
    model, tracer and input shape give the same node names in every process."""
    from trainmaster.partition.importers import trace_module

    return trace_module(model, (example,) if example is not None else (), tracer)


def plan_consumers(gm, assignment: dict[str, int]) -> dict[str, set[int]]:
    """For each node, the processes (stage index or DRIVER) that read its value elsewhere."""
    owner = {n.name: _owner(n, assignment) for n in gm.graph.nodes}
    consumers: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        for user in n.users:
            if owner[user.name] != owner[n.name]:
                consumers.setdefault(n.name, set()).add(owner[user.name])
    return consumers


def last_local_uses(mine: list) -> dict[str, list]:
    """For each of a stage's nodes (in the order it runs them), the values to drop once it has
    run: those it is the last local reader of, and its own value when nothing local reads it
    (it has been sent by then).

    Why: a stage that kept every value of a sample until the sample's end (as it once did)
    freed them all at once, so glibc gave the heap back to the kernel and the next sample
    page-faulted it in again: ~900 faults per sample for the ResNet-like CNN, ~3000-5000 for
    GPT-2 4x256, a cost that grows with how many values a stage holds, not with its
    operators. The calibration (the whole graph on one stage) then paid a different
    per-operator price than the stages it predicts, by up to 1.6x on a VM where faults are
    dear. Freed as the unsplit model frees them (``Interpreter.run``'s rule), the memory is
    reused while still hot and both pay none."""
    last: dict = {}
    for node in mine:
        for arg in node.all_input_nodes:
            last[arg] = node
    release: dict[str, list] = {}
    for node in mine:
        if node not in last:
            release.setdefault(node.name, []).append(node)
    for arg, reader in last.items():
        release.setdefault(reader.name, []).append(arg)
    return release


def _owner(node, assignment: dict[str, int]) -> int:
    return DRIVER if node.op in ("placeholder", "output") else assignment[node.name]


def _publish_plan(graph: Any, assignment: Any, k: int, method: str) -> None:
    """The partition, for the dashboard's graph view: operators by device, critical edges."""
    import trainmaster
    from trainmaster.partition.critical import critical_edges

    critical = critical_edges(graph, assignment=assignment)
    on_critical = set(graph.src[critical].tolist()) | set(graph.dst[critical].tolist())
    names = [str(n) for n in graph.node_ids]
    trainmaster.publish(
        "partition.plan",
        {
            "method": method,
            "devices": k,
            "nodes": [
                {"id": names[v], "device": int(assignment[v]), "critical": v in on_critical}
                for v in range(len(graph.node_ids))
            ],
            "edges": [
                {"src": names[int(s)], "dst": names[int(d)], "critical": bool(c)}
                for s, d, c in zip(graph.src, graph.dst, critical)
            ],
        },
    )


def run_stage(port: int) -> None:
    """A stage: serve runs until the driver says stop.

    Each run's config fixes how the stage computes, so that it does what the makespan
    simulator assumes: one intra-op thread (the op times were profiled with one), its nodes in
    the simulator's order (``order``: a node whose input is still on the wire does not hold
    back one that is ready, unless the simulator says so too), optionally its own CPU core
    (``cpu``), and a short GIL switch interval, so that the link and reader threads deliver a
    message when it is due rather than up to 5 ms later behind the compute thread."""
    import torch

    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    box = Mailbox()
    listener = Listener((own_host(), port), authkey=AUTHKEY)
    threading.Thread(target=_serve, args=(listener, box), daemon=True).start()
    peers: dict[int, Link] = {}
    # traced graphs by what determines them: a run that only changes the assignment (the
    # next method, round or calibration) does not trace the model again (seconds for GPT-2)
    traced: dict[str, Any] = {}
    while True:
        msg = box.take_control(timeout=600.0)
        if msg[0] == "stop":
            break
        _, cfg = msg
        me = cfg["stage"]
        deadline = time.monotonic() + TIMEOUT_S
        if DRIVER not in peers:
            peers[DRIVER] = Link(_dial(cfg["driver"], deadline))
        for j, addr in enumerate(cfg["stages"]):
            if j != me and j not in peers:
                peers[j] = Link(_dial(addr, deadline))
        link = cfg.get("link") or {}
        for j, peer in peers.items():  # stage to stage only: the driver stands for no device
            peer.configure(
                float(link.get("latency", 0.0)) if j != DRIVER else 0.0,
                float(link.get("bandwidth", float("inf"))) if j != DRIVER else float("inf"),
            )
        if cfg.get("cpu") is not None:
            os.sched_setaffinity(0, {int(cfg["cpu"])})
        shape = cfg.get("input_shape")
        key = json.dumps(
            [cfg["model"], cfg["seed"], cfg.get("model_args"), cfg.get("tracer"), shape, cfg.get("input_dtype")],
            sort_keys=True,
        )
        if key not in traced:
            model = build_model(cfg["model"], cfg["seed"], cfg.get("model_args"))
            traced[key] = trace_for_pipeline(
                model, cfg.get("tracer", "fx"), example_input(shape, cfg.get("input_dtype")) if shape else None
            )
        gm = traced[key]
        assignment = cfg["assignment"]
        consumers = plan_consumers(gm, assignment)
        position = {name: i for i, name in enumerate(cfg.get("order") or [])}
        graph_order = [n for n in gm.graph.nodes if _owner(n, assignment) == me]
        mine = sorted(graph_order, key=lambda n: position.get(n.name, len(position)))
        release = last_local_uses(mine)
        interp = torch.fx.Interpreter(gm)
        trace: list[tuple[int, str, float, float, float]] = []  # sample, node, inputs in, start, end
        _send(peers[DRIVER], ("ready", me))
        with torch.no_grad():
            for sample in range(cfg["samples"]):
                interp.env = {}
                for node in mine:
                    t_in = time.perf_counter()
                    for arg in node.all_input_nodes:
                        if arg not in interp.env:
                            interp.env[arg] = box.take((sample, arg.name))
                    t0 = time.perf_counter()
                    value = interp.run_node(node)
                    interp.env[node] = value
                    if cfg.get("trace"):
                        trace.append((sample, node.name, t_in, t0, time.perf_counter()))
                    for dest in consumers.get(node.name, ()):
                        _send(peers[dest], ("value", sample, node.name, value))
                    for done in release.get(node.name, ()):
                        del interp.env[done]
        if cfg.get("trace"):
            _send(peers[DRIVER], ("trace", me, trace, dict(box.arrived)))
        box.arrived.clear()
    for conn in peers.values():
        conn.close()
    listener.close()


@dataclass
class PipelineRun:
    """What the driver runs: the model (``module:callable``) and its input, how it is traced and
    costed, the methods to compare, and the link.

    ``costs``: ``flops`` (FLOPs / ``flops_per_second``), ``measured`` (each node's wall time
    in the same fx Interpreter the stages run it in, mean of ``profile_runs`` runs: the
    per-node overhead of running a graph node by node is then in the prediction too) or
    ``profiler`` (each node's CPU time as torch.profiler records it, same runs). With measured
    or profiled costs every edge is also charged what a message really costs here, measured
    on the node's real output: pickling, a loopback socket, unpickling on a reader thread
    (``message_costs``); plus the emulated link between two stages, never to or from the
    driver (which stands for no device).
    ``emulate_link``: stage-to-stage messages are delayed by ``latency + bytes / bandwidth``,
    the cost model's own edge cost (``Link``), so the run has the link the prediction assumed.
    ``latency_samples``: samples sent one at a time after the streamed ones, each timed from its
    input leaving the driver to its output arriving: the measured counterpart of the makespan
    (one sample's latency); the streamed time per sample is that of ``max_load``.
    ``pin_cores``: stage j runs on CPU core j mod (cores this process may use), so that stages
    do not share a core where there are enough (the simulator gives every device its own).
    ``trace``: stages record every node's wait, start and end; the report then holds, per
    method, the measured compute and waits of the latency samples beside the predicted ones.
    ``rounds``: the methods' runs alternate this many times (medians over all of them).
    ``model_args``: keyword arguments of the model's callable (a width, a depth).
    ``real_links``: the stages and the driver run on separate hosts whose links really carry
    ``bandwidth`` (a testbed's capped links): messages between stages are priced like
    emulated ones but nothing delays them, and the fixed cost of a message is the input's
    measured trip less the input's own time on the link."""

    model: str
    input_shape: tuple[int, ...]
    methods: list[str] = field(default_factory=lambda: ["trainmaster", "metis"])
    samples: int = 20
    seed: int = 0
    bandwidth: float = 1e9
    flops_per_second: float = 1e10
    latency: float = 1e-3
    acyclic: bool = True
    tracer: str = "fx"
    input_dtype: str | None = None
    costs: str = "flops"
    profile_runs: int = 5
    emulate_link: bool = False
    latency_samples: int = 0
    pin_cores: bool = False
    trace: bool = False
    rounds: int = 1
    model_args: dict[str, Any] = field(default_factory=dict)
    real_links: bool = False

    @property
    def priced_link(self) -> bool:
        """Whether a message between stages pays ``latency + bytes / bandwidth``."""
        return self.emulate_link or self.real_links


def own_host() -> str:
    """The address this process listens on: its host's (``TM_HOST``, set by the controller on
    every backend; a testbed host's own address there), else loopback."""
    return os.environ.get("TM_HOST") or "127.0.0.1"


COSTS = ("flops", "measured", "profiler")


def run_driver(
    stages: list[str],
    port: int,
    model_spec: str,
    input_shape: tuple[int, ...],
    methods: list[str],
    samples: int,
    seed: int,
    bandwidth: float,
    flops_per_second: float = 1e10,
    latency: float = 1e-3,
    acyclic: bool = True,
) -> dict:
    """Partition the model with each method, run it through the stages, check and time it."""
    return run_pipeline(
        stages,
        port,
        PipelineRun(
            model_spec, tuple(input_shape), list(methods), samples, seed, bandwidth, flops_per_second, latency, acyclic
        ),
    )


@dataclass
class Calibration:
    """What one run of the whole graph on one stage measured (``costs="measured"``): each
    node's median time as a stage computes it (its core, its one thread, one sample in flight
    after an idle wait, the stage loop's own overhead), and the fixed cost of one message
    between processes (pickle, loopback socket, the receiver's reader thread waking, unpickle,
    its compute thread waking), from the input's trip driver to stage and the output's trip
    back."""

    node_seconds: dict[str, float]
    input_message: float  # from the driver sending a sample to its first node starting
    output_message: float  # from the last node ending to the driver holding the output
    # a message's cost besides the link's (the input's trip, less its own link time on real links)
    fixed: float


class _Session:
    """The driver's side of the stages: connections, the mailbox and the traced model; runs
    one assignment through the stages (``run``)."""

    def __init__(self, stages: list[str], port: int, run: PipelineRun, gm, feed: list) -> None:
        self.stages, self.port, self.cfg_run, self.gm, self.feed = stages, port, run, gm, feed
        self.box = Mailbox()
        self.host = own_host()
        self.listener = Listener((self.host, port), authkey=AUTHKEY)
        threading.Thread(target=_serve, args=(self.listener, self.box), daemon=True).start()
        deadline = time.monotonic() + TIMEOUT_S
        self.conns = [_dial(a, deadline) for a in stages]
        self.cpus = sorted(os.sched_getaffinity(0))
        self.placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
        self.out_node = next(n for n in gm.graph.nodes if n.op == "output")

    def start(
        self, assignment: dict[str, int], order: list[str], samples: int, trace: bool, link: dict, shift: int = 0
    ) -> None:
        """Configure every stage for one run; with ``pin_cores``, stage j on core j + ``shift``."""
        run = self.cfg_run
        cfg = {
            "assignment": assignment,
            "model": run.model,
            "seed": run.seed,
            "model_args": run.model_args,
            "samples": samples,
            "stages": self.stages,
            "driver": f"{self.host}:{self.port}",
            "tracer": run.tracer,
            "input_shape": list(run.input_shape),
            "input_dtype": run.input_dtype,
            "link": link,
            "order": order,
            "trace": trace,
        }
        cpus = self.cpus
        for j, conn in enumerate(self.conns):
            _send(conn, ("run", {**cfg, "stage": j, "cpu": cpus[(j + shift) % len(cpus)] if run.pin_cores else None}))
        for _ in range(len(self.conns)):
            self.box.take_control(kind="ready")
        self.consumers = plan_consumers(self.gm, assignment)

    def stream(self, first: int, last: int) -> list:
        """Send samples first..last-1, then collect their outputs: (output, time it arrived)."""
        import torch

        for sample in range(first, last):
            for dest in self.consumers.get(self.placeholder.name, ()):
                _send(self.conns[dest], ("value", sample, self.placeholder.name, self.feed[sample % len(self.feed)]))
        outs = []
        for sample in range(first, last):
            env = {
                a: self.feed[sample % len(self.feed)] if a.op == "placeholder" else self.box.take((sample, a.name))
                for a in self.out_node.all_input_nodes
            }
            outs.append((torch.fx.node.map_arg(self.out_node.args[0], lambda a: env[a]), time.perf_counter()))
        return outs

    def one_at_a_time(self, first: int, last: int) -> tuple[list, dict[int, float], dict[int, float]]:
        """Samples sent one after another's output arrived: outputs, send and arrival times."""
        outputs, sent, arrived = [], {}, {}
        for sample in range(first, last):
            sent[sample] = time.perf_counter()
            ((out, arrived[sample]),) = self.stream(sample, sample + 1)
            outputs.append(out)
        return outputs, sent, arrived

    def traces(self) -> list:
        return [self.box.take_control(kind="trace") for _ in range(len(self.conns))]

    def calibrate(self, runs: int, shift: int = 0) -> Calibration:
        """Run the whole graph on stage 0 (on the core ``shift`` picks, with ``pin_cores``),
        one sample at a time, traced (``Calibration``)."""
        names = [n.name for n in self.gm.graph.nodes]
        warm = 2
        self.start({n: 0 for n in names}, names, warm + runs, True, {}, shift)
        self.one_at_a_time(0, warm)
        _, sent, arrived = self.one_at_a_time(warm, warm + runs)
        ((_, _, records, arrivals),) = [t for t in self.traces() if t[1] == 0]
        per_node: dict[str, list[float]] = {}
        wake: list[float] = []  # a value arrived while the compute thread waited for it: until it ran
        last: dict[int, float] = {}  # the last node the output reads ends
        feeders = {a.name for a in self.out_node.all_input_nodes}
        for sample, name, t_in, t0, t1 in records:
            if sample not in sent:
                continue
            per_node.setdefault(name, []).append(t1 - t0)
            key = (sample, self.placeholder.name)
            if name in {u.name for u in self.placeholder.users} and t_in < arrivals.get(key, 0.0) < t0:
                wake.append(t0 - arrivals[key])
            if name in feeders:
                last[sample] = max(last.get(sample, t1), t1)
        trip = [arrivals[(x, self.placeholder.name)] - sent[x] for x in sent if (x, self.placeholder.name) in arrivals]
        input_trip = statistics.median(trip) + (statistics.median(wake) if wake else 0.0)
        return Calibration(
            node_seconds={name: statistics.median(ts) for name, ts in per_node.items()},
            input_message=input_trip,
            output_message=statistics.median(arrived[x] - last[x] for x in last),
            fixed=input_trip,
        )

    def close(self) -> None:
        for conn in self.conns:
            _send(conn, ("stop",))
            conn.close()
        self.listener.close()


def run_pipeline(stages: list[str], port: int, run: PipelineRun) -> dict:
    """Partition the model with each method, run it through the stages, check and time it."""

    import torch

    from trainmaster.partition import evaluate, partition
    from trainmaster.partition.methods import PartitionOptions
    from trainmaster.partition.importers import from_module
    from trainmaster.partition.simulate import schedule

    if run.costs not in COSTS:
        raise ValueError(f"pipeline costs {run.costs!r}: use one of {', '.join(COSTS)}")
    if run.emulate_link and run.real_links:
        raise ValueError("pipeline emulate_link and real_links: the links are either emulated or real, not both")
    torch.set_num_threads(1)
    k = len(stages)
    model = build_model(run.model, run.seed, run.model_args)
    inputs = [
        example_input(run.input_shape, run.input_dtype, run.seed + 1 + i)
        for i in range(run.samples + run.latency_samples)
    ]
    warmup = max(2, run.samples // 5)
    feed = inputs[:warmup] + inputs
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        t0 = time.perf_counter()
        for x in inputs[: run.samples]:
            model(x)
        unsplit = (time.perf_counter() - t0) / max(run.samples, 1)
    graph, gm = from_module(
        model,
        (inputs[0],),
        bandwidth=run.bandwidth,
        flops_per_second=run.flops_per_second,
        latency=run.latency,
        tracer=run.tracer,
    )
    session = _Session(stages, port, run, gm, feed)
    costs = _measure_costs(session, run, gm, graph, inputs[0], 0)
    graph, predict, calibration = costs.graph, costs.predict, costs.calibration
    report: dict[str, Any] = {
        "model": run.model,
        "k": k,
        "samples": run.samples,
        "latency_samples": run.latency_samples,
        "cost_model": {
            "costs": run.costs,
            "flops_per_second": run.flops_per_second,
            "bandwidth": run.bandwidth,
            "latency": run.latency,
        },
        "calibration": (
            {"input_message": calibration.input_message, "output_message": calibration.output_message}
            if calibration
            else None
        ),
        "emulated_link": run.emulate_link,
        "real_links": run.real_links,
        "pin_cores": run.pin_cores,
        "tracer": run.tracer,
        "nodes": graph.n,
        "acyclic": run.acyclic,
        "unsplit_seconds_per_sample": unsplit,
        "predicted_unsplit_seconds": float(graph.cost.sum()),
        "runs": {},
    }
    link = {"latency": run.latency, "bandwidth": run.bandwidth} if run.emulate_link else {}
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    index = {name: v for v, name in enumerate(graph.node_ids)}
    try:
        plans = {}
        for method in run.methods:
            # on real links the stages' messages queue on their hosts' links: ours ranks on that
            part = partition(
                graph, k, method, acyclic=run.acyclic, options=PartitionOptions(shared_links=run.real_links)
            )
            _publish_plan(graph, part.assignment, k, method)
            start, finish = schedule(predict, part.assignment)
            # each stage runs its nodes in the simulated schedule's order (start, end, graph order)
            order = sorted(index, key=lambda name: (start[index[name]], finish[index[name]], position.get(name, 0)))
            plans[method] = (part, part.by_node_id(graph), start, finish, order)
        measured: dict[str, dict[str, list]] = {
            m: {"elapsed": [], "latency": [], "same": [], "breakdown": [], "predicted": [], "ratio": []} for m in plans
        }
        total = warmup + run.samples + run.latency_samples
        # rounds alternate the methods, so that a spell of load on the machine meets them alike
        # and each round shifts the stages' cores by one, so that no method keeps a busier core
        # and each round's prediction uses costs measured just before it, on the cores it uses
        # (a spell of load then shows in both the prediction and the measurement)
        for shift in range(max(run.rounds, 1)):
            if shift > 0 and costs.calibration is not None:
                costs = _measure_costs(session, run, gm, graph, inputs[0], shift)
            for method, (part, assignment, start, finish, order) in plans.items():
                session.start(assignment, order, total, run.trace, link, shift)
                session.stream(0, warmup)  # first calls pay for lazy initialisation; kept out of the timing
                t0 = time.perf_counter()
                streamed = session.stream(warmup, warmup + run.samples)
                m = measured[method]
                m["elapsed"].append(time.perf_counter() - t0)
                lone, sent, arrived = session.one_at_a_time(warmup + run.samples, total)
                outputs = [o for o, _ in streamed] + lone
                m["same"].append(all(_close(o, e) for o, e in zip(outputs, expected)))
                if run.trace:
                    m["breakdown"].append(_breakdown(predict, part.assignment, start, finish, session.traces(), sent))
                latencies = [arrived[x] - sent[x] for x in sent]
                m["latency"] += latencies
                if costs.calibration is not None:
                    predicted = pipeline_latency(
                        gm, assignment, order, costs.times, costs.messages, run, costs.calibration, costs.late
                    )
                    m["predicted"].append(predicted)
                    m["ratio"] += [t / predicted for t in latencies]
        for method, (part, assignment, start, finish, order) in plans.items():
            metrics = evaluate(predict, part.assignment, k)
            m = measured[method]
            report["runs"][method] = {
                "seconds_per_sample": statistics.median(m["elapsed"]) / max(run.samples, 1),
                "outputs_equal_unsplit": all(m["same"]),
                "latency_seconds": statistics.median(m["latency"]) if m["latency"] else None,
                # first quartile, median, third quartile of the lone samples (their spread)
                "latency_quartiles_seconds": _quartiles(m["latency"]),
                "simulated_makespan": metrics["makespan"],
                # the rounds' predictions (each from the costs measured just before the round)
                "predicted_latency": statistics.median(m["predicted"]) if m["predicted"] else None,
                "predicted_latency_rounds": m["predicted"],
                # each lone sample's latency over its round's prediction: quartiles
                "latency_over_predicted_quartiles": _quartiles(m["ratio"]),
                "max_load": metrics["max_load"],
                "cut_count": metrics["cut_count"],
                "critical_cut_count": metrics["critical_cut_count"],
                "device_graph_acyclic": metrics["device_graph_acyclic"],
                "feasible": part.feasible,
                "breakdown": _median_breakdown(m["breakdown"]) if m["breakdown"] else None,
            }
    finally:
        session.close()
    return report


@dataclass
class _Costs:
    """What a prediction rests on, measured at one moment: the stage calibration, the op
    times used (calibrated or profiled), the messages, the link's lateness; ``graph``: the
    partitioner's graph with these costs; ``predict``: the same plus the driver trips."""

    calibration: Calibration | None
    times: dict[str, float]
    messages: dict[str, Message]
    late: float
    graph: Any
    predict: Any


def _measure_costs(session: _Session, run: PipelineRun, gm, graph, example, shift: int) -> _Costs:
    """Op and message costs now (``PipelineRun.costs``), the calibration on the core ``shift``
    picks; with ``flops`` costs ``graph`` unchanged and nothing measured."""
    import dataclasses

    import numpy as np

    from trainmaster.partition.importers import node_times

    if run.costs == "flops":
        return _Costs(None, {}, {}, 0.0, graph, graph)
    ops = {n.name: n.op for n in gm.graph.nodes}
    driver_nodes = np.asarray([ops.get(i) in ("placeholder", "output") for i in graph.node_ids])
    calibration = session.calibrate(max(run.profile_runs, 20), shift)
    if run.real_links:  # the input crossed a real link on its trip: that part is not fixed
        on_link = run.latency + len(pickle.dumps(example, protocol=pickle.HIGHEST_PROTOCOL)) / run.bandwidth
        calibration = dataclasses.replace(calibration, fixed=max(calibration.input_message - on_link, 0.0))
    if run.costs == "measured":
        times = calibration.node_seconds
    else:
        times = node_times(gm, (example,), max(run.profile_runs, 1), profiler=True)
    cost = np.asarray([0.0 if d else times.get(i, 0.0) for i, d in zip(graph.node_ids, driver_nodes)])
    messages = measure_messages(gm, (example,))
    late = link_lateness(int(statistics.median([m.size for m in messages.values()]))) if run.emulate_link else 0.0
    costed = with_message_costs(dataclasses.replace(graph, cost=cost), gm, messages, run, calibration.fixed, late)
    # the prediction's graph: a sample's trips from and to the driver are the input and output
    # nodes' own time (every stage pays them alike, wherever the nodes sit)
    trips = np.where(
        [ops.get(i) == "placeholder" for i in graph.node_ids],
        calibration.input_message,
        np.where([ops.get(i) == "output" for i in graph.node_ids], calibration.output_message, 0.0),
    )
    return _Costs(calibration, times, messages, late, costed, dataclasses.replace(costed, cost=costed.cost + trips))


def _quartiles(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return [values[0]] * 3 if values else None
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q2, q3]


def _close(out, expected) -> bool:
    """Outputs equal the unsplit model's (tensors, or tuples / dicts / ModelOutputs of them)."""
    import torch

    if isinstance(out, torch.Tensor) and isinstance(expected, torch.Tensor):
        return out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)
    if isinstance(expected, dict):
        return all(_close(out[key], expected[key]) for key in expected if key in out)
    if isinstance(expected, (tuple, list)):
        return all(_close(o, e) for o, e in zip(out, expected))
    return out == expected


@dataclass
class Message:
    """One node's output as a message between processes: its pickled size and the seconds the
    sender spends pickling it and the receiver's reader thread unpickling it (medians)."""

    size: int
    dumps: float
    loads: float


def measure_messages(gm, args: tuple, repeats: int = 3) -> dict[str, Message]:
    """``Message`` of every node output another node reads, on a real run of ``gm``."""
    import torch

    values: dict[str, Any] = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.users and n.op != "output":
                values[n.name] = result
            return result

    with torch.no_grad():
        Keep(gm).run(*args)
    out = {}
    for name, value in values.items():
        dumps, loads = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            data = pickle.dumps(("value", 0, name, value), protocol=pickle.HIGHEST_PROTOCOL)
            t1 = time.perf_counter()
            pickle.loads(data)
            dumps.append(t1 - t0)
            loads.append(time.perf_counter() - t1)
        out[name] = Message(len(data), statistics.median(dumps), statistics.median(loads))
    return out


def link_lateness(size: int, repeats: int = 8) -> float:
    """Seconds after its due time that a value sent over an emulated ``Link`` is in the hands
    of a thread waiting for it (median; on a loopback pair in this process, the unpickling
    left out): the mailbox's timed wait waking, on top of the link's own delay."""
    import torch

    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    box = Mailbox()
    accepted: list[Connection] = []

    def serve_one() -> None:
        conn = listener.accept()
        accepted.append(conn)
        _reader(conn, box)

    threading.Thread(target=serve_one, daemon=True).start()
    link = Link(_dial(f"127.0.0.1:{listener.address[1]}", time.monotonic() + TIMEOUT_S), 1e-3, float("inf"))
    value = torch.zeros(max(size // 4, 1))
    data = pickle.dumps(("value", 0, "x", value), protocol=pickle.HIGHEST_PROTOCOL)
    t0 = time.perf_counter()
    pickle.loads(data)
    loads = time.perf_counter() - t0
    late = []
    try:
        for r in range(repeats):
            time.sleep(2e-3)  # idle in between, as between a lone sample's messages
            t0 = time.perf_counter()
            _send(link, ("value", r, "x", value))
            box.take((r, "x"))
            late.append(time.perf_counter() - t0 - 1e-3 - loads)
    finally:
        link.close()
        listener.close()
        for c in accepted:
            c.close()
    return max(statistics.median(late), 0.0)


def with_message_costs(graph, gm, messages: dict[str, Message], run: PipelineRun, fixed: float, late: float):
    """``graph`` with each edge charged what its message costs on this pipeline: ``fixed`` (one
    message between processes, measured: ``Calibration.input_message``) plus pickling and
    unpickling the source node's real output (``measure_messages``), plus, between two stages
    and when the run emulates it, the link's ``latency + bytes / bandwidth`` on the pickled
    message's size (what ``Link`` delays) and the receiver's measured lateness ``late``. Edges
    from the input and to the output are trips to and from the driver, charged as the input and
    output nodes' time instead (``run_pipeline``): they cost nothing here."""
    import dataclasses

    import numpy as np

    ops = {n.name: n.op for n in gm.graph.nodes}
    cost = np.zeros(len(graph.src))
    for e, (u, v) in enumerate(zip(graph.src.tolist(), graph.dst.tolist())):
        name_u, name_v = graph.node_ids[u], graph.node_ids[v]
        if ops.get(name_u) == "placeholder" or ops.get(name_v) == "output" or name_u not in messages:
            continue
        m = messages[name_u]
        cost[e] = fixed + m.dumps + m.loads
        if run.priced_link:
            cost[e] += late + run.latency + m.size / run.bandwidth
    return dataclasses.replace(graph, edge_cost=cost)


def pipeline_latency(
    gm,
    assignment: dict[str, int],
    order: list[str],
    node_seconds: dict[str, float],
    messages: dict[str, Message],
    run: PipelineRun,
    calibration: Calibration,
    late: float,
) -> float:
    """Predicted latency of one sample alone in the pipeline, simulating what the stages do
    (``run_stage``), which the partitioner's makespan simulator leaves out: a stage runs its
    nodes in ``order``, each when its inputs have arrived, and after a node it pickles the value
    once per other stage (or the driver) that reads it, on its own thread, before going on; a
    message then takes ``fixed`` + the link (``latency + bytes / bandwidth`` + the receiver's
    measured lateness) + unpickling on the receiver's reader thread. The input reaches its
    readers ``calibration.input_message`` after it is sent; the output is complete when the
    last value the output node reads has reached the driver.

    On real links (``run.real_links``) messages also queue: a value's bytes hold the sender's
    link to the switch and the receiver's link from it, so a message starts on the wire only
    when both are free (an emulated link, like the partitioner's simulator, lets every message
    have the link to itself)."""
    consumers = plan_consumers(gm, assignment)
    nodes = {n.name: n for n in gm.graph.nodes}
    fixed = calibration.fixed
    link = run.latency + late if run.priced_link else 0.0
    free: dict[int, float] = {}
    up: dict[int, float] = {}  # real links: when a stage's link to the switch is free
    down: dict[int, float] = {}  # and its link from the switch
    # when each value is available on each process (stage index or DRIVER)
    ready: dict[tuple[str, int], float] = {}
    done: dict[str, float] = {}
    for name in order:
        node = nodes[name]
        if node.op == "placeholder":
            for dest in consumers.get(name, ()):
                ready[(name, dest)] = calibration.input_message
            continue
        if node.op == "output":
            continue
        d = assignment[name]
        start = free.get(d, 0.0)
        for arg in node.all_input_nodes:
            local = arg.op != "placeholder" and assignment.get(arg.name) == d
            t = done[arg.name] if local else ready[(arg.name, d)]
            start = max(start, t)
        t = done[name] = start + node_seconds.get(name, 0.0)
        m = messages.get(name)
        for dest in sorted(consumers.get(name, ())):
            if m is None:
                continue
            t += m.dumps  # pickled on the stage's thread, once per reader process
            if dest == DRIVER:
                ready[(name, dest)] = t + calibration.output_message
            elif run.real_links:
                on_wire = max(t, up.get(d, 0.0), down.get(dest, 0.0))
                up[d] = down[dest] = arrived = on_wire + link + m.size / run.bandwidth
                ready[(name, dest)] = arrived + fixed + m.loads
            else:
                ready[(name, dest)] = t + fixed + m.loads + (link + m.size / run.bandwidth if run.priced_link else 0)
        free[d] = t
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return max([ready.get((a.name, DRIVER), 0.0) for a in out.all_input_nodes if a.op != "placeholder"] + [0.0])


def _breakdown(graph, assignment, start, finish, traces: list, sent_at: dict[int, float]) -> dict:
    """Predicted vs measured for the one-at-a-time samples, per stage: compute (the sum of its
    nodes' times), the time its last node ends (from the sample's input leaving the driver), and
    the time it spends waiting for values; medians over the samples."""
    import numpy as np

    index = {name: v for v, name in enumerate(graph.node_ids)}
    part = np.asarray(assignment)
    per_stage: list[dict[str, float]] = []
    for _, stage, records, _ in sorted(traces, key=lambda t: t[1]):
        mine = part == stage
        compute, end, wait = [], [], []
        for sample, t_sent in sent_at.items():
            rows = [r for r in records if r[0] == sample and r[1] in index]
            if not rows:
                continue
            compute.append(sum(r[4] - r[3] for r in rows))
            end.append(max(r[4] for r in rows) - t_sent)
            wait.append(sum(r[3] - r[2] for r in rows))
        predicted_end = float(finish[mine].max()) if mine.any() else 0.0
        predicted_compute = float(graph.cost[mine].sum())
        per_stage.append(
            {
                "stage": stage,
                "predicted_compute": predicted_compute,
                "measured_compute": statistics.median(compute) if compute else 0.0,
                "predicted_end": predicted_end,
                "measured_end": statistics.median(end) if end else 0.0,
                "predicted_wait": _predicted_wait(start, finish, mine),
                "measured_wait": statistics.median(wait) if wait else 0.0,
            }
        )
    return {"stages": per_stage}


def _median_breakdown(rounds: list[dict]) -> dict:
    """Per stage and field, the median over the rounds' breakdowns (``_breakdown``)."""
    stages = []
    for per_round in zip(*(r["stages"] for r in rounds)):
        stages.append({key: statistics.median(st[key] for st in per_round) for key in per_round[0]})
    return {"stages": stages}


def _predicted_wait(start, finish, mine) -> float:
    """The time a device idles between its operators in the simulated schedule (from 0)."""
    import numpy as np

    if not mine.any():
        return 0.0
    s, f = np.asarray(start)[mine], np.asarray(finish)[mine]
    order = np.lexsort((f, s))
    s, f = s[order], f[order]
    prev = np.concatenate([[0.0], np.maximum.accumulate(f)[:-1]])
    return float(np.clip(s - prev, 0.0, None).sum())


def run_local(run: PipelineRun, k: int, timeout: float = 600.0) -> dict:
    """``run`` with k stage processes started here (loopback, free ports), the driver in this
    process; the stages are stopped by the driver, or killed (by their pid) when it fails."""
    import socket
    import subprocess

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    ports = [free_port() for _ in range(k + 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainmaster.partition.pipeline", "stage"], env={**os.environ, "TM_PORT": str(p)}
        )
        for p in ports[:k]
    ]
    try:
        report = run_pipeline([f"127.0.0.1:{p}" for p in ports[:k]], ports[k], run)
        for proc in procs:
            proc.wait(timeout=timeout)
        return report
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def run_from_params(params: dict) -> PipelineRun:
    """The job's ``frameworkParams`` as a PipelineRun (defaults where absent)."""
    return PipelineRun(
        model=params.get("model", "trainmaster.partition.models:inception"),
        input_shape=tuple(params.get("input_shape", [1, 3, 32, 32])),
        methods=list(params.get("methods", ["trainmaster", "metis"])),
        samples=int(params.get("samples", 20)),
        seed=int(params.get("seed", 0)),
        model_args=dict(params.get("model_args") or {}),
        bandwidth=float(params.get("bandwidth", 1e9)),
        flops_per_second=float(params.get("flops_per_second", 1e10)),
        latency=float(params.get("latency", 1e-3)),
        acyclic=bool(params.get("acyclic", True)),
        tracer=str(params.get("tracer", "fx")),
        input_dtype=params.get("input_dtype"),
        costs=str(params.get("costs", "flops")),
        profile_runs=int(params.get("profile_runs", 5)),
        emulate_link=bool(params.get("emulate_link", False)),
        real_links=bool(params.get("real_links", False)),
        latency_samples=int(params.get("latency_samples", 0)),
        pin_cores=bool(params.get("pin_cores", False)),
        trace=bool(params.get("trace", False)),
        rounds=int(params.get("rounds", 1)),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A pipeline stage or driver (run by the controller).")
    ap.add_argument("role", choices=["stage", "driver"])
    args = ap.parse_args(argv)
    port = int(os.environ["TM_PORT"])
    if args.role == "stage":
        run_stage(port)
        return 0
    params = json.loads(os.environ.get("TM_PIPELINE_PARAMS", "{}"))
    stages = [a for a in os.environ["TM_SERVICE_STAGE"].split(",") if a]
    report = run_pipeline(stages, port, run_from_params(params))
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    out_dir = os.environ.get("TM_OUTPUT_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "pipeline.json").write_text(text)
    ok = all(r["outputs_equal_unsplit"] for r in report["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Reader threads may still be inside torch's unpickling when a peer hangs up; letting the
    # interpreter finalise under them can abort ("terminate called without an active
    # exception"), so leave without finalisation once our own work is done and flushed.
    os._exit(code)
