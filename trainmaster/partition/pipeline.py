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
import heapq
import importlib
import json
import os
import pickle
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

DRIVER = -1
TIMEOUT_S = 60.0
AUTHKEY = b"trainmaster-pipeline"


def build_model(spec: str, seed: int):
    import torch

    mod_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(mod_name), attr)
    torch.manual_seed(seed)
    model = factory()
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
    """Values that arrived from other processes, keyed by (sample, node name)."""

    def __init__(self) -> None:
        self._items: dict[tuple[int, str], Any] = {}
        self._cond = threading.Condition()
        self.control: list[Any] = []

    def put(self, key, value) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def put_control(self, msg) -> None:
        with self._cond:
            self.control.append(msg)
            self._cond.notify_all()

    def take(self, key, timeout: float = TIMEOUT_S):
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._items, timeout=timeout):
                raise TimeoutError(f"pipeline: value {key[1]!r} of sample {key[0]} never arrived within {timeout}s")
            return self._items.pop(key)

    def take_control(self, timeout: float = TIMEOUT_S):
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self.control), timeout=timeout):
                raise TimeoutError(f"pipeline: no instruction from the driver within {timeout}s")
            return self.control.pop(0)


def _send(conn: "Connection | Link", msg) -> None:
    """Plain pickle, not Connection.send: torch registers a ForkingPickler reduction that passes
    tensors as shared-memory handles, which only works between related processes."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if isinstance(conn, Link):
        conn.send_bytes(data, delayed=msg[0] == "value")
    else:
        conn.send_bytes(data)


class Link:
    """A connection with an emulated slower link: each value message is delivered
    ``latency + bytes / bandwidth`` seconds after it was sent (control messages at once).

    Why a delay line and not a token bucket: the makespan simulator charges every cut edge its
    own transfer time and lets transfers overlap (no link contention); a token bucket would
    queue messages behind each other, which the model does not price. Messages are sent in
    order of their due time by one thread per link, which sleeps on a condition with the time
    to the next due message as its timeout (no polling). Loopback's own cost (pickling, the
    socket) comes on top; the per-message ``latency`` of the cost model is meant to cover both."""

    def __init__(self, conn: Connection, latency: float = 0.0, bandwidth: float = float("inf")) -> None:
        self.conn = conn
        self._due: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._lock = threading.Lock()  # one writer on the socket at a time
        self._thread: threading.Thread | None = None
        self.configure(latency, bandwidth)

    def configure(self, latency: float, bandwidth: float) -> None:
        """The emulated link for the messages sent from now on."""
        if not (latency >= 0 and bandwidth > 0):
            raise ValueError(f"link: latency {latency} must be >= 0, bandwidth {bandwidth} > 0")
        self.latency, self.bandwidth = latency, bandwidth
        self.emulated = latency > 0 or bandwidth != float("inf")
        if self.emulated and self._thread is None:
            self._thread = threading.Thread(target=self._deliver, daemon=True)
            self._thread.start()

    def send_bytes(self, data: bytes, delayed: bool = True) -> None:
        if not (delayed and self.emulated):
            with self._lock:
                self.conn.send_bytes(data)
            return
        due = time.monotonic() + self.latency + len(data) / self.bandwidth
        with self._cond:
            heapq.heappush(self._due, (due, self._seq, data))
            self._seq += 1
            self._cond.notify()

    def _deliver(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed and not self._due:
                        return
                    wait = self._due[0][0] - time.monotonic() if self._due else TIMEOUT_S
                    if self._due and wait <= 0:
                        _, _, data = heapq.heappop(self._due)
                        break
                    self._cond.wait(timeout=wait)  # woken early by a new message or close
            try:
                with self._lock:
                    self.conn.send_bytes(data)
            except OSError:
                return

    def close(self) -> None:
        """Deliver what is queued (waiting at most TIMEOUT_S for it), then close."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S)
        self.conn.close()


