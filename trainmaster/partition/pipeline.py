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
import sys
import threading
import time
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
                raise TimeoutError(f"pipeline: value {key[1]!r} of sample {key[0]} never arrived "
                                   f"within {timeout}s")
            return self._items.pop(key)

    def take_control(self, timeout: float = TIMEOUT_S):
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self.control), timeout=timeout):
                raise TimeoutError(f"pipeline: no instruction from the driver within {timeout}s")
            return self.control.pop(0)


def _send(conn: Connection, msg) -> None:
    """Plain pickle, not Connection.send: torch registers a ForkingPickler reduction that passes
    tensors as shared-memory handles, which only works between related processes."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


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
    trainmaster.publish("partition.plan", {
        "method": method, "devices": k,
        "nodes": [{"id": names[v], "device": int(assignment[v]), "critical": v in on_critical}
                  for v in range(len(graph.node_ids))],
        "edges": [{"src": names[int(s)], "dst": names[int(d)], "critical": bool(c)}
                  for s, d, c in zip(graph.src, graph.dst, critical)]})


def run_stage(port: int) -> None:
    """A stage: serve runs until the driver says stop."""
    import torch

    torch.set_num_threads(1)
    box = Mailbox()
    listener = Listener(("127.0.0.1", port), authkey=AUTHKEY)
    threading.Thread(target=_serve, args=(listener, box), daemon=True).start()
    peers: dict[int, Connection] = {}
    while True:
        msg = box.take_control(timeout=600.0)
        if msg[0] == "stop":
            break
        _, cfg = msg
        me = cfg["stage"]
        deadline = time.monotonic() + TIMEOUT_S
        if DRIVER not in peers:
            peers[DRIVER] = _dial(cfg["driver"], deadline)
        for j, addr in enumerate(cfg["stages"]):
            if j != me and j not in peers:
                peers[j] = _dial(addr, deadline)
        model = build_model(cfg["model"], cfg["seed"])
        gm = torch.fx.symbolic_trace(model)
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


def run_driver(stages: list[str], port: int, model_spec: str, input_shape: tuple[int, ...],
               methods: list[str], samples: int, seed: int, bandwidth: float,
               flops_per_second: float = 1e10, latency: float = 1e-3,
               acyclic: bool = True) -> dict:
    """Partition the model with each method, run it through the stages, check and time it."""
    import torch

    from trainmaster.partition import evaluate, partition
    from trainmaster.partition.importers import from_module

    torch.set_num_threads(1)
    k = len(stages)
    box = Mailbox()
    listener = Listener(("127.0.0.1", port), authkey=AUTHKEY)
    threading.Thread(target=_serve, args=(listener, box), daemon=True).start()
    deadline = time.monotonic() + TIMEOUT_S
    conns = [_dial(a, deadline) for a in stages]
    model = build_model(model_spec, seed)
    torch.manual_seed(seed + 1)
    inputs = [torch.randn(*input_shape) for _ in range(samples)]
    warmup = max(2, samples // 5)
    feed = inputs[:warmup] + inputs
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        t0 = time.perf_counter()
        for x in inputs:
            model(x)
        unsplit = (time.perf_counter() - t0) / samples
    graph, gm = from_module(model, (inputs[0],), bandwidth=bandwidth,
                            flops_per_second=flops_per_second, latency=latency)
    report: dict[str, Any] = {"model": model_spec, "k": k, "samples": samples,
                              "cost_model": {"flops_per_second": flops_per_second,
                                             "bandwidth": bandwidth, "latency": latency},
                              "acyclic": acyclic,
                              "unsplit_seconds_per_sample": unsplit, "runs": {}}
    for method in methods:
        part = partition(graph, k, method, acyclic=acyclic)
        assignment = part.by_node_id(graph)
        metrics = evaluate(graph, part.assignment, k)
        _publish_plan(graph, part.assignment, k, method)
        cfg = {"assignment": assignment, "model": model_spec, "seed": seed,
               "samples": warmup + samples,
               "stages": stages, "driver": f"127.0.0.1:{port}"}
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
                env = {a: feed[sample] if a.op == "placeholder" else box.take((sample, a.name))
                       for a in out_node.all_input_nodes}
                outs.append(torch.fx.node.map_arg(out_node.args[0], lambda a: env[a]))
            return outs

        stream(0, warmup)  # first calls pay for lazy initialisation; keep them out of the timing
        t0 = time.perf_counter()
        outputs = stream(warmup, warmup + samples)
        elapsed = time.perf_counter() - t0
        same = all(torch.allclose(o, e, atol=1e-5) for o, e in zip(outputs, expected))
        report["runs"][method] = {
            "seconds_per_sample": elapsed / samples, "outputs_equal_unsplit": same,
            "simulated_makespan": metrics["makespan"], "max_load": metrics["max_load"],
            "cut_count": metrics["cut_count"], "critical_cut_count": metrics["critical_cut_count"],
            "device_graph_acyclic": metrics["device_graph_acyclic"],
        }
    for conn in conns:
        _send(conn, ("stop",))
        conn.close()
    listener.close()
    return report


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
    report = run_driver(stages, port, params.get("model", "trainmaster.partition.models:inception"),
                        tuple(params.get("input_shape", [1, 3, 32, 32])),
                        list(params.get("methods", ["trainmaster", "metis"])),
                        int(params.get("samples", 20)), int(params.get("seed", 0)),
                        float(params.get("bandwidth", 1e9)),
                        float(params.get("flops_per_second", 1e10)),
                        float(params.get("latency", 1e-3)),
                        bool(params.get("acyclic", True)))
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
