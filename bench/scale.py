"""Scale benchmark (issue 31): Kueue's scheduler performance test replayed on hollow nodes through
the real server, store and REST API; the reconcile pass at 10,000 active instances; and real
processes (10,000 one-process jobs, the drain of 1,000 ``true`` jobs).

    .venv/bin/python bench/scale.py [--runs 3] [--quick] [--db postgresql://...] [--only kueue,pass,real]
    .venv/bin/python bench/scale.py --only drain --runs 3   # the drain of 1,000 alone: results/scale-drain.md

Writes ``bench/results/scale.json``, ``scale.md`` and ``scale.png``. Every figure is the median
over ``--runs`` runs; the machine's load (``uptime``) is recorded before and after each section.

**The replay** (Kueue's ``test/performance/scheduler`` baseline, as our notes describe it): 5
cohorts × 6 queues; per queue 350 small (1 CPU, 200 ms, priority low, one every 100 ms), 100
medium (5 CPU, 500 ms, normal, every 500 ms) and 50 large (20 CPU, 1 s, high, every 1.2 s)
workloads, 15,000 in all, each a one-instance job submitted over REST at its arrival time by
a pool of clients. The server runs the hollow backend (``--backend hollow``): 30 nodes of 20
CPUs, Kueue's 600 nominal CPUs; each instance's run time is its job's annotation. **Total
time** runs from the first submit to the last job's end (Kueue: 351 s, the 2024 calibration
mean). The 30 queues are created first as queues with quota, as Kueue's ClusterQueues: 20 nominal
CPUs each, in cohorts of six, each borrowing up to 100 CPUs of its cohort. **Quota use** is the
time integral of the CPU of admitted, not ended instances (stored start to stored end), each
cohort's counted up to its 120 CPUs, over the 600 nominal CPUs × (first start to last end),
Kueue's "CQ usage" (a preempted instance's stored end comes after its successor's start: the
overlap beyond a cohort's CPUs is reported apart, as ``stored_overlap``); the quota book the server
shows (``GET /api/v1/queues``) is sampled each second for the most CPU used and borrowed. While
the replay runs a prober in a process of its own reads one page of the list (a queue filter) and
one job's status, alternately, and samples the server's RSS; each latency is reported as the
client saw it and as the server says it spent it (its ``Server-Timing`` header), and the
server's per-route histogram (``/metrics``) gives the p99 of every GET of the two routes, and
its garbage collection histogram the API process's full collections (no request is read while
one runs). **Reconcile pass** durations come from the server's own histogram (``/metrics``).

**The pass at 10,000 active instances**: a controller in this process with hollow nodes and
jobs that run for hours; the duration of passes with nothing changed and of passes where 1 %
of the jobs were cancelled.

**Real processes**: ``true`` jobs of one instance on the local node agent, 32 at once, submitted
through the controller's API and drained by its reconcile loop (as ``bench/controller.py``'s
drain): 10,000 of them end to end (Volcano's write-up: 10,000 one-pod jobs in 180 s on 8
cores), and 1,000 for the drain rate.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import multiprocessing
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KUEUE_WALL_S = 351.1  # the 2024 calibration mean (5 runs)
KUEUE_USAGE = 0.587
COHORTS, QUEUES = 5, 6
CLASSES = {  # name: (per queue, cpu, run seconds, priority class, interval seconds)
    "small": (350, 1, 0.2, "low", 0.1),
    "medium": (100, 5, 0.5, "normal", 0.5),
    "large": (50, 20, 1.0, "high", 1.2),
}
NOMINAL_CPU, BORROWING_CPU = 20, 100  # per queue, as Kueue's baseline ClusterQueues
NODES = "30x20"  # 600 CPUs, one node per queue's nominal quota
CLIENTS = 16  # concurrent REST submitters
RUN_SECONDS = "hollow.trainmaster.dev/run-seconds"
REQUEST_HISTOGRAM = "trainmaster_http_request_duration_seconds"  # the server's time per route, in /metrics
SAMPLE = re.compile(r"^(?P<name>\w+?)_(?P<part>bucket|count|sum)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
PROBE_EVERY = 0.25  # seconds between two rounds of the prober (a list, then a status)


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the replay ------------------------------------------------------------------------------
def workloads(fraction: float) -> list[tuple[float, dict[str, Any], str]]:
    """(arrival seconds, job document, class) for every workload, in arrival order."""
    found = []
    for cohort in range(COHORTS):
        for queue in range(QUEUES):
            cq = f"cq-{cohort}-{queue}"
            for cls, (count, cpu, run, priority, every) in CLASSES.items():
                for i in range(1, max(1, round(count * fraction)) + 1):
                    doc = {
                        "apiVersion": "trainmaster/v1",
                        "kind": "Job",
                        "metadata": {
                            "name": f"{cls}-{cq}-{i}",
                            "labels": {"kueue.x-k8s.io/queue-name": cq, "class": cls},
                            "annotations": {RUN_SECONDS: str(run)},
                        },
                        "spec": {
                            "scheduling": {"queue": cq, "priorityClass": priority},
                            "roles": [{"name": "main", "command": ["true"], "resources": {"cpu": cpu}}],
                        },
                    }
                    found.append((i * every, doc, cls))
    return sorted(found, key=lambda w: w[0])


def create_queues(url: str) -> None:
    """Kueue's ClusterQueues as our queues with quota: per queue 20 nominal CPUs, borrowing up to
    100 more from the other five of its cohort (no lending limit), weight 1."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for cohort in range(COHORTS):
            for queue in range(QUEUES):
                body = {
                    "name": f"cq-{cohort}-{queue}",
                    "cohort": f"cohort-{cohort}",
                    "quota": {"cpu": {"nominal": NOMINAL_CPU, "borrowingLimit": BORROWING_CPU}},
                }
                client.post("/api/v1/queues", json=body).raise_for_status()