def _reader(conn: Connection, box: Mailbox) -> None:
    try:
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "value":
                box.put((msg[1], msg[2]), msg[3])
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
    """A stage: serve runs until the driver says stop."""
    import torch

    torch.set_num_threads(1)
    box = Mailbox()
    listener = Listener(("127.0.0.1", port), authkey=AUTHKEY)
    threading.Thread(target=_serve, args=(listener, box), daemon=True).start()
    peers: dict[int, Link] = {}
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
        model = build_model(cfg["model"], cfg["seed"])
        shape = cfg.get("input_shape")
        gm = trace_for_pipeline(
            model, cfg.get("tracer", "fx"), example_input(shape, cfg.get("input_dtype")) if shape else None
        )
        assignment = cfg["assignment"]
        consumers = plan_consumers(gm, assignment)
        mine = [n for n in gm.graph.nodes if _owner(n, assignment) == me]
        interp = torch.fx.Interpreter(gm)
        _send(peers[DRIVER], ("ready", me))
        with torch.no_grad():
            for sample in range(cfg["samples"]):
                interp.env = {}
                for node in mine:
                    for arg in node.all_input_nodes:
                        if arg not in interp.env:
                            interp.env[arg] = box.take((sample, arg.name))
                    value = interp.run_node(node)
                    interp.env[node] = value
                    for dest in consumers.get(node.name, ()):
                        _send(peers[dest], ("value", sample, node.name, value))
    for conn in peers.values():
        conn.close()
    listener.close()


@dataclass
class PipelineRun:
    """What the driver runs: the model (``module:callable``) and its input, how it is traced and
    costed, the methods to compare, and the link.

    ``costs``: ``flops`` (FLOPs / ``flops_per_second``) or ``measured`` (each node's wall time
    in the same fx Interpreter the stages run it in, mean of ``profile_runs`` runs: the
    per-node overhead of running a graph node by node is then in the prediction too).
    ``emulate_link``: stage-to-stage messages are delayed by ``latency + bytes / bandwidth``,
    the cost model's own edge cost (``Link``), so the run has the link the prediction assumed.
    ``latency_samples``: samples sent one at a time after the streamed ones, each timed from its
    input leaving the driver to its output arriving: the measured counterpart of the makespan
    (one sample's latency); the streamed time per sample is that of ``max_load``."""

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


