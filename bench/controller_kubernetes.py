"""Controller benchmark, Kubernetes section (issue #30): submit -> every pod Running, Trainmaster's
operator against Kubernetes' own Job controller, the same pods on the same cluster in one run.

    .venv/bin/python bench/controller.py --kubernetes [--runs 5] [--sizes 1,8,32]

Writes ``bench/results/controller_kubernetes.{json,md,png}``. A cluster of this machine is
brought up for the run (``trainmaster cluster up``, one node) and removed after; the operator
runs out of the cluster as ``trainmaster operator`` (its own process, metrics on a local port).

Each run creates, through the API, either a ``TrainingJob`` of N replicas (ours) or a
``batch/v1`` Job with ``parallelism = completions = N`` (Kubernetes'), whose pods are the same:
the ``busybox`` image built here, a 30 s sleep that ends on SIGTERM, ``imagePullPolicy: Never``, no requests.
The clock starts just before the create call and stops when a watch the benchmark opened
beforehand has seen N of the job's pods in phase ``Running``. Systems alternate (their order
flips every run); each job is deleted and its pods gone before the next. Medians over runs.
Beside: the operator's resident memory (``process_resident_memory_bytes`` of its metrics) and
its API requests per job (``trainmaster_operator_api_requests_total`` before the create and
once every pod runs, a watch counting once).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the same pod for both systems: sleeps 30 s, and ends at once on SIGTERM (a plain ``sleep`` as the
# container's first process ignores it, so each deletion would wait out the 30 s grace period)
BUSYBOX_COMMAND = ["busybox", "sh", "-c", "trap 'exit 0' TERM; busybox sleep 30 & wait"]
TIMEOUT = 240.0
OURS, THEIRS = "trainmaster operator", "batch/v1 Job controller"


def pod_template(image: str) -> dict[str, Any]:
    return {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": BUSYBOX_COMMAND}],
    }


def our_job(name: str, replicas: int, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "trainmaster.io/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "framework": "command",
            "roles": [
                {
                    "name": "worker",
                    "replicas": replicas,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "runtime": "container",
                    "command": BUSYBOX_COMMAND,
                }
            ],
        },
    }


def batch_job(name: str, replicas: int, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": replicas,
            "completions": replicas,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": {"bench": name}}, "spec": pod_template(image)},
        },
    }


class Bench:
    def __init__(self, kubeconfig: str, metrics_port: int):
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        self.api = client.ApiClient(configuration)
        self.core: Any = client.CoreV1Api(self.api)
        self.batch: Any = client.BatchV1Api(self.api)
        self.custom: Any = client.CustomObjectsApi(self.api)
        self.metrics_port = metrics_port

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def run(self, system: str, replicas: int, image: str) -> dict[str, float]:
        name = f"b{secrets.token_hex(3)}"
        selector = f"trainmaster.io/job-name={name}" if system == OURS else f"bench={name}"
        running: set[str] = set()
        seen = threading.Event()
        done_at: list[float] = []
        created_at: list[float] = []  # when the watch had seen every pod (created, not yet running)
        watcher = threading.Thread(
            target=self._watch, args=(selector, replicas, running, seen, done_at, created_at), daemon=True
        )
        watcher.start()
        seen.wait(10)  # the watch is open
        requests_before = self.metric("trainmaster_operator_api_requests_total")
        start = time.perf_counter()
        if system == OURS:
            self.custom.create_namespaced_custom_object(
                "trainmaster.io", "v1", "default", "trainingjobs", our_job(name, replicas, image)
            )
        else:
            self.batch.create_namespaced_job("default", batch_job(name, replicas, image), _preload_content=False)
        watcher.join(TIMEOUT)
        if not done_at:
            raise RuntimeError(f"{system}: {len(running)} of {replicas} pods Running after {TIMEOUT:.0f} s")
        requests = self.metric("trainmaster_operator_api_requests_total") - requests_before
        self._delete(system, name, selector)
        created = (created_at[0] if created_at else done_at[0]) - start
        return {"running_s": done_at[0] - start, "created_s": created, "operator_requests": requests}

    def _watch(
        self,
        selector: str,
        replicas: int,
        running: set[str],
        opened: threading.Event,
        done_at: list[float],
        created_at: list[float],
    ) -> None:
        from kubernetes import watch

        created: set[str] = set()
        stream = watch.Watch()
        opened.set()
        for event in stream.stream(
            self.core.list_namespaced_pod, "default", label_selector=selector, timeout_seconds=int(TIMEOUT)
        ):
            pod = event["object"]
            created.add(pod.metadata.name)
            if len(created) >= replicas and not created_at:
                created_at.append(time.perf_counter())
            if pod.status.phase == "Running":
                running.add(pod.metadata.name)
            if len(running) >= replicas:
                done_at.append(time.perf_counter())
                stream.stop()
                return

    def _delete(self, system: str, name: str, selector: str) -> None:
        if system == OURS:
            self.custom.delete_namespaced_custom_object("trainmaster.io", "v1", "default", "trainingjobs", name)
        else:
            self.batch.delete_namespaced_job(name, "default", propagation_policy="Background", _preload_content=False)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if not self.core.list_namespaced_pod("default", label_selector=selector).items:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the pods of {name} were not gone after {TIMEOUT:.0f} s")


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples": [round(s, 3) for s in samples],
    }


def run_and_write(runs: int, sizes: list[int], out: Path, nodes: int = 1, cluster_name: str = "") -> dict[str, Any]:
    """``cluster_name``: an existing cluster (``trainmaster cluster up --name``), used and left
    up; else one of ``nodes`` node(s) is brought up for the run and removed after."""
    from trainmaster.cluster import Cluster, ClusterOptions, remove
    from trainmaster.cluster.images import BUSYBOX
    from trainmaster.cluster.layout import free_ports

    scratch = Path(tempfile.mkdtemp(prefix="tm-bench-k8s-"))
    name = cluster_name or f"b{secrets.token_hex(2)}"
    if cluster_name:
        cluster = Cluster.load(cluster_name)
        nodes = len(cluster.layout.nodes)
    else:
        cluster = Cluster.up(ClusterOptions(name=name, nodes=nodes), root=scratch / "clusters")
    port = free_ports(1)[0]
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig), "TRAINMASTER_HOME": str(scratch / "home")}
    log = open(scratch / "operator.log", "wb")
    # TM_BENCH_PROFILE=FILE: the operator runs under cProfile, its profile written to FILE at the end
    profile = os.environ.get("TM_BENCH_PROFILE")
    operator = subprocess.Popen(
        [
            *([sys.executable, "-m", "cProfile", "-o", profile] if profile else []),
            str(Path(sys.executable).parent / "trainmaster"),
            "operator",
            "--runtime",
            "container",
            "--metrics-port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    results: dict[str, Any] = {
        "meta": {
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cpus": os.cpu_count(),
            "kubernetes": cluster.layout.version,
            "nodes": nodes,
            "cluster": "existing (--cluster)" if cluster_name else "brought up for the run",
            "runs": runs,
            "pod": f"{BUSYBOX} {' '.join(BUSYBOX_COMMAND)}",
            "load_at_start": round(os.getloadavg()[0], 2),
            "command": " ".join([".venv/bin/python", "bench/controller.py", *sys.argv[1:]]),
            "priority": os.getpriority(os.PRIO_PROCESS, 0),
        },
        "submit_to_running": {OURS: {}, THEIRS: {}},
        "operator": {},
    }
    try:
        bench = Bench(str(cluster.layout.kubeconfig), port)
        deadline = time.monotonic() + 120
        while True:
            try:
                if bench.metric("trainmaster_leading") == 1:
                    break
            except (OSError, KeyError):
                pass
            if time.monotonic() > deadline or operator.poll() is not None:
                raise RuntimeError(
                    f"the operator did not lead; its log: {(scratch / 'operator.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        bench.run(OURS, 1, BUSYBOX)  # warm: the CRD's first objects, the first pods of the node
        bench.run(THEIRS, 1, BUSYBOX)
        for size in sizes:
            samples: dict[str, list[dict[str, float]]] = {OURS: [], THEIRS: []}
            load_before = round(os.getloadavg()[0], 2)
            for run in range(runs):
                for system in (OURS, THEIRS) if run % 2 == 0 else (THEIRS, OURS):
                    samples[system].append(bench.run(system, size, BUSYBOX))
            for system, measured in samples.items():
                entry = summary([m["running_s"] for m in measured])
                entry["created_median_s"] = statistics.median(m["created_s"] for m in measured)
                if system == OURS:
                    entry["operator_requests_median"] = statistics.median(m["operator_requests"] for m in measured)
                entry["load"] = [load_before, round(os.getloadavg()[0], 2)]  # 1-minute load before and after
                results["submit_to_running"][system][str(size)] = entry
                print(
                    f"{system:24s} {size:3d} pods: every pod Running after {entry['median_s']:.2f} s "
                    f"(1-minute load {entry['load'][0]} -> {entry['load'][1]})",
                    flush=True,
                )
            ratio = (
                results["submit_to_running"][OURS][str(size)]["median_s"]
                / results["submit_to_running"][THEIRS][str(size)]["median_s"]
            )
            results["submit_to_running"].setdefault("ratio", {})[str(size)] = round(ratio, 3)
        results["operator"] = {
            "rss_bytes": bench.metric("process_resident_memory_bytes"),
            "api_requests_total": bench.metric("trainmaster_operator_api_requests_total"),
        }
    finally:
        operator.terminate()
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
        log.close()
        if os.environ.get("TM_BENCH_OPERATOR_LOG"):  # =FILE: keep the operator's log there
            shutil.copy(scratch / "operator.log", os.environ["TM_BENCH_OPERATOR_LOG"])
        if not cluster_name:
            remove(name, root=scratch / "clusters")
        shutil.rmtree(scratch, ignore_errors=True)
    results["meta"]["load_at_end"] = round(os.getloadavg()[0], 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_kubernetes.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "controller_kubernetes.md").write_text(markdown(results))
    plot(results, out / "controller_kubernetes.png")
    return results


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "# Controller benchmark: Kubernetes (submit -> every pod Running)",
        "",
        f"{meta['time']}, {meta['cpus']} CPUs, Kubernetes {meta['kubernetes']} ({meta['nodes']} node(s), "
        f"built here), pods `{meta['pod']}`, {meta['runs']} runs per size (median), 1-minute load "
        f"{meta['load_at_start']} at the start and {meta['load_at_end']} at the end.",
        "",
        f"Command: `{meta.get('command', '.venv/bin/python bench/controller.py --kubernetes')}` at nice "
        f"{meta.get('priority', 0)}, on {meta.get('cluster', 'a cluster brought up for the run')}.",
        "",
        "| pods | Trainmaster operator (s) | batch/v1 Job controller (s) | ours / Kubernetes | every pod created: ours / Kubernetes' (s) | operator API requests per job | 1-minute load (before -> after) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    s = results["submit_to_running"]
    for size in s[OURS]:
        ours, theirs = s[OURS][size], s[THEIRS][size]
        lines.append(
            f"| {size} | {ours['median_s']:.2f} ({ours['min_s']:.2f}-{ours['max_s']:.2f}) | "
            f"{theirs['median_s']:.2f} ({theirs['min_s']:.2f}-{theirs['max_s']:.2f}) | "
            f"{s['ratio'][size]:.2f}x | {ours['created_median_s']:.2f} / {theirs['created_median_s']:.2f} | "
            f"{ours['operator_requests_median']:.0f} | "
            f"{ours['load'][0]} -> {ours['load'][1]} |"
        )
    op = results.get("operator") or {}
    if op:
        lines += [
            "",
            f"Operator: resident memory {op['rss_bytes'] / 2**20:.0f} MiB at the end of the run; "
            f"{op['api_requests_total']:.0f} API requests in all (watches count once).",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = results["submit_to_running"]
    sizes = list(s[OURS])
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in (OURS, THEIRS):
        ax.plot([int(n) for n in sizes], [s[system][n]["median_s"] for n in sizes], marker="o", label=system)
    ax.set_xlabel("pods")
    ax.set_ylabel("submit -> every pod Running (s, median)")
    ax.set_title(f"Kubernetes {results['meta']['kubernetes']} on {results['meta']['cpus']} CPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
