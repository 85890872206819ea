"""Does our operator's pod cost the node more than the pod a user writes? (issue #30)

    .venv/bin/python bench/controller_kubernetes_podspec.py --cluster NAME [--size 32] [--pairs 6] \
        [--drop env --drop hostname,dns ...] [--out DIR]

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

Which of our fields costs the node: each ``--drop GROUP[,GROUP...]`` adds a third kind of run,
our pod without those fields (:data:`GROUPS` names them), alternating with the other two (the
order rotates every round), each compared paired with the plain pod: a bisection anyone can
rerun from the command line.

Writes ``controller_kubernetes_podspec.{json,md}`` into ``--out`` (``bench/results``).
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
# the fields of our pod that the plain pod lacks, by group (``--drop``); the rest (image, command,
# restartPolicy, automountServiceAccountToken, enableServiceLinks) the two share
GROUPS: dict[str, tuple[str, ...]] = {
    "env": ("containers.env",),  # 13 variables, the pod IP by field reference
    "port": ("containers.ports",),
    "hostname": ("hostname", "subdomain"),
    "dns": ("dnsPolicy",),  # Default; without it ClusterFirst, as the plain pod
    "termination": ("containers.terminationMessagePolicy", "containers.terminationMessagePath"),
    "grace": ("terminationGracePeriodSeconds",),
    "resources": ("containers.resources",),
}
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


def without(spec: dict[str, Any], groups: list[str]) -> dict[str, Any]:
    """``spec`` without the fields of ``groups`` (each a key of :data:`GROUPS`)."""
    out = copy.deepcopy(spec)
    for group in groups:
        for field in GROUPS[group]:
            if field.startswith("containers."):
                for container in out["containers"]:
                    container.pop(field.removeprefix("containers."), None)
            else:
                out.pop(field, None)
    return out


def drop_groups(text: str) -> list[str]:
    """One ``--drop`` value: groups by comma, each one of :data:`GROUPS`."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise argparse.ArgumentTypeError(f"unknown group {unknown or text!r}: choose from {', '.join(GROUPS)}")
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cluster",
        help="an existing cluster of `trainmaster cluster up --name NAME` (without it: a skip, e.g. in `make bench`)",
    )
    parser.add_argument("--size", type=int, default=32, help="pods per Job")
    parser.add_argument("--pairs", type=int, default=6, help="rounds (one run of each pod per round)")
    parser.add_argument(
        "--drop",
        type=drop_groups,
        action="append",
        default=[],
        metavar="GROUP[,GROUP]",
        help=f"also run our pod without these field groups (repeatable; groups: {', '.join(GROUPS)})",
    )
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
    specs = {PLAIN: plain, OURS_POD: ours}
    for groups in args.drop:
        specs[f"our pod without {'+'.join(groups)}"] = without(ours, groups)
    templates = {variant: (lambda image, spec=spec: spec) for variant, spec in specs.items()}
    bench.metric = lambda name: 0.0  # type: ignore[method-assign]  # no operator runs now
    assert bench.meter is not None
    bench.meter.idle_rate()
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in specs}
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

    variants = list(templates)
    for pair in range(args.pairs):
        shift = pair % len(variants)
        order = variants[shift:] + variants[:shift] if len(variants) > 2 else variants[:: 1 if pair % 2 == 0 else -1]
        for variant in order:
            ck.pod_template = templates[variant]  # batch_job() builds the Job's template with it
            measured = bench.run(ck.THEIRS, args.size, BUSYBOX)
            runs[variant].append(measured)
            costs = measured["costs"]
            print(
                f"{variant:32s} {measured['running_s']:.2f} s (every container started "
                f"{measured['stages_s'].get('containers_started', float('nan')):.2f} s), "
                + ", ".join(f"{c} {costs.get(c, 0.0):.2f}" for c in COMPONENTS)
                + f", kubelet requests {costs.get('kubelet_requests', 0):.0f}",
                flush=True,
            )
        # written after every pair: a run cut short (the benchmark lock's time) keeps its pairs
        write(Path(args.out), ours, runs, load_start, args)