def run_pipeline(stages: list[str], port: int, run: PipelineRun) -> dict:
    """Partition the model with each method, run it through the stages, check and time it."""
    import torch

    from trainmaster.partition import evaluate, partition
    from trainmaster.partition.importers import from_module

    if run.costs not in ("flops", "measured"):
        raise ValueError(f"pipeline costs {run.costs!r}: use flops or measured")
    torch.set_num_threads(1)
    k = len(stages)
    box = Mailbox()
    listener = Listener(("127.0.0.1", port), authkey=AUTHKEY)
    threading.Thread(target=_serve, args=(listener, box), daemon=True).start()
    deadline = time.monotonic() + TIMEOUT_S
    conns = [_dial(a, deadline) for a in stages]
    model = build_model(run.model, run.seed)
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
    if run.costs == "measured":
        graph = _with_measured_costs(graph, gm, (inputs[0],), run.profile_runs)
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
        "emulated_link": run.emulate_link,
        "tracer": run.tracer,
        "nodes": graph.n,
        "acyclic": run.acyclic,
        "unsplit_seconds_per_sample": unsplit,
        "predicted_unsplit_seconds": float(graph.cost.sum()),
        "runs": {},
    }
    link = {"latency": run.latency, "bandwidth": run.bandwidth} if run.emulate_link else {}
    for method in run.methods:
        part = partition(graph, k, method, acyclic=run.acyclic)
        assignment = part.by_node_id(graph)
        metrics = evaluate(graph, part.assignment, k)
        _publish_plan(graph, part.assignment, k, method)
        total = warmup + run.samples + run.latency_samples
        cfg = {
            "assignment": assignment,
            "model": run.model,
            "seed": run.seed,
            "samples": total,
            "stages": stages,
            "driver": f"127.0.0.1:{port}",
            "tracer": run.tracer,
            "input_shape": list(run.input_shape),
            "input_dtype": run.input_dtype,
            "link": link,
        }
        for j, conn in enumerate(conns):
            _send(conn, ("run", {**cfg, "stage": j}))
        for _ in range(k):
            box.take_control()
        consumers = plan_consumers(gm, assignment)
        placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
        out_node = next(n for n in gm.graph.nodes if n.op == "output")

        def stream(first: int, last: int) -> list:
            for sample in range(first, last):
                for dest in consumers.get(placeholder.name, ()):
                    _send(conns[dest], ("value", sample, placeholder.name, feed[sample]))
            outs = []
            for sample in range(first, last):
                env = {
                    a: feed[sample] if a.op == "placeholder" else box.take((sample, a.name))
                    for a in out_node.all_input_nodes
                }
                outs.append(torch.fx.node.map_arg(out_node.args[0], lambda a: env[a]))
            return outs

        stream(0, warmup)  # first calls pay for lazy initialisation; keep them out of the timing
        t0 = time.perf_counter()
        outputs = stream(warmup, warmup + run.samples)
        elapsed = time.perf_counter() - t0
        one_at_a_time = []
        for sample in range(warmup + run.samples, total):
            t1 = time.perf_counter()
            outputs += stream(sample, sample + 1)
            one_at_a_time.append(time.perf_counter() - t1)
        same = all(_close(o, e) for o, e in zip(outputs, expected))
        report["runs"][method] = {
            "seconds_per_sample": elapsed / max(run.samples, 1),
            "outputs_equal_unsplit": same,
            "latency_seconds": statistics.median(one_at_a_time) if one_at_a_time else None,
            "simulated_makespan": metrics["makespan"],
            "max_load": metrics["max_load"],
            "cut_count": metrics["cut_count"],
            "critical_cut_count": metrics["critical_cut_count"],
            "device_graph_acyclic": metrics["device_graph_acyclic"],
            "feasible": part.feasible,
        }
    for conn in conns:
        _send(conn, ("stop",))
        conn.close()
    listener.close()
    return report


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


def _with_measured_costs(graph, gm, args: tuple, runs: int):
    """``graph`` with each node's cost replaced by its mean wall time over ``runs`` runs of
    ``gm`` node by node in a plain fx Interpreter (as the stages run it; no FLOP counter)."""
    import dataclasses

    import numpy as np
    import torch

    times: dict[str, list[float]] = {}

    class Timer(torch.fx.Interpreter):
        def run_node(self, n):
            t0 = time.perf_counter()
            result = super().run_node(n)
            times.setdefault(n.name, []).append(time.perf_counter() - t0)
            return result

    with torch.no_grad():
        for _ in range(max(runs, 1) + 1):  # the first run warms caches: dropped below
            Timer(gm).run(*args)
    # the mean, not the median: an op's expected time includes the preemptions a loaded machine
    # deals it, which the run will meet too (the median leaves them out and under-predicted a
    # whole-model run by 2.5-4x at load average ~15 on 2 cores)
    cost = np.asarray([statistics.fmean(times[i][1:]) if len(times.get(i, [])) > 1 else 0.0 for i in graph.node_ids])
    # placeholders and the output node run in the driver, not on a device
    ops = {n.name: n.op for n in gm.graph.nodes}
    cost[[ops.get(i) in ("placeholder", "output") for i in graph.node_ids]] = 0.0
    return dataclasses.replace(graph, cost=cost)


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
        bandwidth=float(params.get("bandwidth", 1e9)),
        flops_per_second=float(params.get("flops_per_second", 1e10)),
        latency=float(params.get("latency", 1e-3)),
        acyclic=bool(params.get("acyclic", True)),
        tracer=str(params.get("tracer", "fx")),
        input_dtype=params.get("input_dtype"),
        costs=str(params.get("costs", "flops")),
        profile_runs=int(params.get("profile_runs", 5)),
        emulate_link=bool(params.get("emulate_link", False)),
        latency_samples=int(params.get("latency_samples", 0)),
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
