"""A storm of small tasks from several initiators over several parties while the gateway and some
parties are killed -9 and restarted, then the count: every leg's rule runs (counted by the
executors' own commit lines), every task's end (results or a clear error), and nothing lost.

Used by ``bench/gateway_storm.py`` (10,000 tasks, 4 initiators, 8 parties, the gateway killed 10
times, two parties 5 times each) and, smaller with the same kills, by the test suite.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainmaster.errors import UserError
from trainmaster.gateway.audit.log import verify
from trainmaster.gateway.crypto.provision import load_roster
from trainmaster.gateway.executors.base import read_commits
from trainmaster.gateway.initiator.client import Initiator
from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.localdeploy import Deployment
from trainmaster.gateway.relay.mapping import MappingTable


@dataclass(frozen=True)
class StormOptions:
    tasks: int = 10_000
    initiators: int = 4
    parties: int = 8
    legs_per_task: int = 1
    gateway_kills: int = 10
    killed_parties: int = 2
    party_kills: int = 5
    """Kills of each of the first ``killed_parties`` parties."""
    workers: int = 24
    """Tasks in flight at once (each a thread running ``Initiator.run_task``)."""
    down_s: tuple[float, float] = (0.2, 2.0)
    """How long a killed service stays down before it is started again (uniform, seconds)."""
    deadline_s: float = 3600.0
    leg_timeout_s: float = 60.0
    seed: int = 0


@dataclass
class StormReport:
    options: dict[str, Any]
    seconds: float = 0.0
    tasks_done: int = 0
    """Tasks whose run ended with a report (every leg with an outcome)."""
    tasks_failed_to_run: int = 0
    """Tasks whose run raised (a clear error, e.g. the gateway unreachable until the deadline)."""
    task_errors: list[str] = field(default_factory=list)
    legs: int = 0
    legs_with_result: int = 0
    leg_outcomes: dict[str, int] = field(default_factory=dict)
    error_details: list[str] = field(default_factory=list)
    executions: dict[str, int] = field(default_factory=dict)
    """How many legs had their rule committed 0, 1, 2... times at their executor."""
    results_not_run_once: int = 0
    """Legs with a result whose rule's committed runs are not exactly one (must be 0)."""
    failed_task_executions: dict[str, int] = field(default_factory=dict)
    """The legs of tasks that ended in an error: how many had their rule committed 0, 1, 2...
    times at their executor (none may have run twice; 0 or 1 both fit a clear error)."""
    lost: int = 0
    """Tasks with no report and no error, or legs of a task missing from its report (must be 0)."""
    gateway_outcomes_not_one: int = 0
    """Legs whose outcome at the gateway disagrees with what their initiator got (must be 0)."""
    kills: list[dict[str, Any]] = field(default_factory=list)
    audit: dict[str, dict[str, Any]] = field(default_factory=dict)

    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.results_not_run_once == 0
            and all(int(runs) <= 1 for runs in self.failed_task_executions)
            and self.gateway_outcomes_not_one == 0
            and self.tasks_done + self.tasks_failed_to_run == self.options["tasks"]
            and all(a["ok"] for a in self.audit.values())
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def storm_deployment(root: Path, opts: StormOptions) -> Deployment:
    """The storm's services: process-isolated executors (the storm counts runs, not sandboxes),
    caps set so that every task can be accepted."""
    parties = [f"p{i}" for i in range(opts.parties)]
    party = {"isolation": "process", "max_executors": 8, "max_queued_legs": 100_000, "result_retention_s": 86400}
    overrides: dict[str, dict[str, Any]] = {p: dict(party) for p in parties}
    overrides["gateway"] = {"max_open_legs_per_party": 100_000, "max_inflight_tasks": 1024, "task_queue_depth": 8}
    return Deployment(root, parties, overrides=overrides, initiators=[f"i{i}" for i in range(opts.initiators)])


def run_storm(root: Path, opts: StormOptions, log: Callable[[str], None] = print) -> StormReport:
    """Run the storm in ``root`` (a new folder) and count; the deployment is stopped at the end."""
    rng = random.Random(opts.seed)
    dep = storm_deployment(root, opts).start_all()
    try:
        return _storm(dep, opts, rng, log)
    finally:
        dep.stop_all()


