"""Controller benchmark, container section (issue #22): N replicas running in podman containers
vs the same job on the host, through the same controller and node agent; podman alone (N
``podman run -d`` at once) as the anchor of what the container runtime itself costs.

    .venv/bin/python bench/controller.py --containers [--runs 5] [--sizes 16]

Writes ``bench/results/controller_containers.{json,md,png}``. Every replica runs
``/bin/sh -c 'mktemp -p MARKERS >/dev/null; exec sleep 30'``; on the host, and in a container of a
few-MB image built here from this machine's ``sh``, ``mktemp`` and ``sleep``
(:func:`trainmaster.containers.images.build_program_image`), with ``MARKERS`` a hostPath volume.
Measured from just before the submit: *reported* (every instance running in our store) and
*processes* (every replica's marker file exists), then *cancel* (cancel until the job is
cancelled and, for containers, every container removed). Runs alternate host / container;
medians after one cold run per mode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from controller_timing import Ours, summary, until_running  # one timing for both controller benchmarks
from trainmaster.backends.local import LocalBackend
from trainmaster.containers import images
from trainmaster.containers.runtime import AGENT_LABEL, ContainerRuntime, detect

SHELL = "mktemp -p {markers} >/dev/null; exec sleep 30"


def _containers_left(podman: ContainerRuntime) -> int:
    out = subprocess.run(
        [*podman.base(), "ps", "-a", "--filter", f"label={AGENT_LABEL}", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return len(out.split())


def _one_job(ours: Any, podman: ContainerRuntime, tag: str | None, replicas: int, scratch: Path) -> dict[str, float]:
    workdir = Path(tempfile.mkdtemp(dir=scratch))
    markers = workdir / "markers"
    markers.mkdir()
    role: dict[str, Any] = {
        "name": "worker",
        "replicas": replicas,
        "command": ["/bin/sh", "-c", SHELL.format(markers=markers)],
    }
    if tag is not None:
        role.update(
            image=tag,
            runtime="container",
            imagePullPolicy="Never",
            volumes=[{"name": "markers", "hostPath": str(markers), "mountPath": str(markers)}],
        )
    start = time.perf_counter()
    job_id = ours.submit("bench-containers" if tag else "bench-host", [role])
    moments = until_running(ours, job_id, replicas, markers, start)
    began = time.perf_counter()
    ours.finish(job_id)
    moments["cancel"] = time.perf_counter() - began
    if tag is not None:
        left = _containers_left(podman)
        assert left == 0, f"{left} containers left after cancel"
    shutil.rmtree(workdir, ignore_errors=True)
    return moments


def _podman_alone(podman: ContainerRuntime, tag: str, replicas: int, scratch: Path) -> dict[str, float]:
    """N ``podman run -d`` at once, until every marker exists; then ``rm -f`` of all."""
    markers = Path(tempfile.mkdtemp(dir=scratch))
    names = [f"tm-bench-anchor-{os.getpid()}-{i}" for i in range(replicas)]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                *podman.base(),
                "run",
                "-d",
                "--name",
                name,
                "--network",
                "host",
                "--pull",
                "never",
                "-v",
                f"{markers}:{markers}",
                tag,
                "/bin/sh",
                "-c",
                SHELL.format(markers=markers),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in names
    ]
    for proc in procs:
        proc.wait(timeout=300)
    deadline = time.monotonic() + 300
    while sum(1 for _ in markers.iterdir()) < replicas:
        assert time.monotonic() < deadline, "podman alone: replicas did not start"
        time.sleep(0.02)
    processes = time.perf_counter() - start
    began = time.perf_counter()
    subprocess.run([*podman.base(), "rm", "-f", "-t", "2", *names], capture_output=True, timeout=300)
    removed = time.perf_counter() - began
    shutil.rmtree(markers, ignore_errors=True)
    return {"processes": processes, "cancel": removed}


def containers_bench(runs: int, replicas: int, scratch: Path) -> dict[str, Any]:
    podman = detect()
    tag = f"localhost/tm-bench-small:{os.getpid()}"
    images.build_program_image(podman, tag, ["sleep", "mktemp"])
    try:
        ours = Ours(LocalBackend(), scratch / "ours")
        samples: dict[str, list[dict[str, float]]] = {"host": [], "container": [], "podman alone": []}
        cold: dict[str, dict[str, float]] = {}
        for run in range(runs + 1):
            for mode in samples:
                if mode == "podman alone":
                    result = _podman_alone(podman, tag, replicas, scratch)
                else:
                    result = _one_job(ours, podman, tag if mode == "container" else None, replicas, scratch)
                if run == 0:
                    cold[mode] = result
                else:
                    samples[mode].append(result)
        medians = {mode: {key: summary([x[key] for x in s]) for key in s[0]} for mode, s in samples.items()}
        return {
            "replicas": replicas,
            "runs": runs,
            "cpus": os.cpu_count(),
            "oci_runtime": podman.oci_runtime,
            "podman": subprocess.run([podman.podman, "--version"], capture_output=True, text=True).stdout.strip(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "summary": medians,
            "cold": cold,
            "samples": samples,
        }
    finally:
        images.remove_images(podman, [tag])


def containers_markdown(results: dict[str, Any]) -> str:
    n, s = results["replicas"], results["summary"]
    lines = [
        f"{n} replicas through the local backend's node agent, on the host vs in podman containers "
        f"({results['podman']}, OCI runtime {os.path.basename(results['oci_runtime'])}; {results['cpus']} CPUs "
        f"shared with other work; medians of {results['runs']} runs after a cold one; {results['time']}).",
        "",
        "Seconds from just before the submit: *reported* = every instance running in our store; *processes* = "
        "every replica's command started (its marker exists); *cancel* = cancel until the job is cancelled "
        "(containers: and every container removed). *podman alone*: the anchor, N `podman run -d` at once, "
        "then `podman rm -f -t 2` of all.",
        "",
        "| mode | reported | processes | cancel |",
        "|---|---|---|---|",
    ]
    for mode, e in s.items():
        reported = f"{e['reported']['median_s']:.3f}" if "reported" in e else "-"
        lines.append(f"| {mode} | {reported} | {e['processes']['median_s']:.3f} | {e['cancel']['median_s']:.3f} |")
    lines += [
        "",
        "A container's `sleep` is its PID 1, which ignores SIGTERM (as in Kubernetes without an init): "
        "cancel waits the controller's grace, then the agent kills the podman client and removes the container.",
        "",
        "![containers vs host](/bench/results/controller_containers.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    keys = ["reported", "processes", "cancel"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.25
    for i, mode in enumerate(s):
        values = [s[mode][k]["median_s"] if k in s[mode] else 0 for k in keys]
        ax.bar([x + i * width for x in range(len(keys))], values, width, label=mode)
    ax.set_xticks([x + width for x in range(len(keys))], keys)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"{results['replicas']} replicas: host vs podman containers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_and_write(runs: int, replicas: int, out: Path) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="tm-bench-containers-"))
    os.environ["TRAINMASTER_HOME"] = str(scratch / "home")
    try:
        results = containers_bench(runs, replicas, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    (out / "controller_containers.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "controller_containers.md").write_text(containers_markdown(results))
    plot(results, out / "controller_containers.png")
    return results
