"""The networked runtime behind the ``federated`` framework: one server, many device processes.

The server (role ``server``) owns the scheduler and FedAvg: it waits for every device to
register, then runs global rounds like ``runtime.run_multijob``, but each chosen device trains
in its own process and sends its update over HTTP (loopback or LAN). Devices (role ``device``)
poll for work, train on their own shard of every job, post the update, and exit when the server
says the jobs are done. A device chosen to drop out (emulated, drawn by the server) is never
given its task, so its update is lost while its time counts, as in ``runtime``.

    python -m trainmaster.flsched.service server --port P --devices N [--scheduler sa] ...
    python -m trainmaster.flsched.service device --server HOST:PORT --index I --devices N
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

JOB_NAMES = (("digits", 2), ("wine", 1), ("breast-cancer", 1))


def _to_wire(state: dict) -> dict:
    return {k: v.tolist() for k, v in state.items()}


def _from_wire(raw: dict) -> dict:
    import torch

    return {k: torch.tensor(v, dtype=torch.float32) for k, v in raw.items()}


class Coordinator:
    """Shared state between the HTTP handler threads and the round loop (guarded by one condition)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.registered: set[int] = set()
        self.tasks: dict[int, dict] = {}
        self.updates: dict[tuple[int, int], tuple[dict, int]] = {}
        self.done = False


def _publish_round(r: int, rounds: int, names: list[str], assignment: Any, accuracy: list[float]) -> None:
    """The round's schedule and accuracies, for the dashboard's federated view and its charts."""
    import trainmaster

    trainmaster.publish(
        "flsched.round",
        {
            "round": r,
            "assignment": {n: [int(d) for d in assignment[row]] for row, n in enumerate(names)},
            "accuracy": dict(zip(names, accuracy)),
        },
    )
    trainmaster.report(
        step=r + 1, total=rounds, **{"accuracy_" + n.replace("-", "_"): a for n, a in zip(names, accuracy)}
    )


def serve(
    host: str,
    port: int,
    devices: int,
    scheduler_name: str,
    per_round: int,
    rounds: int,
    seed: int,
    dropout: float,
    wait_s: float,
    output: str | None,
) -> int:
    from trainmaster.flsched import make_scheduler
    from trainmaster.flsched.model import ProblemError, check_feasible
    from trainmaster.flsched.runtime import _accuracy, _model, fl_problem, load_job
    from trainmaster.flsched.synthetic import make_pool
    import torch

    co = Coordinator()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with co.cond:
                if self.path == "/register":
                    co.registered.add(int(msg["device"]))
                elif self.path == "/update":
                    co.updates[(int(msg["round"]), int(msg["device"]))] = (msg["weights"], int(msg["samples"]))
                    co.tasks.pop(int(msg["device"]), None)
                co.cond.notify_all()
            self._reply({"ok": True})

        def do_GET(self) -> None:
            device = int(self.path.rpartition("=")[2])
            with co.cond:
                if co.done:
                    return self._reply({"state": "done"})
                co.cond.wait_for(lambda: co.done or device in co.tasks, timeout=2.0)
                if co.done:
                    return self._reply({"state": "done"})
                self._reply(co.tasks.get(device, {"state": "wait"}))

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"flsched server on port {port}, waiting for {devices} devices", flush=True)
    with co.cond:
        if not co.cond.wait_for(lambda: len(co.registered) >= devices, timeout=wait_s):
            print(f"error: only {len(co.registered)} of {devices} devices registered in {wait_s}s", file=sys.stderr)
            return 1
    torch.set_num_threads(1)
    jobs = [
        load_job(n, devices, seed, {"digits": 0.85, "wine": 0.92, "breast-cancer": 0.93}[n], tau=t)
        for n, t in JOB_NAMES
    ]
    pool = make_pool(devices, seed)
    base = fl_problem(jobs, pool, per_round, fairness_weight=30.0)
    sched = make_scheduler(scheduler_name, seed=seed)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    states = [{k: v.clone() for k, v in _model(j.x_train.shape[1], j.classes).state_dict().items()} for j in jobs]
    history = np.zeros_like(base.history)
    for r in range(rounds):
        active = [m for m, j in enumerate(jobs) if j.time_to_target is None]
        if not active:
            break
        state = base.subset_jobs(active).with_history(history[active], rng.random(devices) < 0.9)
        try:
            check_feasible(state)
        except ProblemError:
            continue
        assignment = sched.schedule(state)
        sent: dict[int, int] = {}
        with co.cond:
            for row, m in enumerate(active):
                devs = np.asarray(assignment[row], dtype=int)
                x = rng.exponential(1.0, len(devs))
                work = base.tau[m] * base.samples[m, devs]
                delays = work * (base.a[devs] + x / base.mu[devs]) + base.model_bytes[m] / base.bandwidth[devs]
                jobs[m].clock += float(delays.max())
                history[m, devs] += 1
                for k in devs[rng.random(len(devs)) >= dropout]:
                    co.tasks[int(k)] = {"state": "train", "round": r, "job": m, "weights": _to_wire(states[m])}
                    sent[int(k)] = m
            co.cond.notify_all()
            co.cond.wait_for(lambda: all((r, k) in co.updates for k in sent), timeout=wait_s)
            got = {k: co.updates.pop((r, k)) for k in sent if (r, k) in co.updates}
            for k in sent:
                co.tasks.pop(k, None)
        for m in active:
            ups = [(w, n) for k, (w, n) in got.items() if sent[k] == m]
            if ups:  # FedAvg weighted by samples
                total = sum(n for _, n in ups)
                decoded = [(_from_wire(w), n / total) for w, n in ups]
                states[m] = {key: sum(frac * w[key] for w, frac in decoded) for key in states[m]}
            acc = _accuracy(states[m], jobs[m])
            jobs[m].curve.append((jobs[m].clock, acc))
            if acc >= jobs[m].target and jobs[m].time_to_target is None:
                jobs[m].time_to_target = jobs[m].clock
        _publish_round(r, rounds, [jobs[m].name for m in active], assignment, [jobs[m].curve[-1][1] for m in active])
    with co.cond:
        co.done = True
        co.cond.notify_all()
    report = {
        j.name: {
            "rounds": len(j.curve),
            "final_accuracy": j.curve[-1][1] if j.curve else 0.0,
            "target": j.target,
            "time_to_target": j.time_to_target,
        }
        for j in jobs
    }
    for name, rep in report.items():
        ttt = "not reached" if rep["time_to_target"] is None else f"{rep['time_to_target']:.1f}s simulated"
        print(
            f"job {name}: accuracy {rep['final_accuracy']:.3f} after {rep['rounds']} rounds, "
            f"time to target {rep['target']}: {ttt}",
            flush=True,
        )
    if output:
        from pathlib import Path

        Path(output).mkdir(parents=True, exist_ok=True)
        (Path(output) / "flsched-report.json").write_text(json.dumps(report, indent=2))
    time.sleep(3.0)  # let polling devices see "done"
    httpd.shutdown()
    return 0