def _storm(dep: Deployment, opts: StormOptions, rng: random.Random, log: Callable[[str], None]) -> StormReport:
    parties = dep.parties
    report = StormReport(options=asdict(opts))
    plan = [
        (f"storm-{n:05d}", f"i{n % opts.initiators}", rng.sample(parties, opts.legs_per_task))
        for n in range(opts.tasks)
    ]
    kills = [("gateway", i) for i in range(opts.gateway_kills)]
    kills += [(dep.parties[k], i) for k in range(opts.killed_parties) for i in range(opts.party_kills)]
    kills.sort(key=lambda kill: (kill[1], kill[0] != "gateway"))
    marks = [max(1, int(opts.tasks * (i + 1) / (len(kills) + 1))) for i in range(len(kills))]
    outcomes: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    finished = Counter[str]()
    lock = threading.Condition()
    state = {"next": 0, "kills": 0}
    """Tasks handed out, kills issued: a task past a kill's mark starts only once that kill is
    issued, so every kill lands while earlier tasks are in flight, however fast they run."""

    def take() -> int | None:
        with lock:
            while True:
                n = state["next"]
                if n >= len(plan):
                    return None
                if state["kills"] >= sum(1 for mark in marks if mark <= n):
                    state["next"] += 1
                    return n
                lock.wait(timeout=1.0)

    def worker() -> None:
        clients: dict[str, Initiator] = {}
        try:
            while (n := take()) is not None:
                task_id, who, legs = plan[n]
                ini = clients.get(who)
                if ini is None:
                    ini = clients[who] = dep.initiator(timeout_s=30, name=who, log=lambda _line: None)
                spec = TaskSpec(
                    task_id=task_id,
                    deadline_s=opts.deadline_s,
                    leg_timeout_s=opts.leg_timeout_s,
                    legs=[LegSpec(data_id=f"m_{p}", party=p, rule="row_count") for p in legs],
                )
                try:
                    got = ini.run_task(spec)
                    with lock:
                        outcomes[task_id] = got
                except (UserError, OSError) as exc:  # a clear error (UserError's message), kept
                    with lock:
                        errors[task_id] = getattr(exc, "message", str(exc))
                with lock:
                    finished["n"] += 1
        finally:
            for ini in clients.values():
                ini.close()

    def killer() -> None:
        """Kills spread over the storm by tasks handed out, the gateway's and the parties' interleaved."""
        for (name, _i), mark in zip(kills, marks):
            with lock:
                while state["next"] < mark:
                    lock.wait(timeout=1.0)
            at = time.time()
            dep.kill(name, signal.SIGKILL)
            with lock:
                state["kills"] += 1
                in_flight = state["next"] - finished["n"]
                lock.notify_all()
            time.sleep(rng.uniform(*opts.down_s))
            dep.start(name)
            dep.wait_ready(name, timeout_s=300)
            report.kills.append(
                {"service": name, "after_tasks": mark, "in_flight": in_flight, "down_s": round(time.time() - at, 2)}
            )
            log(f"storm: killed {name} with {in_flight} task(s) in flight; back after {time.time() - at:.1f}s")

    t0 = time.time()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(opts.workers)]
    chaos = threading.Thread(target=killer, daemon=True)
    for t in threads:
        t.start()
    chaos.start()
    last = 0
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if finished["n"] - last >= max(1, opts.tasks // 20):
            last = finished["n"]
            log(f"storm: {last}/{opts.tasks} tasks ended after {time.time() - t0:.0f}s")
    chaos.join(timeout=600)
    report.seconds = round(time.time() - t0, 1)
    _count(dep, plan, outcomes, errors, report)
    return report


def _count(
    dep: Deployment,
    plan: list[tuple[str, str, list[str]]],
    outcomes: dict[str, dict[str, Any]],
    errors: dict[str, str],
    report: StormReport,
) -> None:
    table = MappingTable(dep.cfg("gateway").db_url or "")
    runs = Counter[int]()
    failed_runs = Counter[int]()
    kinds = Counter[str]()
    details = Counter[str]()
    for task_id, _who, legs in plan:
        got = outcomes.get(task_id)
        if got is None:
            if task_id in errors:
                report.tasks_failed_to_run += 1
                report.task_errors.append(f"{task_id}: {errors[task_id][:200]}")
                for party in legs:  # their legs too are counted at the executors
                    failed_runs[len(read_commits(_commit_file(dep, party, task_id)))] += 1
            else:
                report.lost += 1
            continue
        report.tasks_done += 1
        recorded = table.legs(task_id)
        for party in legs:
            data_id = f"m_{party}"
            report.legs += 1
            leg = got["legs"].get(data_id)
            if leg is None:
                report.lost += 1
                continue
            kinds[leg["outcome"]] += 1
            commits = len(read_commits(_commit_file(dep, party, task_id)))
            runs[commits] += 1
            if leg["outcome"] == "result":
                report.legs_with_result += 1
                if commits != 1:
                    report.results_not_run_once += 1
            else:
                details[f"{leg['outcome']}: {str(leg.get('detail', ''))[:160]}"] += 1
            at_gateway = recorded.get(data_id)
            if at_gateway is None or (at_gateway.outcome is not None and at_gateway.outcome != leg["outcome"]):
                report.gateway_outcomes_not_one += 1
    report.leg_outcomes = dict(kinds)
    report.executions = {str(k): v for k, v in sorted(runs.items())}
    report.failed_task_executions = {str(k): v for k, v in sorted(failed_runs.items())}
    report.error_details = [f"{n} x {d}" for d, n in details.most_common(20)]
    report.task_errors = report.task_errors[:20]
    roster = load_roster(dep.cfg("gateway").roster)
    for name in ["gateway", *dep.parties]:
        path = Path(dep.cfg(name).state_dir) / "audit.log"
        verdict = verify(path, roster[name])
        report.audit[name] = {"ok": verdict.ok, "lines": verdict.lines, "problems": verdict.problems[:5]}


def _commit_file(dep: Deployment, party: str, task_id: str) -> Path:
    """Where ``party``'s executor records each committed run of the task's leg."""
    return Path(dep.cfg(party).state_dir) / "legs" / task_id / f"m_{party}" / "commit"


def main_summary(report: StormReport) -> str:
    """One paragraph of counts for a terminal."""
    return json.dumps(
        {
            k: getattr(report, k)
            for k in (
                "seconds",
                "tasks_done",
                "tasks_failed_to_run",
                "legs",
                "legs_with_result",
                "leg_outcomes",
                "executions",
                "results_not_run_once",
                "failed_task_executions",
                "lost",
                "gateway_outcomes_not_one",
            )
        }
    )
