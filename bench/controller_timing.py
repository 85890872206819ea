"""What both controller benchmarks (``controller.py``, ``controller_containers.py``) drive and
time with: our controller over a fresh store, driven one reconcile pass at a time as
``trainmaster server``'s loop drives it, and the moments every replica runs."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainmaster.backends.base import Backend  # noqa: E402
from trainmaster.controller import Controller  # noqa: E402
from trainmaster.loading import load_document  # noqa: E402
from trainmaster.store import repository as repo  # noqa: E402
from trainmaster.store.db import make_engine, session_factory  # noqa: E402

INTERVAL = 0.05  # seconds between reconcile passes (ours) and status polls (everyone)
TIMEOUT = 180.0


def count(markers: Path) -> int:
    return sum(1 for _ in markers.iterdir())


def newest_marker(markers: Path) -> float:
    """The wall-clock time the last replica's command wrote its marker (the *processes* moment,
    precisely: not the moment our polling loop happened to look)."""
    return max(p.stat().st_mtime for p in markers.iterdir())


@dataclass(frozen=True)
class Moments:
    """One run's moments, seconds after the submit (see the module docstring)."""

    reported: float
    polled: float  # every marker seen by the polling loop
    processes: float  # every marker's own time: the precise moment

    @classmethod
    def of(cls, moments: dict[str, float], markers: Path, wall_start: float) -> Moments:
        return cls(moments["reported"], moments["processes"], newest_marker(markers) - wall_start)


class Ours:
    """A controller over a fresh store in ``workdir``, driven one reconcile pass at a time."""

    def __init__(self, backend: Backend, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.url = f"sqlite:///{workdir / 'store.db'}"
        self.sessions = session_factory(make_engine(self.url))
        self.controller = Controller(
            self.sessions, backend, self.url, interval=INTERVAL, grace=2.0, runs_dir=workdir / "runs"
        )
        backend.watch_exits(self.controller.wake)  # as the server's reconcile loop does

    def submit(self, name: str, roles: list[dict[str, Any]]) -> int:
        doc = {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"roles": roles}}
        return self.controller.submit(load_document(doc))

    def state(self, job_id: int) -> str:
        with self.sessions() as session:
            return repo.load_job(session, job_id).state

    def running(self, job_id: int) -> int:
        """How many of the job's instances are in state running in the store (the job's own state
        says running as soon as one is, as Kubeflow's and Volcano's do, so it is not the measure)."""
        with self.sessions() as session:
            return sum(i.state == "running" for i in repo.load_job(session, job_id).instances)

    def until(self, done: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
        """Reconcile passes until ``done``: a pass first, as the server's loop runs one as soon as
        a submit wakes it (a check before it would charge the benchmark's own store query to us)."""
        deadline = time.monotonic() + timeout
        while True:
            self.controller.step()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            self.controller.wait_for_work(INTERVAL)

    def finish(self, job_id: int) -> None:
        self.controller.cancel(job_id)
        self.until(lambda: self.state(job_id) in ("cancelled", "succeeded", "failed"), "cancel")


def until_running(ours: Ours, job_id: int, replicas: int, markers: Path, start: float) -> dict[str, float]:
    """Seconds from ``start`` (just before the submit) until every instance of the job is running
    in our store (*reported*) and every replica's marker file exists (*processes*)."""
    moments: dict[str, float] = {}

    def done() -> bool:
        now = time.perf_counter()
        if "reported" not in moments and ours.running(job_id) == replicas:
            moments["reported"] = now - start
        if "processes" not in moments and count(markers) >= replicas:
            moments["processes"] = now - start
        return len(moments) == 2

    ours.until(done, f"{replicas} replicas running")
    return moments


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples_s": [round(s, 4) for s in samples],
    }