def device(server: str, index: int, devices: int, seed: int, wait_s: float) -> int:
    from trainmaster.flsched.runtime import _local_update, load_job
    import torch

    torch.set_num_threads(1)
    jobs = [load_job(n, devices, seed, 1.0, tau=t) for n, t in JOB_NAMES]
    url = f"http://{server}"

    def call(path: str, payload: dict | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    deadline = time.monotonic() + wait_s
    while True:
        try:
            call("/register", {"device": index})
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"error: server {server} unreachable for {wait_s}s", file=sys.stderr)
                return 1
            time.sleep(0.5)
    while True:
        try:
            task = call(f"/task?device={index}")
        except OSError:  # server gone: the job is over
            return 0
        if task["state"] == "done":
            return 0
        if task["state"] != "train":
            continue
        job = jobs[task["job"]]
        new = _local_update(
            _from_wire(task["weights"]), job, job.shards[index], seed * 1000 + task["round"] * 31 + index
        )
        call(
            "/update",
            {"device": index, "round": task["round"], "weights": _to_wire(new), "samples": int(len(job.shards[index]))},
        )


def main(argv: list[str] | None = None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["server", "device"])
    ap.add_argument("--host", default=os.environ.get("FLSCHED_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("FLSCHED_PORT", "0") or 0))
    ap.add_argument("--server", default=os.environ.get("FLSCHED_SERVER", ""))
    ap.add_argument("--index", type=int, default=int(os.environ.get("FLSCHED_DEVICE_INDEX", "0")))
    ap.add_argument("--devices", type=int, default=int(os.environ.get("FLSCHED_DEVICES", "0") or 0))
    ap.add_argument("--scheduler", default=os.environ.get("FLSCHED_SCHEDULER", "sa"))
    ap.add_argument("--per-round", type=int, default=int(os.environ.get("FLSCHED_PER_ROUND", "3")))
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("FLSCHED_ROUNDS", "40")))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FLSCHED_SEED", "0")))
    ap.add_argument("--dropout", type=float, default=float(os.environ.get("FLSCHED_DROPOUT", "0.1")))
    ap.add_argument("--wait", type=float, default=120.0, help="seconds to wait for peers/updates")
    ap.add_argument("--output", default=os.environ.get("FLSCHED_OUTPUT"))
    a = ap.parse_args(argv)
    if a.role == "server":
        return serve(a.host, a.port, a.devices, a.scheduler, a.per_round, a.rounds, a.seed, a.dropout, a.wait, a.output)
    return device(a.server, a.index, a.devices, a.seed, a.wait)


if __name__ == "__main__":
    sys.exit(main())