class Server:
    """``trainmaster server --backend hollow`` over a fresh home and store."""

    def __init__(self, workdir: Path, db: str | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = db or f"sqlite:///{workdir / 'store.db'}"
        env = {
            **os.environ,
            "TRAINMASTER_HOME": str(workdir / "home"),
            "TRAINMASTER_DB": self.db,
            "TRAINMASTER_HOLLOW_NODES": NODES,
        }
        self.log = open(workdir / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainmaster", "server", "--backend", "hollow", "--port", str(self.port)]
            + ["--interval", "0.5", "--max-jobs", "1000000"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {self.log.name}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def replay(fraction: float, db: str | None, scratch: Path) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(dir=scratch))
    server = Server(workdir, db)
    create_queues(server.url)
    todo = workloads(fraction)
    total = len(todo)
    submit_ms: list[float] = []
    newest = multiprocessing.get_context("spawn").Value("q", 0, lock=False)  # the prober picks a status under it
    quota_samples: list[tuple[float, float, float]] = []  # (CPU used in all queues, borrowed, one queue's most)
    lock = threading.Lock()
    heap = list(enumerate(todo))
    heapq.heapify(heap)  # (index, (arrival, ...)): indexes are already in arrival order
    try:
        probe = Prober(server.url, server.proc.pid, newest)  # started and ready before the clock
    except BaseException:
        server.stop()
        raise
    start = time.perf_counter()

    def submitter() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            while True:
                with lock:
                    if not heap:
                        return
                    _, (arrival, doc, _cls) = heapq.heappop(heap)
                wait = start + arrival - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                began = time.perf_counter()
                reply = client.post("/api/v1/jobs", json=doc)
                reply.raise_for_status()
                job_id = int(reply.json()["id"])
                with lock:
                    submit_ms.append((time.perf_counter() - began) * 1000)
                    newest.value = max(newest.value, job_id)

    threads = [threading.Thread(target=submitter) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        ended = 0
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while ended < total:
                time.sleep(1.0)
                ended = sum(_count(client, state) for state in ("succeeded", "failed", "cancelled"))
                views = client.get("/api/v1/queues").json()  # the quota book as the server shows it
                used = sum(v["usage"]["cpu"]["used"] for v in views)
                borrowed = sum(v["usage"]["cpu"]["borrowed"] for v in views)
                quota_samples.append((used, borrowed, max(v["usage"]["cpu"]["used"] for v in views)))
                if time.perf_counter() - start > 3600:
                    raise TimeoutError(f"{ended} of {total} jobs ended after an hour")
            failed = _count(client, "failed") + _count(client, "cancelled")
            metrics = client.get("/metrics").text
        wall = time.perf_counter() - start
    finally:
        probed = probe.stop()
        for t in threads:
            t.join(120)
        server.stop()
    admission = _admission(server.db)
    idle = _idle_quota(server.db)
    passes = _histogram(metrics, "trainmaster_reconcile_seconds")
    served = {
        kind: _histogram(metrics, REQUEST_HISTOGRAM, f'method="GET",route="{route}"')
        for kind, route in (("list", "/api/v1/jobs"), ("status", "/api/v1/jobs/{ref}"))
    }
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "workloads": total,
        "failed_or_cancelled": failed,
        "wall_s": wall,
        "capacity_use": idle.pop("use"),
        "queues_with_quota": len(views),
        "quota_used_cpu_max": max((u for u, _, _ in quota_samples), default=0.0),
        "quota_borrowed_cpu_max": max((b for _, b, _ in quota_samples), default=0.0),
        "one_queue_used_cpu_max": max((q for _, _, q in quota_samples), default=0.0),
        "admission_s_by_class": admission,
        "idle_quota": idle,
        "submit_ms": _quantiles(submit_ms),
        "list_ms": _quantiles(probed["list"]),
        "status_ms": _quantiles(probed["status"]),
        # the server's own time for the same requests (their Server-Timing header): client minus
        # server is the socket, the server's event loop queue and the prober itself
        "list_server_ms": _quantiles(probed["list_server"]),
        "status_server_ms": _quantiles(probed["status_server"]),
        # every GET of the route during the replay (the bench's counting lists too), from /metrics
        # what the client waited after the headers came (the body), and how late the prober woke
        # from its pause between rounds (its own scheduling on a busy machine: part of any figure it takes)
        "list_body_ms": _quantiles(probed["list_body"]),
        "status_body_ms": _quantiles(probed["status_body"]),
        "prober_wake_late_ms": _quantiles(probed["late"]),
        "list_route_histogram": served["list"],
        "status_route_histogram": served["status"],
        "server_rss_max_mb": max(probed["rss"], default=0) / 2**20,
        # the API process's full garbage collections (no request is read while one runs): what it
        # keeps per job or per request makes them longer as the replay goes on
        "api_full_gc": _histogram(metrics, "trainmaster_gc_pause_seconds", 'generation="2"'),
        "reconcile_pass": passes,
    }


class Prober:
    """The latency prober in a process of its own, so that its requests never wait for the 16
    submitter threads' interpreter lock (in the bench's process they did, and that wait was
    counted as the server's latency). Each round it reads one page of the list (a queue filter,
    100 jobs) and one job's status (a job submitted so far, at random), with the time the client
    saw and the time the server says it took (``Server-Timing``), and samples the server's RSS."""

    def __init__(self, url: str, server_pid: int, newest: Any):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter, not a fork of 16 threads
        self.stop_event, ready, self.results = context.Event(), context.Event(), context.Queue()
        self.process = context.Process(
            target=probe, args=(url, server_pid, newest, ready, self.stop_event, self.results), daemon=True
        )
        self.process.start()
        if not ready.wait(60):
            self.process.kill()
            raise RuntimeError("the latency prober did not start within 60 s")

    def stop(self) -> dict[str, list[float]]:
        self.stop_event.set()
        try:
            found: dict[str, list[float]] = self.results.get(timeout=120)
        except Exception as error:  # queue.Empty: it died; its traceback is on stderr
            raise RuntimeError(
                f"the latency prober ended without its figures (exit {self.process.exitcode})"
            ) from error
        self.process.join(30)
        return found


def probe(url: str, server_pid: int, newest: Any, ready: Any, stop: Any, results: Any) -> None:
    """The prober's process (:class:`Prober`)."""
    rng = random.Random(7)
    kinds = ("list", "status", "list_server", "status_server", "list_body", "status_body", "late", "rss")
    found: dict[str, list[float]] = {k: [] for k in kinds}
    server = psutil.Process(server_pid)
    with httpx.Client(base_url=url, timeout=60) as client:
        ready.set()
        while not stop.is_set():
            queue = f"cq-{rng.randrange(COHORTS)}-{rng.randrange(QUEUES)}"
            asks = [("list", "/api/v1/jobs", {"queue": queue, "limit": 100})]
            if newest.value:
                asks.append(("status", f"/api/v1/jobs/{rng.randint(1, newest.value)}", {}))
            for kind, path, params in asks:
                began = time.perf_counter()
                with client.stream("GET", path, params=params) as reply:
                    headed = time.perf_counter()
                    reply.read()
                ended = time.perf_counter()
                found[kind].append((ended - began) * 1000)
                reply.raise_for_status()
                found[f"{kind}_server"].append(float(reply.headers["server-timing"].split("dur=")[1]))
                found[f"{kind}_body"].append((ended - headed) * 1000)
            try:  # the server's processes together: the API's and the controller's
                found["rss"].append(sum(p.memory_info().rss for p in (server, *server.children(recursive=True))))
            except psutil.Error:
                pass
            asleep = time.perf_counter()
            stop.wait(PROBE_EVERY)
            found["late"].append((time.perf_counter() - asleep - PROBE_EVERY) * 1000)  # this process's own wake-up
    results.put(found)


def _count(client: httpx.Client, state: str) -> int:
    page = client.get("/api/v1/jobs", params={"state": state, "limit": 1}).json()
    return len(page["items"]) + int(page["metadata"]["remainingItemCount"])


def _admission(db: str) -> dict[str, float]:
    """The mean seconds from submit to admission per class."""
    from sqlalchemy import select

    from trainmaster.store.db import make_engine, session_factory
    from trainmaster.store.models import JobRow

    with session_factory(make_engine(db))() as session:
        jobs = session.execute(select(JobRow.name, JobRow.created_at, JobRow.started_at)).all()
    waits: dict[str, list[float]] = {}
    for name, created, started in jobs:
        if created and started:
            waits.setdefault(name.split("-")[0], []).append((started - created).total_seconds())
    return {cls: statistics.fmean(v) for cls, v in waits.items()}


def _idle_quota(db: str) -> dict[str, float]:
    """Where the quota not in use went (same spans and window as the quota use): the share of
    600 CPUs × the window that was free in a cohort (120 CPUs each) while a job of that cohort
    waited (admitted too late: the admission latency), and while none waited (nothing to admit:
    arrivals, the tail); and how many admitted jobs were preempted (evicted and queued again)."""
    import numpy as np
    from sqlalchemy import func, select

    from trainmaster.store.db import make_engine, session_factory
    from trainmaster.store.models import EventRow, InstanceRow, JobRow

    step = 0.01
    with session_factory(make_engine(db))() as session:
        spans = session.execute(
            select(JobRow.queue, InstanceRow.cpu, InstanceRow.started_at, InstanceRow.ended_at).join(JobRow)
        ).all()
        waits = session.execute(select(JobRow.queue, JobRow.created_at, JobRow.started_at)).all()
        preempted = session.scalar(select(func.count()).select_from(EventRow).where(EventRow.reason == "Preempted"))
    runs = [(q, float(c), s.timestamp(), e.timestamp()) for q, c, s, e in spans if s and e]
    first, last = min(r[2] for r in runs), max(r[3] for r in runs)
    cells = int((last - first) / step) + 1
    used = {f"cohort-{c}": np.zeros(cells) for c in range(COHORTS)}
    waiting = {f"cohort-{c}": np.zeros(cells, dtype=bool) for c in range(COHORTS)}

    def cohort(queue: str) -> str:
        return f"cohort-{queue.split('-')[1]}"

    def cell(t: float) -> int:
        return min(cells, max(0, int((t - first) / step)))

    for queue, cpu, began, ended in runs:
        used[cohort(queue)][cell(began) : cell(ended)] += cpu
    for queue, created, started in waits:  # from submit to its (last) admission
        if created is not None and started is not None:
            waiting[cohort(queue)][cell(created.timestamp()) : cell(started.timestamp())] = True
    whole = 600.0 * cells
    cap = QUEUES * NOMINAL_CPU
    free = {c: np.clip(cap - used[c], 0, None) for c in used}
    return {
        # quota use: each cohort's CPUs in use, at most its 120, over 600 CPUs x the window. A
        # preempted instance's stored end is when its exit was recorded, after its successor
        # started in the pass that evicted it, so stored spans may overlap beyond a cohort's
        # CPUs; that overlap is reported beside it, never counted as use
        "use": float(sum(np.minimum(used[c], cap).sum() for c in used) / whole),
        "stored_overlap": float(sum(np.clip(used[c] - cap, 0, None).sum() for c in used) / whole),
        "free_while_jobs_waited": float(sum((free[c] * waiting[c]).sum() for c in free) / whole),
        "free_with_none_waiting": float(sum((free[c] * ~waiting[c]).sum() for c in free) / whole),
        "preempted": int(preempted or 0),
    }


def _histogram(text: str, name: str, labels: str = "") -> dict[str, Any]:
    """Count, mean and the 99th percentile of a Prometheus histogram's series with ``labels``
    (``a="x",b="y"``; none: the unlabelled series): the bound of the bucket that holds it, and
    the value Prometheus' ``histogram_quantile`` interpolates in that bucket."""
    wanted = dict(LABEL.findall(labels))
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or match["name"] != name:
            continue
        found = dict(LABEL.findall(match["labels"] or ""))
        bound = found.pop("le", None)
        if found != wanted:
            continue
        value = float(match["value"])
        if match["part"] == "bucket" and bound is not None:
            buckets.append((float("inf") if bound == "+Inf" else float(bound), value))
        elif match["part"] == "count":
            count = value
        elif match["part"] == "sum":
            total = value
    buckets.sort()
    p99 = interpolated = None
    below, lower = 0.0, 0.0
    for bound, cumulative in buckets:
        if count and cumulative >= 0.99 * count:
            p99 = bound
            share = (0.99 * count - below) / (cumulative - below) if cumulative > below else 1.0
            interpolated = lower + (bound - lower) * share if bound != float("inf") else lower
            break
        below, lower = cumulative, bound
    return {
        "passes" if name == "trainmaster_reconcile_seconds" else "count": int(count),
        "mean_ms": 1000 * total / count if count else None,
        "p99_le_ms": p99 and 1000 * p99,
        "p99_ms": interpolated and 1000 * interpolated,
    }


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


# ---- the reconcile pass at N active instances -------------------------------------------------
def pass_cost(active: int, replicas: int, passes: int, scratch: Path) -> dict[str, Any]:
    from trainmaster.backends.hollow import HollowBackend, HollowCluster
    from trainmaster.controller import Controller
    from trainmaster.loading import load_document
    from trainmaster.store.db import make_engine, session_factory

    workdir = Path(tempfile.mkdtemp(dir=scratch))
    url = f"sqlite:///{workdir / 'store.db'}"
    sessions = session_factory(make_engine(url))
    backend = HollowBackend(HollowCluster.parse(f"{active // 100 + 1}x100"), state_dir=workdir / "hollow")
    controller = Controller(sessions, backend, url, runs_dir=workdir / "runs")
    jobs = active // replicas
    ids = []
    for n in range(jobs):
        doc = {
            "apiVersion": "trainmaster/v1",
            "kind": "Job",
            "metadata": {"name": f"long-{n}", "annotations": {RUN_SECONDS: "86400"}},
            "spec": {"roles": [{"name": "w", "replicas": replicas, "command": ["true"], "resources": {"cpu": 1}}]},
        }
        ids.append(controller.submit(load_document(doc)))
    began = time.perf_counter()
    controller.step()  # admits and starts every job
    first = time.perf_counter() - began
    for _ in range(3):
        controller.step()  # each job's events of the first pass are looked at once
    quiet, quiet_cpu = [], []
    for _ in range(passes):
        began, cpu = time.perf_counter(), time.process_time()
        controller.step()
        quiet.append((time.perf_counter() - began) * 1000)
        quiet_cpu.append((time.process_time() - cpu) * 1000)
    full = []
    for _ in range(3):  # the pass that looks at every job (the first, then one every FULL_PASS_EVERY s)
        controller._full_pass_at = 0.0
        began = time.perf_counter()
        controller.step()
        full.append((time.perf_counter() - began) * 1000)
    rng = random.Random(3)
    churn = []
    for _ in range(max(3, passes // 4)):
        doomed = rng.sample(ids, max(1, jobs // 100))
        for job_id in doomed:
            controller.cancel(job_id)
        ids = sorted(set(ids) - set(doomed))
        began = time.perf_counter()
        controller.step()
        churn.append((time.perf_counter() - began) * 1000)
    backend.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "active_instances": jobs * replicas,
        "jobs": jobs,
        "replicas": replicas,
        "first_pass_s": first,
        "quiet_pass_ms": _quantiles(quiet),
        "quiet_pass_cpu_ms": _quantiles(quiet_cpu),
        "full_pass_ms": _quantiles(full),
        "pass_with_1pct_cancelled_ms": _quantiles(churn),
    }


# ---- real processes ---------------------------------------------------------------------------
def real_jobs(count: int, slots: int, scratch: Path) -> dict[str, Any]:
    from controller_timing import Ours

    from sqlalchemy import select

    from trainmaster.backends.base import Resources
    from trainmaster.backends.local import LocalBackend
    from trainmaster.store import repository as repo
    from trainmaster.store.models import JobRow

    workdir = Path(tempfile.mkdtemp(dir=scratch))
    # a node agent of its own (not the default home's, which another run or a user may hold)
    backend = LocalBackend(Resources(cpu=float(slots), memory=0), state_dir=workdir / "agent")
    ours = Ours(backend, workdir)
    # the bench's own check after each pass: whether any job is left (one indexed row), not the
    # list of every active job's id (10,000 ids sorted, pass after pass, charged to the drain)
    left = select(JobRow.id).where(JobRow.state.in_(repo.ACTIVE_STATES), JobRow.owner == ours.controller.owner)
    start = time.perf_counter()
    for n in range(count):
        ours.submit(f"t{n}", [{"name": "task", "command": ["true"], "resources": {"cpu": 1}}])
    queued = time.perf_counter()
    with ours.sessions() as session:
        cpu = time.thread_time()  # the passes' own CPU (and the check after each): not stretched by load
        ours.until(lambda: session.scalar(left.limit(1)) is None, "drain", timeout=3600)
        end = time.perf_counter()
        cpu = time.thread_time() - cpu
        states = dict(repo.state_counts(session))
    backend.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "jobs": count,
        "submit_s": queued - start,
        "drain_s": end - queued,
        "total_s": end - start,
        "drain_jobs_per_s": count / (end - queued),
        "drain_controller_cpu_ms_per_job": 1000 * cpu / count,
        "states": states,
    }


# ---- report -----------------------------------------------------------------------------------
def median_of(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)):
            values.append(float(value))
    return statistics.median(values) if values else None


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Scale benchmark (`bench/scale.py`)",
        "",
        f"Command: `{results['meta']['command']}`; {results['meta']['runs']} run(s) per section, medians.",
        f"Load (1, 5, 15 min) before/after each section: {json.dumps(results['meta']['load'])}",
        "",
        "| Must show | Measured (median) | Goal | Anchor |",
        "|---|---|---|---|",
    ]
    k = results.get("kueue")
    if k:
        wall = k["median"]["wall_s"]
        lines += [
            f"| Kueue replay, {k['runs'][0]['workloads']} workloads: total time | {wall:.1f} s "
            f"({wall / KUEUE_WALL_S:.2f}× Kueue) | ≤ 0.5× ({KUEUE_WALL_S / 2:.0f} s) | Kueue {KUEUE_WALL_S:.0f} s |",
            f"| quota use (30 queues × 20 nominal CPUs in 5 cohorts, borrowing ≤ 100; "
            f"most borrowed at once {k['runs'][0]['quota_borrowed_cpu_max']:.0f} CPUs) | "
            f"{100 * k['median']['capacity_use']:.1f} % | "
            f"≥ 80 % quota use | Kueue {100 * KUEUE_USAGE:.1f} % |",
            f"| list p99 / status p99 during the replay, as a client sees them (a prober in its own process) | "
            f"{k['median']['list_p99']:.0f} / {k['median']['status_p99']:.0f} ms | ≤ 100 ms | "
            "list at 2,000 jobs before: p99 459 ms |",
            f"| the same requests, the server's own time (`Server-Timing`): p99 | "
            f"{_ms(k['median'].get('list_server_p99'))} / {_ms(k['median'].get('status_server_p99'))} ms | | |",
            f"| every GET of the routes during the replay (`/metrics` histogram, interpolated): p99 | "
            f"{_ms(k['median'].get('list_route_p99'))} / {_ms(k['median'].get('status_route_p99'))} ms | | |",
            f"| server RSS (max) | {k['median']['rss_mb']:.0f} MB | ≤ 1 GB | minimalkueue 435 MiB |",
            f"| full garbage collections of the API process (no request is read during one): count / p99 bucket | "
            f"{_ms(k['median'].get('full_gc_count'))} / ≤ {_ms(k['median'].get('full_gc_p99_ms'))} ms | | |",
            f"| reconcile pass during the replay: mean / p99 bucket | {k['median']['pass_mean_ms']:.1f} / "
            f"≤ {k['median']['pass_p99_ms']:.0f} ms | | |",
        ]
    p = results.get("pass")
    if p:
        lines += [
            f"| reconcile pass, {p['runs'][0]['active_instances']} active instances "
            f"({p['runs'][0]['jobs']} jobs × {p['runs'][0]['replicas']}): p50 / p99, nothing changed | "
            f"{p['median']['quiet_p50']:.1f} / {p['median']['quiet_p99']:.1f} ms "
            f"(CPU p99 {p['median']['quiet_cpu_p99']:.1f} ms) | p99 ≤ 50 ms | |",
            f"| the pass that looks at every job (first, then every 30 s): p50 | {p['median']['full_p50']:.0f} ms | | |",
            f"| the same, 1 % of jobs cancelled per pass: p50 / p99 | {p['median']['churn_p50']:.1f} / "
            f"{p['median']['churn_p99']:.1f} ms | | |",
        ]
    r = results.get("real")
    if r:
        lines += [
            f"| {r['runs'][0]['many']['jobs']} one-process jobs (real processes), submit + drain | "
            f"{r['median']['many_total_s']:.1f} s | ≤ 60 s | Volcano 180 s on 8 cores |",
            f"| drain of {r['runs'][0]['drain']['jobs']} `true` jobs | {r['median']['drain_rate']:.0f} jobs/s | "
            "≥ 300 jobs/s | 170-226 before |",
        ]
    d = results.get("drain")
    if d:
        rates = ", ".join(f"{run['drain']['drain_jobs_per_s']:.0f}" for run in d["runs"])
        lines += [
            f"| drain of {d['runs'][0]['drain']['jobs']} `true` jobs (runs: {rates}) | "
            f"{d['median']['drain_rate']:.0f} jobs/s | ≥ 300 jobs/s | 170-226 before |",
            f"| the controller's own CPU (thread time of its passes) per drained job | "
            f"{_ms(d['median']['drain_cpu'], '.2f')} ms | | |",
        ]
    if k:
        lines += [
            "",
            "Mean seconds from submit to admission per class (Kueue 2024: large 6.7, medium 76.8, small 215.5):",
        ]
        for cls in CLASSES:
            value = median_of(k["runs"], "admission_s_by_class", cls)
            lines.append(f"- {cls}: {value:.2f} s" if value is not None else f"- {cls}: not measured")
        idle = k["runs"][0].get("idle_quota")
        if idle:
            lines += [
                "",
                f"Quota not in use (first run), as a share of 600 CPUs × the window: free in a cohort while a job "
                f"of it waited {100 * idle['free_while_jobs_waited']:.1f} %, while none waited "
                f"{100 * idle['free_with_none_waiting']:.1f} %; admitted jobs preempted: {idle['preempted']}.",
            ]
    lines += ["", f"Raw runs: `bench/results/{'scale-drain' if 'drain' in results else 'scale'}.json`.", ""]
    return "\n".join(lines)


def drain_median(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The drain's medians over runs that each hold a ``drain`` (the real section's and the
    drain-only section's alike)."""
    return {
        "drain_rate": median_of(runs, "drain", "drain_jobs_per_s"),
        "drain_cpu": median_of(runs, "drain", "drain_controller_cpu_ms_per_job"),
    }


def _ms(value: float | None, form: str = ".0f") -> str:
    return "not measured" if value is None else f"{value:{form}}"


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib (the bench extra) is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    k = results.get("kueue")
    if k:
        axes[0].bar(["Kueue", "ours"], [KUEUE_WALL_S, k["median"]["wall_s"]], color=["#94a3b8", "#2563eb"])
        axes[0].axhline(KUEUE_WALL_S / 2, color="#dc2626", linestyle="--", label="goal: 0.5× Kueue")
        axes[0].set_ylabel("seconds, 15,000 workloads" if k["runs"][0]["workloads"] == 15000 else "seconds")
        axes[0].set_title("Kueue's scheduler test replayed")
        axes[0].legend()
    p = results.get("pass")
    if p:
        axes[1].bar(
            ["quiet p50", "quiet p99", "1% churn p50", "1% churn p99"],
            [p["median"][k] for k in ("quiet_p50", "quiet_p99", "churn_p50", "churn_p99")],
            color="#2563eb",
        )
        axes[1].axhline(50, color="#dc2626", linestyle="--", label="goal: p99 ≤ 50 ms")
        axes[1].set_ylabel("ms per reconcile pass")
        axes[1].set_title(f"{p['runs'][0]['active_instances']} active instances")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tenth of every size (a smoke run)")
    parser.add_argument("--db", help="the replay's store (default: a fresh SQLite file); e.g. a PostgreSQL URL")
    parser.add_argument(
        "--only",
        default="kueue,pass,real",
        help="sections: kueue, pass, real; or drain (the drain of 1,000 `true` jobs alone, which real includes)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    fraction = 0.1 if args.quick else 1.0
    scratch = Path(tempfile.mkdtemp(prefix="tm-scale-"))
    results: dict[str, Any] = {
        "meta": {"command": "python bench/scale.py " + " ".join(sys.argv[1:]), "runs": args.runs, "load": {}}
    }
    load = results["meta"]["load"]
    try:
        if "kueue" in sections:
            load["kueue_before"] = uptime()
            runs = [replay(fraction, args.db, scratch) for _ in range(args.runs)]
            load["kueue_after"] = uptime()
            results["kueue"] = {
                "runs": runs,
                "median": {
                    "wall_s": median_of(runs, "wall_s"),
                    "capacity_use": median_of(runs, "capacity_use"),
                    "list_p99": median_of(runs, "list_ms", "p99"),
                    "status_p99": median_of(runs, "status_ms", "p99"),
                    "list_server_p99": median_of(runs, "list_server_ms", "p99"),
                    "status_server_p99": median_of(runs, "status_server_ms", "p99"),
                    "list_route_p99": median_of(runs, "list_route_histogram", "p99_ms"),
                    "status_route_p99": median_of(runs, "status_route_histogram", "p99_ms"),
                    "rss_mb": median_of(runs, "server_rss_max_mb"),
                    "full_gc_count": median_of(runs, "api_full_gc", "count"),
                    "full_gc_p99_ms": median_of(runs, "api_full_gc", "p99_le_ms"),
                    "pass_mean_ms": median_of(runs, "reconcile_pass", "mean_ms"),
                    "pass_p99_ms": median_of(runs, "reconcile_pass", "p99_le_ms"),
                },
            }
        if "pass" in sections:
            load["pass_before"] = uptime()
            active = 1000 if args.quick else 10_000
            runs = [pass_cost(active, 10, 20, scratch) for _ in range(args.runs)]
            load["pass_after"] = uptime()
            results["pass"] = {
                "runs": runs,
                "median": {
                    "quiet_p50": median_of(runs, "quiet_pass_ms", "p50"),
                    "quiet_p99": median_of(runs, "quiet_pass_ms", "p99"),
                    "quiet_cpu_p99": median_of(runs, "quiet_pass_cpu_ms", "p99"),
                    "full_p50": median_of(runs, "full_pass_ms", "p50"),
                    "churn_p50": median_of(runs, "pass_with_1pct_cancelled_ms", "p50"),
                    "churn_p99": median_of(runs, "pass_with_1pct_cancelled_ms", "p99"),
                },
            }
        if "real" in sections:
            load["real_before"] = uptime()
            many = 1000 if args.quick else 10_000
            runs = [
                {"many": real_jobs(many, 32, scratch), "drain": real_jobs(1000, 32, scratch)} for _ in range(args.runs)
            ]
            load["real_after"] = uptime()
            results["real"] = {
                "runs": runs,
                "median": {"many_total_s": median_of(runs, "many", "total_s"), **drain_median(runs)},
            }
        elif "drain" in sections:
            load["drain_before"] = uptime()
            runs = [{"drain": real_jobs(1000, 32, scratch)} for _ in range(args.runs)]
            load["drain_after"] = uptime()
            results["drain"] = {
                "runs": runs,
                "median": drain_median(runs),
            }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # the drain alone has files of its own: the whole benchmark's results stay as they were
    name = "scale-drain" if "drain" in results else "scale"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(results))
    if "drain" not in results:
        plot(results, args.out / "scale.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
