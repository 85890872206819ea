"""Our scheduler in Flower's deployment runtime (needs ``flwr``; not a dependency of trainmaster).

``FlschedFedAvg`` is Flower's FedAvg (the Message API strategy) with one change: the nodes that
train each round are the ones our scheduler leases to the run, not Flower's uniform sample.
It asks a *selector* (``select(online, n)`` / ``release()``): an ``ArbiterClient`` when several
runs share a federation (the arbiter process schedules them together and never leases a node
to two runs at once), or an in-process ``JobSelector`` / ``JointJob``. Aggregation stays
FedAvg's; the round's nodes are released when its replies are in, error replies included (a
node that went away is one of them, and absent from the next round's connected nodes).

The Flower App of the federation runs (``federation.py`` makes its ``pyproject.toml``; the
components below are imported from this installed module):

- ``server_app``: run config ``mode = "train"``: FedAvg on one of the small scikit-learn jobs
  (digits, wine, breast-cancer, shards prepared by the launcher), rounds until the job's test
  accuracy reaches ``target`` or ``max-rounds``, with ``selection = "flower"`` (Flower's own
  FedAvg sampling) or ``"flsched"`` (leases from the arbiter at ``arbiter``); every round is
  written to ``results-dir/<run-name>.jsonl`` (wall time, nodes, accuracy). ``mode =
  "enrol"``: asks every connected node for its device profile (a Flower *query* message) and
  enrols them with the arbiter.
- ``client_app``: trains the global model on the node's shard (numpy, ``npmodel``) and then
  takes the time a device of its profile would: tau x samples x (a + X / mu) + bytes /
  bandwidth, X ~ Exp(1), divided by the node's ``speedup`` (it sleeps the rest after the real
  training). Each node's profile comes from its ``--node-config``.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from trainmaster.flsched import npmodel
from trainmaster.flsched.model import ProblemError

log = logging.getLogger(__name__)


class FlschedFedAvg(FedAvg):
    """FedAvg whose training nodes are leased from a flsched selector (see the module).

    ``per_round`` nodes train each round; a round that cannot be scheduled now (``ProblemError``)
    is logged and skipped (no messages), and the next round asks again. Every other keyword goes
    to FedAvg; federated evaluation is off unless asked for (``fraction_evaluate``)."""

    def __init__(self, selector: Any, per_round: int, **fedavg: Any) -> None:
        fedavg.setdefault("fraction_evaluate", 0.0)
        fedavg.setdefault("min_train_nodes", per_round)
        super().__init__(**fedavg)
        self.selector, self.per_round = selector, per_round
        self.leased: list[int] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        online = [str(n) for n in grid.get_node_ids()]
        try:
            chosen = self.selector.select(online, self.per_round)
        except ProblemError as exc:
            log.warning("flsched: round %d skipped: %s %s", server_round, exc.message, "; ".join(exc.details))
            self.leased = []
            return []
        self.leased = [int(n) for n in chosen]
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return list(self._construct_messages(record, self.leased, MessageType.TRAIN))

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        try:
            return super().aggregate_train(server_round, replies)
        finally:
            try:
                self.selector.release()
            except ProblemError as exc:  # the arbiter is gone: its lease time frees the nodes
                log.warning("flsched: round %d's nodes not released: %s", server_round, exc.message)
            self.leased = []


# ----------------------------------------------------------------------------- the Flower App
server_app = ServerApp()
client_app = ClientApp()

ROUND_TIMEOUT_S = 900.0
"""Longest a round may wait for its replies (a SIGKILLed node is reported after about 60 s)."""


def _dataset(data_dir: str, name: str) -> Any:
    return np.load(Path(data_dir) / f"{name}.npz")


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    if cfg.get("mode") == "enrol":
        count = enrol_nodes(grid, str(cfg["arbiter"]), int(cfg.get("num-nodes", 1)))
        if cfg.get("results-dir"):
            marker = Path(str(cfg["results-dir"])) / f"{cfg.get('run-name', 'enrol')}.json"
            marker.write_text(json.dumps({"enrolled": count, "wall": time.time()}))
    else:
        train_run(grid, cfg)


ENROL_BATCH = 6
"""Nodes queried at once when enrolling (see ``enrol_nodes``)."""


def enrol_nodes(grid: Grid, arbiter: str, expected: int, timeout: float = 600.0, batch: int = ENROL_BATCH) -> int:
    """Ask every connected node for its device profile and enrol them with the arbiter; waits
    (at most ``timeout``) until ``expected`` nodes are connected. Returns the number enrolled.

    The queries go ``batch`` nodes at a time. Each query starts a ClientApp process on its node
    (a Python process importing flwr, ~1.7 s of CPU), and Flower gives that process 30 s
    (``HEARTBEAT_DEFAULT_INTERVAL``) to claim its task; one that misses it is started again
    while the first still runs. Querying 30 nodes at once on 2 busy cores missed it, and the
    restarts fed each other (56 ClientApps alive for 30 nodes within a minute, load 47)."""
    from trainmaster.flsched.arbiter import ArbiterClient, NodeProfile

    if batch < 1:
        raise ValueError(f"enrol batch must be at least 1, got {batch}")
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
        time.sleep(1.0)
    profiles = []
    for first in range(0, len(nodes), batch):
        messages = [
            Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in nodes[first : first + batch]
        ]
        for reply in grid.send_and_receive(messages, timeout=max(1.0, deadline - time.monotonic())):
            if reply.has_error():
                log.warning("enrol: node %s did not answer: %s", reply.metadata.src_node_id, reply.error)
                continue
            p = reply.content["profile"]
            profiles.append(
                NodeProfile(
                    node=str(reply.metadata.src_node_id),
                    device=str(p["device"]),
                    a=float(p["a"]),
                    mu=float(p["mu"]),
                    bandwidth=float(p["bandwidth"]),
                )
            )
    client = ArbiterClient(arbiter, "enrol")
    try:
        client.enrol(profiles)
    finally:
        client.close()
    return len(profiles)


def train_run(grid: Grid, cfg: dict) -> None:
    """One FL job: FedAvg rounds until the test accuracy reaches the target (module docstring)."""
    from trainmaster.flsched.arbiter import ArbiterClient, RunSpec

    name, per_round = str(cfg["run-name"]), int(cfg["per-round"])
    data = _dataset(str(cfg["data-dir"]), str(cfg["dataset"]))
    x_test, y_test = data["x_test"], data["y_test"]
    params = npmodel.init_params(int(data["features"]), int(data["classes"]), int(cfg["seed"]))
    out = Path(str(cfg["results-dir"])) / f"{name}.jsonl"
    selector = None
    if cfg["selection"] == "flsched":
        selector = ArbiterClient(str(cfg["arbiter"]), name)
        sizes = data["shard_sizes"]
        selector.register(
            RunSpec(
                tau=float(cfg["tau"]),
                model_bytes=float(cfg["model-bytes"]),
                per_round=per_round,
                data={f"p{k}": int(n) * int(cfg["sample-scale"]) for k, n in enumerate(sizes)},
            )
        )
        strategy: FedAvg = FlschedFedAvg(selector, per_round)
    else:  # Flower's own sampling: a uniform sample of per_round of the connected nodes
        strategy = FedAvg(
            fraction_train=per_round / int(cfg["num-nodes"]),
            fraction_evaluate=0.0,
            min_train_nodes=per_round,
            min_available_nodes=per_round,
        )
    started = time.time()
    try:
        with out.open("a") as sink:
            sink.write(json.dumps({"event": "start", "run": name, "wall": started}) + "\n")
            sink.flush()
            for rnd in range(1, int(cfg["max-rounds"]) + 1):
                arrays = ArrayRecord(params)
                messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({}), grid))
                nodes = [int(m.metadata.dst_node_id) for m in messages]
                sent = time.time()
                replies = list(grid.send_and_receive(messages, timeout=ROUND_TIMEOUT_S)) if messages else []
                done = time.time()
                trained = [int(r.metadata.src_node_id) for r in replies if not r.has_error()]
                # per trained node: seconds from the send until its ClientApp had the message, and
                # the device time it then took (the rest of the round is Flower's overhead)
                timing = [
                    [
                        round(float(r.content["timing"]["began"]) - sent, 3),
                        round(float(r.content["timing"]["emulated-s"]), 3),
                    ]
                    for r in replies
                    if not r.has_error() and "timing" in r.content
                ]
                agg, _ = strategy.aggregate_train(rnd, replies)
                if agg is not None:
                    params = agg.to_numpy_ndarrays()
                acc = npmodel.accuracy(params, x_test, y_test)
                row = {"event": "round", "run": name, "round": rnd, "start": sent, "end": done, "nodes": nodes}
                row.update({"trained": trained, "timing": timing, "accuracy": acc, "wall": time.time()})
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                if not messages:
                    time.sleep(1.0)  # a skipped round: the arbiter had no nodes for it now
                if acc >= float(cfg["target"]):
                    break
            sink.write(json.dumps({"event": "end", "run": name, "wall": time.time(), "accuracy": acc}) + "\n")
    finally:
        if selector is not None:
            selector.finish()
            selector.close()


@client_app.query()
def _profile(msg: Message, context: Context) -> Message:
    """The node's device profile (from its node config), for enrolment."""
    nc = context.node_config
    profile = ConfigRecord(
        {
            "device": str(nc["device-id"]),
            "a": float(nc["a"]),
            "mu": float(nc["mu"]),
            "bandwidth": float(nc["bandwidth"]),
        }
    )
    return Message(RecordDict({"profile": profile}), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    """Train on this node's shard, then take the time a device of this profile would."""
    started, began = time.monotonic(), time.time()
    nc, rc = context.node_config, context.run_config
    part = int(nc["partition-id"])
    data = _dataset(str(nc["data-dir"]), str(rc["dataset"]))
    shard = data[f"shard_{part}"]
    x, y = data["x_train"][shard], data["y_train"][shard]
    rnd = int(msg.content["config"]["server-round"])
    seed = [int(rc["seed"]), part, rnd, zlib.crc32(str(rc["run-name"]).encode())]
    params = msg.content["arrays"].to_numpy_ndarrays()
    new = npmodel.local_update(params, x, y, int(rc["tau"]), seed=zlib.crc32(repr(seed).encode()))
    draw = float(np.random.default_rng(seed).exponential(1.0))
    work = float(rc["tau"]) * len(shard) * int(rc["sample-scale"])
    speedup = float(nc["speedup"])
    compute = work * (float(nc["a"]) + draw / float(nc["mu"])) / speedup
    comm = float(rc["model-bytes"]) / float(nc["bandwidth"]) / speedup
    rest = compute + comm - (time.monotonic() - started)
    if rest > 0:
        time.sleep(rest)
    metrics = MetricRecord({"num-examples": len(shard), "emulated-s": compute + comm})
    # when this ClientApp had the message (Flower's delivery and the process launch come before);
    # a ConfigRecord, which FedAvg leaves alone (it averages every metric)
    timing = ConfigRecord({"began": began, "emulated-s": compute + comm})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics, "timing": timing}), reply_to=msg)
