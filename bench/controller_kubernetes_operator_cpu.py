"""Where the operator's CPU goes while a job starts (issue #30): the operator runs in this process
(its own threads), a ``TrainingJob`` of N replicas (the pod of ``bench/controller_kubernetes.py``)
is created, and the CPU seconds of each of the operator's threads are read from
``/proc/self/task`` before the create and once every pod is Running; the reconcile passes are
counted and their CPU time summed (``time.thread_time`` around ``Controller.step``).

    .venv/bin/python bench/controller_kubernetes_operator_cpu.py --cluster k7 [--replicas 32] [--runs 3]

Runs on an existing cluster (``trainmaster cluster up --name NAME``), in its ``default``
namespace, and leaves it up. Prints one line per run; writes nothing. The benchmark's own
polling (a LIST of the namespace's pods every 0.25 s) runs on the main thread, which is left
out of the operator's total. The kernel counts thread CPU in ticks of 10 ms: a thread that used
less shows 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: an A/B run may put another tree first

from bench.controller_kubernetes import our_job, skipped_without_cluster  # noqa: E402

TIMEOUT = 120.0


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each thread of this process: native id -> (thread name, seconds);
    pool threads' numbers are dropped from the name (``k8s-create_3`` -> ``k8s-create``)."""
    names = {t.native_id: t.name.split("_")[0] for t in threading.enumerate()}
    found: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(tid)] = (names.get(int(tid), "?"), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cluster",
        help="an existing cluster of `trainmaster cluster up --name` (without it: a skip, e.g. in `make bench`)",
    )
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if skipped_without_cluster(__file__, args.cluster):
        return

    from kubernetes import client

    from trainmaster.cluster import Cluster
    from trainmaster.cluster.images import BUSYBOX
    from trainmaster.operator.operator import Operator, OperatorOptions
    from trainmaster.spec.model import RuntimeKind

    cluster = Cluster.load(args.cluster)
    operator = Operator(OperatorOptions(kubeconfig=str(cluster.layout.kubeconfig), runtime=RuntimeKind("container")))
    stop = threading.Event()
    serving = threading.Thread(target=operator.run, args=(stop,), name="operator", daemon=True)
    serving.start()
    if not operator.leading.wait(TIMEOUT):
        raise SystemExit(f"the operator did not lead within {TIMEOUT:.0f} s")
    passes = [0, 0.0]  # count, CPU seconds
    step: Callable[[], None] = operator.controller.step

    def counted_step() -> None:
        began = time.thread_time()
        step()
        passes[0] += 1
        passes[1] += time.thread_time() - began

    operator.controller.step = counted_step
    custom: Any = client.CustomObjectsApi(operator.api)
    core: Any = client.CoreV1Api(operator.api)

    def pods(prefix: str) -> list[dict[str, Any]]:
        items = json.loads(core.list_namespaced_pod("default", _preload_content=False).data)["items"]
        return [p for p in items if p["metadata"]["name"].startswith(prefix + "-")]

    def start(name: str, replicas: int) -> str:
        before, passes_before, requests_before = thread_cpu(), list(passes), operator.requests
        began = time.monotonic()
        custom.create_namespaced_custom_object(
            "trainmaster.io", "v1", "default", "trainingjobs", our_job(name, replicas, BUSYBOX)
        )
        while sum((p.get("status") or {}).get("phase") == "Running" for p in pods(name)) < replicas:
            if time.monotonic() - began > TIMEOUT:
                raise SystemExit(f"{name}: not every pod Running within {TIMEOUT:.0f} s")
            time.sleep(0.25)
        took = time.monotonic() - began
        ran, requests = (
            [passes[0] - passes_before[0], passes[1] - passes_before[1]],
            operator.requests - requests_before,
        )
        spent: Counter[str] = Counter()
        for tid, (thread, cpu) in thread_cpu().items():
            spent[thread] += cpu - before.get(tid, (thread, 0.0))[1]
        custom.delete_namespaced_custom_object("trainmaster.io", "v1", "default", "trainingjobs", name)
        deadline = time.monotonic() + TIMEOUT
        while pods(name) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # the deletion's pod events and passes, out of the next run
        total = sum(cpu for thread, cpu in spent.items() if thread != "MainThread")
        threads = ", ".join(f"{t} {c:.2f}" for t, c in spent.most_common() if c > 0 and t != "MainThread")
        return (
            f"{replicas} pods Running after {took:.2f} s; operator CPU {total:.2f} s ({threads}); "
            f"{ran[0]:.0f} passes, {ran[1]:.3f} s in them; {requests} API requests (the benchmark's polls included)"
        )

    try:
        start("warm", 1)
        idle = thread_cpu()
        time.sleep(5)
        print(
            "idle 5 s: operator CPU "
            f"{sum(c - idle.get(t, (n, 0.0))[1] for t, (n, c) in thread_cpu().items() if n != 'MainThread'):.2f} s",
            flush=True,
        )
        for run in range(args.runs):
            print(
                f"run {run + 1}: {start(f'cpu{run}', args.replicas)} (1-minute load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    finally:
        stop.set()
        serving.join(30)


if __name__ == "__main__":
    main()
