"""Benchmark: a storm of small tasks while the gateway and two parties are killed -9 and restarted.

10,000 one-leg ``row_count`` tasks from 4 initiators over 8 parties (each task's party drawn at
random, seeded), 24 in flight at once, while the gateway is killed with SIGKILL 10 times and two
parties 5 times each, spread over the storm (each kill lands while earlier tasks are in flight;
the killed service stays down 0.2-2 s, then starts again). Then the count: every task's end (its
results, or a clear error), tasks or legs lost, how many times each leg's rule ran to completion
at its executor (the executors' own commit lines, ``trainmaster.gateway.executors.base``), the
gateway's one outcome per leg against what its initiator got, and every service's audit log
verified. Writes bench/results/gateway_storm.json and .md.

    .venv/bin/python bench/gateway_storm.py                  # 10,000 tasks (tens of minutes)
    .venv/bin/python bench/gateway_storm.py --tasks 500      # a shorter storm, the same kills
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from trainmaster.gateway.storm import StormOptions, main_summary, run_storm

RESULTS = Path(__file__).parent / "results"


def _sample_load(into: list[float], stop: threading.Event) -> None:
    while not stop.wait(5.0):
        into.append(os.getloadavg()[0])


def write_results(report: dict[str, Any], command: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_storm.json").write_text(json.dumps(report, indent=2))
    o = report["options"]
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(report["leg_outcomes"].items()))
    runs = ", ".join(f"{v} leg(s) {k} time(s)" for k, v in report["executions"].items())
    lines = [
        f"Storm: {o['tasks']} tasks ({o['legs_per_task']} leg each, `row_count`) from {o['initiators']} initiators "
        f"over {o['parties']} parties, {o['workers']} in flight, while the gateway was killed -9 "
        f"{o['gateway_kills']} times and {o['killed_parties']} parties {o['party_kills']} times each "
        f"({len(report['kills'])} kills in all); {report['seconds']:.0f} s; 1-minute load average during the run: "
        f"{report['load'][0]:.1f}-{report['load'][1]:.1f}. Command: `{command}`",
        "",
        "| tasks ended with results / clear error | tasks lost | legs | legs with a result | outcomes | rule runs per leg (at the executors) | results whose rule did not run exactly once | gateway outcome differs from the initiator's | audit logs verified |",
        "|---:|---:|---:|---:|---|---|---:|---:|---|",
        f"| {report['tasks_done']} / {report['tasks_failed_to_run']} | {report['lost']} | {report['legs']} | "
        f"{report['legs_with_result']} | {outcomes} | {runs} | {report['results_not_run_once']} | "
        f"{report['gateway_outcomes_not_one']} | "
        f"{sum(a['ok'] for a in report['audit'].values())} of {len(report['audit'])} |",
    ]
    if report["task_errors"]:
        failed = ", ".join(f"{v} leg(s) {k} time(s)" for k, v in report.get("failed_task_executions", {}).items())
        lines += ["", f"Legs of the tasks that ended in an error, rule runs at the executors: {failed or 'none'}."]
    if report["error_details"] or report["task_errors"]:
        lines += ["", "Clear errors (what the initiators got), most frequent first:", ""]
        lines += [f"* {d}" for d in report["error_details"][:10] + report["task_errors"][:10]]
    (RESULTS / "gateway_storm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=24)
    ap.add_argument("--gateway-kills", type=int, default=10)
    ap.add_argument("--party-kills", type=int, default=5, help="kills of each of the two killed parties")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    opts = StormOptions(
        tasks=a.tasks, workers=a.workers, gateway_kills=a.gateway_kills, party_kills=a.party_kills, seed=a.seed
    )
    loads = [os.getloadavg()[0]]
    stop = threading.Event()
    threading.Thread(target=_sample_load, args=(loads, stop), daemon=True).start()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tm-gw-storm-") as root:
        report = run_storm(Path(root), opts, log=lambda line: print(line, flush=True))
    stop.set()
    out = report.as_dict()
    out["load"] = [min(loads), max(loads)]
    out["wall_s"] = round(time.time() - t0, 1)
    out["ok"] = report.ok()
    print(main_summary(report), flush=True)
    write_results(out, " ".join(["python bench/gateway_storm.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
