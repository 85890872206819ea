"""Write the README's benchmark section: one short table with a row per
``bench/results/<capability>.md``, linking to it and to its plots (``<capability>*.png``).

Run after a benchmark: ``python bench/update_readme.py``. Everything after the
``<!-- BENCH TABLES -->`` marker is regenerated; nothing above it changes. The README holds no
figures of its own: each row says what the benchmark compares, how many goal verdicts its
result file states met and not met (counted in the file, so they cannot go stale), and where the
tables are; the figures, with their commands, seeds and load, stay in ``bench/results/``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- BENCH TABLES -->"
ORDER = [
    "controller",
    "controller_ray",
    "controller_failover",
    "controller_containers",
    "controller_kubernetes",
    "scale",
    "soak",
    "aggregation",
    "aggregation_tenants",
    "aggregation_training",
    "flsched",
    "partition",
    "partition_fresh",
    "partition_pipeline_testbed",
    "partition_pipeline",
    "partition_pipesplit",
    "gateway",
    "gateway_sandbox",
    "gateway_storm",
]
COMMAND = {
    "controller_ray": "python bench/controller.py --ray",
    "controller_failover": "python bench/controller.py --failover",
    "controller_containers": "python bench/controller.py --containers",
    "partition_fresh": "python bench/partition.py --fresh",
    "partition_pipeline": "python bench/partition.py --pipeline-only",
    "partition_pipeline_testbed": "python bench/partition.py --pipeline-testbed",
    "gateway_sandbox": "python bench/gateway_sandbox.py",
    "controller_kubernetes": "python bench/controller.py --kubernetes",
    "partition_pipesplit": "python bench/partition.py --pipeline-splits",
}
#: What each benchmark puts side by side (its result file says how, on what and under which load).
COMPARES = {
    "controller": "submit to every replica running, local backend vs TorchX local_cwd and a bare Popen floor; "
    "queue drain; kill to replacement",
    "controller_ray": "the Ray backend on 1 and 3 Ray nodes; node loss",
    "controller_failover": "two servers on one PostgreSQL, the leader killed: time to a new leader",
    "controller_containers": "replicas in podman containers vs on the host",
    "controller_kubernetes": (
        "operator mode on a real cluster: submit to every pod Running vs a batch/v1 Job (the operator out of "
        "the cluster; `--operator deployment`: the Deployment of `trainmaster cluster manifests`)"
    ),
    "scale": "Kueue's 15,000-workload test replayed on hollow nodes; 10,000 real jobs; drain; API latency",
    "soak": "30 minutes of mixed jobs with SIGKILLs of server and agent and PostgreSQL restarts",
    "aggregation": "in-network aggregation vs gloo's ring all-reduce over rate-capped links",
    "aggregation_tenants": "jobs sharing one aggregation switch's slots",
    "aggregation_training": "DDP training with in-network aggregation vs gloo",
    "flsched": "simulated-annealing device scheduling vs MILP, greedy, Oort, FedCS and others, held-out seeds",
    "partition": "our partitioner vs METIS and KaHIP: cut critical edges, balance, time",
    "partition_fresh": "the same on graphs drawn at run time (seeds nobody tuned on)",
    "partition_pipeline_testbed": "predicted vs measured pipeline step time, stages on separate testbed hosts",
    "partition_pipeline": "predicted vs measured pipeline step time on real models",
    "partition_pipesplit": "our pipeline split vs equal-layers and equal-parameters splits, stages on testbed hosts",
    "gateway": "tasks through the gateway vs straight to the parties: latency, throughput, large results",
    "gateway_sandbox": "executor isolation cost: sandbox vs plain process",
    "gateway_storm": "10,000 tasks while the gateway and parties are SIGKILLed: every leg once, none lost",
}
VERDICT = re.compile(r"\b(not met|met)\b", re.IGNORECASE)


def verdicts(text: str) -> str:
    """How many goal verdicts ``text`` states met and not met, as the result file words them."""
    found = [m.group(1).lower() for m in VERDICT.finditer(text)]
    if not found:
        return "-"
    return f"{found.count('met')} met, {found.count('not met')} not met"


def row(name: str) -> str:
    table = ROOT / "bench" / "results" / f"{name}.md"
    command = COMMAND.get(name, f"python bench/{name}.py")
    if not table.is_file():
        return f"| {name} | {COMPARES.get(name, '')} | `{command}` | no results yet | - |"
    plots = ", ".join(
        f"[{png.stem}](bench/results/{png.name})"
        for png in sorted((ROOT / "bench" / "results").glob(f"{name}*.png"))
        if png.stem.split("-")[0] == name
    )
    link = f"[{name}.md](bench/results/{name}.md)"
    return (
        f"| {name} | {COMPARES.get(name, '')} | `{command}` | {link} ({verdicts(table.read_text())}) | {plots or '-'} |"
    )


def main() -> None:
    readme = ROOT / "README.md"
    head = readme.read_text().split(MARKER)[0]
    lines = [
        "| benchmark | compares | command | results (goal verdicts stated) | plots |",
        "|---|---|---|---|---|",
        *(row(name) for name in ORDER),
    ]
    readme.write_text(head + MARKER + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