def paired(runs: dict[str, list[dict[str, Any]]], variant: str, key: str) -> list[float]:
    """Each round's ``variant`` / the plain pod on ``key`` (``running_s`` or a stage)."""

    def at(measured: dict[str, Any]) -> float | None:
        value = measured.get(key, measured["stages_s"].get(key))
        return float(value) if value is not None else None

    out = []
    for plain, other in zip(runs[PLAIN], runs[variant]):
        p, o = at(plain), at(other)
        if p and o is not None:
            out.append(round(o / p, 3))
    return out


def write(out: Path, ours: dict[str, Any], runs: dict[str, list[dict[str, Any]]], load_start: float, args: Any) -> None:
    others = [v for v in runs if v != PLAIN]
    results = {
        "meta": {
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join([".venv/bin/python", "bench/controller_kubernetes_podspec.py", *sys.argv[1:]]),
            "priority": os.getpriority(os.PRIO_PROCESS, 0),
            "load": [load_start, round(os.getloadavg()[0], 2)],
            "size": args.size,
            "pairs": min(len(r) for r in runs.values()),
        },
        "our_pod_spec": ours,
        "median_s": {v: statistics.median(m["running_s"] for m in runs[v]) for v in runs if runs[v]},
        "containers_started_median_s": {
            v: statistics.median(m["stages_s"].get("containers_started", float("nan")) for m in runs[v])
            for v in runs
            if runs[v]
        },
        # each against the plain pod, per round: every pod Running, and the node's last container
        # start (without the kubelet's relist phase)
        "paired_ratios": {v: paired(runs, v, "running_s") for v in others},
        "paired_ratios_containers_started": {v: paired(runs, v, "containers_started") for v in others},
        "costs_median": {
            v: {
                c: statistics.median(m["costs"].get(c, 0.0) for m in runs[v]) for c in (*COMPONENTS, "kubelet_requests")
            }
            for v in runs
            if runs[v]
        },
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_kubernetes_podspec.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "controller_kubernetes_podspec.md").write_text(markdown(results))


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    med, started, costs = results["median_s"], results["containers_started_median_s"], results["costs_median"]
    lines = [
        "# Our operator's pod against the plain pod, both as batch/v1 Job pods (submit -> every pod Running)",
        "",
        f"{meta['time']}, {meta['size']} pods per Job, {meta['pairs']} rounds (the order rotates every round), "
        f"1-minute load {meta['load'][0]} -> {meta['load'][1]}; command `{meta['command']}` at nice {meta['priority']}.",
        "",
        "| pod | every pod Running (s, median) | last container started (s, median) | paired / plain: Running | "
        "paired / plain: last container | kubelet API requests | " + " | ".join(COMPONENTS) + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(COMPONENTS),
    ]
    for variant in med:
        ratios = results["paired_ratios"].get(variant)
        started_ratios = results["paired_ratios_containers_started"].get(variant)
        lines.append(
            f"| {variant} | {med[variant]:.2f} | {started[variant]:.2f} | "
            f"{f'{statistics.median(ratios):.2f}x' if ratios else ''} | "
            f"{f'{statistics.median(started_ratios):.2f}x' if started_ratios else ''} | "
            f"{costs[variant]['kubelet_requests']:.0f} | "
            + " | ".join(f"{costs[variant][c]:.2f}" for c in COMPONENTS)
            + " |"
        )
    lines += [
        "",
        "Each round's ratios to the plain pod (every pod Running; last container started):",
        "",
    ]
    for variant, ratios in results["paired_ratios"].items():
        started_ratios = results["paired_ratios_containers_started"][variant]
        lines.append(
            f"- {variant}: {', '.join(f'{r:.2f}' for r in ratios)}; {', '.join(f'{r:.2f}' for r in started_ratios)}"
        )
    lines += [
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
