"""Does our operator's pod cost the node more than the pod a user writes? (issue #30)

    .venv/bin/python bench/controller_kubernetes_podspec.py --cluster NAME [--size 32] [--pairs 6]

The Kubernetes section of the controller benchmark (``bench/controller_kubernetes.py``) compares
our operator with the ``batch/v1`` Job controller, and the two systems' pods differ: ours carry
the instance's environment (the pod IP by field reference, the registry's variables), a hostname
and subdomain (the role's headless Service), ``dnsPolicy: Default``, a termination message
policy, a container port, a 5 s grace period, our labels and annotations. This benchmark takes
the controllers out: both sides are ``batch/v1`` Jobs of ``--size`` pods, one with the
benchmark's plain pod (:func:`controller_kubernetes.pod_template`), the other with the spec of a
pod our operator made (a one-replica ``TrainingJob`` is run first, its pod read back, and the
fields the API server or the scheduler set removed). The two alternate in pairs (their order
flips every pair) on an existing cluster (``trainmaster cluster up --name NAME``); per run, when
every pod was Running and the CPU seconds of each part of the node (``ClusterMeter``).

Writes ``bench/results/controller_kubernetes_podspec.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import controller_kubernetes as ck

ROOT = Path(__file__).resolve().parent.parent
PLAIN, OURS_POD = "Job, the plain pod", "Job, our operator's pod"
# what the API server, its admission or the scheduler add to a pod spec: not the operator's
SERVER_SET = ("nodeName", "tolerations", "serviceAccount", "serviceAccountName", "priority", "preemptionPolicy")
COMPONENTS = ("containerd", "shims", "pods", "kubelet", "kube-apiserver", "etcd", "kube-controller-manager")


def our_pod_spec(bench: ck.Bench, image: str) -> dict[str, Any]:
    """The spec of the pod our operator makes for the benchmark's role (one replica; its job is
    deleted after), as a Job's pod template."""
    name = f"s{secrets.token_hex(3)}"
    bench.custom.create_namespaced_custom_object(
        "trainmaster.io", "v1", "default", "trainingjobs", ck.our_job(name, 1, image)
    )
    selector = f"trainmaster.io/job-name={name}"
    deadline = time.monotonic() + ck.TIMEOUT
    while time.monotonic() < deadline:
        pods = bench.core.list_namespaced_pod("default", label_selector=selector, _preload_content=False)
        items = json.loads(pods.data)["items"]
        if items:
            spec = copy.deepcopy(items[0]["spec"])
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"the operator made no pod for {name} in {ck.TIMEOUT:.0f} s")
    bench.custom.delete_namespaced_custom_object("trainmaster.io", "v1", "default", "trainingjobs", name)
    for key in SERVER_SET:
        spec.pop(key, None)
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cluster",
        help="an existing cluster of `trainmaster cluster up --name NAME` (without it: a skip, e.g. in `make bench`)",
    )
    parser.add_argument("--size", type=int, default=32, help="pods per Job")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of runs (one of each pod)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if ck.skipped_without_cluster(__file__, args.cluster):
        return

    from trainmaster.cluster import Cluster
    from trainmaster.cluster.images import BUSYBOX
    from trainmaster.cluster.layout import free_ports

    cluster = Cluster.load(args.cluster)
    port = free_ports(1)[0]
    scratch = Path(tempfile.mkdtemp(prefix="tm-bench-podspec-"))
    log = open(scratch / "operator.log", "wb")
    operator = ck.start_operator(cluster, scratch, log, port)
    load_start = round(os.getloadavg()[0], 2)
    try:
        bench = ck.Bench(str(cluster.layout.kubeconfig), port, ck.ClusterMeter(cluster, operator.pid))
        bench.wait_leading(operator, scratch / "operator.log")
        ours = our_pod_spec(bench, BUSYBOX)
    finally:
        ck.stop_operator(operator)
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)  # the operator's home and log: only its pod spec is kept
    plain = ck.pod_template(BUSYBOX)
    templates = {PLAIN: lambda image: plain, OURS_POD: lambda image: ours}
    bench.metric = lambda name: 0.0  # type: ignore[method-assign]  # no operator runs now
    assert bench.meter is not None
    bench.meter.idle_rate()
    runs: dict[str, list[dict[str, Any]]] = {PLAIN: [], OURS_POD: []}
    events = [ck.ContainerdEvents(node.containerd_socket) for node in cluster.layout.nodes]
    bench.events = events  # each run: when the node started the last sandbox and container
    try:
        measure(bench, runs, templates, ours, load_start, args)
    finally:
        for stream in events:
            stream.close()
    print(markdown(json.loads((Path(args.out) / "controller_kubernetes_podspec.json").read_text())))


