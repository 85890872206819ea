"""Benchmark: what the executor sandbox costs, against the plain-process executor, in the same run.

For each isolation (``process``, ``sandbox``), alternating, ``--starts`` times: start an executor
on one party's share of the breast-cancer sample data (timed to its READY line), run
``summary_stats`` ``--calls`` times on it (each call timed: connect, request, read the result),
sum the resident memory of every process of the executor's tree, then kill it. Reports medians.
Needs root, bubblewrap and cgroup v1 (the sandbox); exits 2 saying what is missing otherwise.
Writes bench/results/gateway_sandbox.json and .md.

    .venv/bin/python bench/gateway_sandbox.py              # 10 starts x 20 calls each
    .venv/bin/python bench/gateway_sandbox.py --starts 3   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from trainmaster.gateway.executors.sandbox import bubblewrap as sandbox
from trainmaster.gateway.executors.process import ExecutorHandle
from trainmaster.gateway.localdeploy import breast_cancer_split, write_csv
from trainmaster.gateway.models import RuleCall

RESULTS = Path(__file__).parent / "results"


def _tree_rss_mb(pid: int) -> float:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


async def _one(data: Path, isolation: str, calls: int) -> dict[str, float]:
    t0 = time.perf_counter()
    h = await ExecutorHandle.start(data, deadline_s=120, start_timeout_s=60, memory_mb=1024, isolation=isolation)
    start_s = time.perf_counter() - t0
    try:
        lat = []
        for _ in range(calls):
            t1 = time.perf_counter()
            reply = await h.call(RuleCall(rule="summary_stats", params={}), timeout_s=30)
            try:
                await reply.read_all()
            finally:
                reply.close()
            lat.append(time.perf_counter() - t1)
        return {"start_s": start_s, "call_ms": statistics.median(lat) * 1e3, "rss_mb": _tree_rss_mb(h.proc.pid)}
    finally:
        h.kill()
        await asyncio.wait_for(h.proc.wait(), 10)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    reason = sandbox.unavailable_reason()
    if reason is not None:
        print(f"error: the executor sandbox cannot run here: {reason}", file=sys.stderr)
        return 2
    names, splits = breast_cancer_split(3)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "m_a.csv"
        write_csv(data, names, splits[0])
        runs: dict[str, list[dict[str, float]]] = {"process": [], "sandbox": []}
        for _ in range(a.starts):
            for isolation in runs:
                runs[isolation].append(await _one(data, isolation, a.calls))
    summary = {
        iso: {k: statistics.median(r[k] for r in rs) for k in ("start_s", "call_ms", "rss_mb")}
        for iso, rs in runs.items()
    }
    out = {
        "host": platform.node(),
        "cpus": psutil.cpu_count(),
        "starts": a.starts,
        "calls": a.calls,
        "rows": len(splits[0]),
        "columns": len(names),
        "median": summary,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_sandbox.json").write_text(json.dumps(out, indent=1))
    lines = [
        "| isolation | start to READY (s) | summary_stats call (ms) | executor tree RSS (MB) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {iso} | {s['start_s']:.3f} | {s['call_ms']:.2f} | {s['rss_mb']:.1f} |" for iso, s in summary.items()]
    md = (
        f"Executor isolation cost: medians of {a.starts} starts x {a.calls} calls, {len(splits[0])} rows x "
        f"{len(names)} columns, {psutil.cpu_count()} CPUs (shared)\n\n" + "\n".join(lines) + "\n"
    )
    (RESULTS / "gateway_sandbox.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
