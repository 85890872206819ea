"""Does the order in which a gang's pods reach the node change when they all run? (issue #30)

    .venv/bin/python bench/controller_kubernetes_pacing.py --cluster NAME [--size 32] [--rounds 4]
        [--modes burst,slowstart,paced,job] [--pace-ms 10]

At 32 pods our operator had every pod created (0.19 s) and bound (0.23 s) sooner than the
``batch/v1`` Job controller (0.37 s, 0.39 s), yet every pod Running later (4.07 s against 3.73 s).
The Job controller creates pods in slow-start batches (1, 2, 4, 8, 16, ...; each batch once the
one before is answered); our operator sends the first pod, then all the others at once. This
diagnostic takes the controllers out: the same bare pods (the benchmark's plain pod, a label per
run) are created straight through the API in each way, alternating, on an existing cluster:

- ``burst``: the first pod, then every other at once from 16 threads (our operator's way);
- ``slowstart``: batches of 1, 2, 4, 8, 16, ... from 16 threads, each once the one before is answered
  (the Job controller's way);
- ``paced``: the first pod, then one every ``--pace-ms`` ms;
- ``job``: a real ``batch/v1`` Job of the same pods (the reference).

Per run: when the last pod was created, bound, Running (a watch opened before), and from the
node's containerd (its event stream: ``/containers/create`` says which image, so which are
sandboxes, ``/tasks/start`` when each started) when the first and last sandbox and container
started. Where the time goes between the last container start and the last pod Running is the
kubelet: it sees a started container at its next relist (once a second) and then reports.

Writes ``bench/results/controller_kubernetes_pacing.json`` (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import Any

import controller_kubernetes as ck

ROOT = Path(__file__).resolve().parent.parent
MODES = ("burst", "slowstart", "paced", "job")


def pod(name: str, index: int, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-{index}", "labels": {"bench": name}},
        "spec": ck.pod_template(image),
    }


def create_pods(
    bench: ck.Bench, pool: ThreadPoolExecutor, mode: str, name: str, size: int, image: str, pace: float
) -> None:
    def create(index: int) -> None:
        bench.core.create_namespaced_pod("default", pod(name, index, image), _preload_content=False)

    if mode == "burst":
        create(0)
        wait_all([pool.submit(create, i) for i in range(1, size)])
    elif mode == "slowstart":
        done, batch = 0, 1
        while done < size:
            count = min(batch, size - done)
            wait_all([pool.submit(create, i) for i in range(done, done + count)])
            done += count
            batch *= 2
    elif mode == "paced":
        create(0)
        start = time.perf_counter()
        pending = []
        for i in range(1, size):
            delay = start + (i - 1) * pace - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pending.append(pool.submit(create, i))
        wait_all(pending)
    else:
        raise ValueError(mode)


def watch(
    bench: ck.Bench, selector: str, size: int, opened: threading.Event, seen: dict[str, dict[str, float]]
) -> None:
    """Until every pod is Running: per pod, when the watch first saw it created, bound, Running."""
    from kubernetes import watch as kwatch

    stream = kwatch.Watch()
    opened.set()
    for event in stream.stream(
        bench.core.list_namespaced_pod, "default", label_selector=selector, timeout_seconds=int(ck.TIMEOUT)
    ):
        now = time.time()
        p = event["object"]
        marks = seen.setdefault(p.metadata.name, {})
        marks.setdefault("created", now)
        if p.spec.node_name:
            marks.setdefault("bound", now)
        if p.status.phase == "Running":
            marks.setdefault("running", now)
        if sum("running" in m for m in seen.values()) >= size:
            stream.stop()
            return


def run(
    bench: ck.Bench,
    events: ck.ContainerdEvents,
    pool: ThreadPoolExecutor,
    mode: str,
    size: int,
    image: str,
    pace: float,
) -> dict[str, Any]:
    name = f"p{secrets.token_hex(3)}"
    selector = f"bench={name}"
    seen: dict[str, dict[str, float]] = {}
    opened = threading.Event()
    watcher = threading.Thread(target=watch, args=(bench, selector, size, opened, seen), daemon=True)
    watcher.start()
    opened.wait(10)
    assert bench.meter is not None
    quiet = bench.meter.wait_quiet()
    time.sleep(0.3)  # the watch's request is out
    t0 = time.time()
    if mode == "job":
        bench.batch.create_namespaced_job("default", ck.batch_job(name, size, image), _preload_content=False)
    else:
        create_pods(bench, pool, mode, name, size, image, pace)
    sent = time.time() - t0
    watcher.join(ck.TIMEOUT)
    t1 = time.time()
    time.sleep(0.2)  # the last events reach the stream
    starts = events.starts_between(t0, t1)
    rel = {
        stage: sorted(m[stage] - t0 for m in seen.values() if stage in m) for stage in ("created", "bound", "running")
    }
    if len(rel["running"]) < size:
        raise RuntimeError(f"{mode}: only {len(rel['running'])} of {size} Running after {ck.TIMEOUT} s")
    deleting = time.monotonic()
    if mode == "job":
        bench.batch.delete_namespaced_job(name, "default", propagation_policy="Orphan", _preload_content=False)
    bench.core.delete_collection_namespaced_pod("default", label_selector=selector, grace_period_seconds=0)
    # gone from the API at once (no grace): the run after starts once the node has stopped every
    # container too (no other pod runs on the cluster), so no run shares the node with a teardown
    while bench.core.list_namespaced_pod("default", label_selector=selector).items or events.tasks():
        if time.monotonic() > deleting + ck.TIMEOUT:
            raise RuntimeError(f"pods of {name} not gone (or their containers still running)")
        time.sleep(0.5)
    return {
        "mode": mode,
        "quiet_wait_s": round(quiet, 1),
        "delete_s": round(time.monotonic() - deleting, 1),
        "sent_s": round(sent, 3),
        "created_last": round(rel["created"][-1], 3),
        "bound_last": round(rel["bound"][-1], 3),
        "sandbox_first": round(starts["sandbox"][0], 3) if starts["sandbox"] else None,
        "sandbox_last": round(starts["sandbox"][-1], 3) if starts["sandbox"] else None,
        "container_first": round(starts["container"][0], 3) if starts["container"] else None,
        "container_last": round(starts["container"][-1], 3) if starts["container"] else None,
        "running_first": round(rel["running"][0], 3),
        "running_last": round(rel["running"][-1], 3),
        "sandboxes": [round(s, 3) for s in starts["sandbox"]],
        "containers": [round(s, 3) for s in starts["container"]],
        "running": [round(s, 3) for s in rel["running"]],
        "bound": [round(s, 3) for s in rel["bound"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="an existing cluster of `trainmaster cluster up --name NAME`")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of every mode (order rotates each round)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--pace-ms", type=float, default=10.0, help="paced: one pod every this many ms")
    parser.add_argument(
        "--max-seconds", type=float, default=420.0, help="no new round after this long (the benchmark lock's hold)"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if ck.skipped_without_cluster(__file__, args.cluster):
        return
    from trainmaster.cluster import Cluster
    from trainmaster.cluster.images import BUSYBOX

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a kill ends the event stream too (finally)
    modes = [m for m in args.modes.split(",") if m]
    cluster = Cluster.load(args.cluster)
    bench = ck.Bench(str(cluster.layout.kubeconfig), 0, ck.ClusterMeter(cluster, os.getpid()))
    assert bench.meter is not None
    bench.meter.idle_rate(5)
    events = ck.ContainerdEvents(cluster.layout.nodes[0].containerd_socket)
    pool = ThreadPoolExecutor(16)
    load = [round(os.getloadavg()[0], 2)]
    runs: list[dict[str, Any]] = []
    try:
        for mode in modes:  # warm each way once, unrecorded
            run(bench, events, pool, mode, 2, BUSYBOX, args.pace_ms / 1000)
        began = time.monotonic()
        for r in range(args.rounds):
            if time.monotonic() - began > args.max_seconds:
                print(f"stopped after {r} rounds: --max-seconds {args.max_seconds:.0f}", flush=True)
                break
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                m = run(bench, events, pool, mode, args.size, BUSYBOX, args.pace_ms / 1000)
                m["round"] = r
                runs.append(m)
                print(
                    f"{mode:9s} sent {m['sent_s']:.2f} bound {m['bound_last']:.2f} sandboxes {m['sandbox_first']}-{m['sandbox_last']} "
                    f"containers {m['container_first']}-{m['container_last']} Running {m['running_first']:.2f}-{m['running_last']:.2f} "
                    f"(quiet wait {m['quiet_wait_s']} s, delete {m['delete_s']} s)",
                    flush=True,
                )
    finally:
        events.close()  # (its process writes to our stderr: ended before we exit)
        pool.shutdown()
    load.append(round(os.getloadavg()[0], 2))
    summary = {
        mode: {
            key: statistics.median(m[key] for m in runs if m["mode"] == mode and m[key] is not None)
            for key in ("sent_s", "bound_last", "sandbox_last", "container_last", "running_last")
        }
        for mode in modes
        if any(m["mode"] == mode for m in runs)
    }
    for mode, s in summary.items():
        print(f"{mode:9s} " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_kubernetes_pacing.json").write_text(
        json.dumps(
            {
                "meta": {
                    "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "command": " ".join([".venv/bin/python", "bench/controller_kubernetes_pacing.py", *sys.argv[1:]]),
                    "priority": os.getpriority(os.PRIO_PROCESS, 0),
                    "load": load,
                    "size": args.size,
                    "pace_ms": args.pace_ms,
                },
                "median": summary,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