def measure(
    bench: ck.Bench,
    runs: dict[str, list[dict[str, Any]]],
    templates: dict[str, Any],
    ours: dict[str, Any],
    load_start: float,
    args: Any,
) -> None:
    from trainmaster.cluster.images import BUSYBOX

    for pair in range(args.pairs):
        for variant in (PLAIN, OURS_POD) if pair % 2 == 0 else (OURS_POD, PLAIN):
            ck.pod_template = templates[variant]  # batch_job() builds the Job's template with it
            measured = bench.run(ck.THEIRS, args.size, BUSYBOX)
            runs[variant].append(measured)
            costs = measured["costs"]
            print(
                f"{variant:24s} {measured['running_s']:.2f} s (every container started "
                f"{measured['stages_s'].get('containers_started', float('nan')):.2f} s), "
                + ", ".join(f"{c} {costs.get(c, 0.0):.2f}" for c in COMPONENTS)
                + f", kubelet requests {costs.get('kubelet_requests', 0):.0f}",
                flush=True,
            )
        # written after every pair: a run cut short (the benchmark lock's time) keeps its pairs
        write(Path(args.out), ours, runs, load_start, args)


def write(out: Path, ours: dict[str, Any], runs: dict[str, list[dict[str, Any]]], load_start: float, args: Any) -> None:
    seconds = {v: [m["running_s"] for m in runs[v]] for v in runs}
    paired = [o / p for p, o in zip(seconds[PLAIN], seconds[OURS_POD])]
    results = {
        "meta": {
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join([".venv/bin/python", "bench/controller_kubernetes_podspec.py", *sys.argv[1:]]),
            "priority": os.getpriority(os.PRIO_PROCESS, 0),
            "load": [load_start, round(os.getloadavg()[0], 2)],
            "size": args.size,
            "pairs": len(paired),
        },
        "our_pod_spec": ours,
        "median_s": {v: statistics.median(s) for v, s in seconds.items()},
        "paired_ratio": statistics.median(paired),
        "paired_ratios": [round(r, 3) for r in paired],
        # the same up to the node's last container start (without the kubelet's relist phase)
        "paired_ratios_containers_started": [
            round(o["stages_s"]["containers_started"] / p["stages_s"]["containers_started"], 3)
            for p, o in zip(runs[PLAIN], runs[OURS_POD])
            if "containers_started" in o["stages_s"] and "containers_started" in p["stages_s"]
        ],
        "costs_median": {
            v: {
                c: statistics.median(m["costs"].get(c, 0.0) for m in runs[v]) for c in (*COMPONENTS, "kubelet_requests")
            }
            for v in runs
        },
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_kubernetes_podspec.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "controller_kubernetes_podspec.md").write_text(markdown(results))


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    med, costs = results["median_s"], results["costs_median"]
    lines = [
        "# Our operator's pod against the plain pod, both as batch/v1 Job pods (submit -> every pod Running)",
        "",
        f"{meta['time']}, {meta['size']} pods per Job, {meta['pairs']} pairs (order flips every pair), "
        f"1-minute load {meta['load'][0]} -> {meta['load'][1]}; command `{meta['command']}` at nice {meta['priority']}.",
        "",
        "| pod | every pod Running (s, median) | runs (s) | kubelet API requests | " + " | ".join(COMPONENTS) + " |",
        "|---|---:|---|---:|" + "---:|" * len(COMPONENTS),
    ]
    for variant in (PLAIN, OURS_POD):
        samples = ", ".join(f"{m['running_s']:.2f}" for m in results["runs"][variant])
        lines.append(
            f"| {variant} | {med[variant]:.2f} | {samples} | {costs[variant]['kubelet_requests']:.0f} | "
            + " | ".join(f"{costs[variant][c]:.2f}" for c in COMPONENTS)
            + " |"
        )
    lines += [
        "",
        f"Our pod / the plain pod: {med[OURS_POD] / med[PLAIN]:.2f}x (medians), paired runs' ratio "
        f"{results['paired_ratio']:.2f}x (each pair: {', '.join(f'{r:.2f}' for r in results['paired_ratios'])}).",
        "",
        "Our operator's pod spec as run (from the API, server-set fields removed):",
        "",
        "```json",
        json.dumps(results["our_pod_spec"], indent=1),
        "```",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
