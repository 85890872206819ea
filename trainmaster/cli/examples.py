"""Examples shown at the end of each command's --help, kept as data in one place.

A command whose own docstring already ends with examples is not listed here. Every line is a
command a user can paste from the root of a clone (files from ``examples/``), which is what the
test of every command's help checks for (tests/cli/test_cli_help.py).
"""

from __future__ import annotations

from typing import Any

EXAMPLES: dict[str, tuple[str, ...]] = {
    "version": ("trainmaster version", "trainmaster --version"),
    "partition": (
        "trainmaster partition trainmaster.partition.models:encoder --devices 4 --input-shape 2,16,64",
        "trainmaster partition trainmaster.partition.models:inception --devices 2 --input-shape 1,3,32,32 --json",
        "trainmaster partition trainmaster.partition.models:resnet_like --devices 4 --input-shape 1,3,32,32 "
        "--split-points trainmaster   # torch.distributed.pipelining split points",
    ),
    "job validate": (
        "trainmaster job validate examples/pytorch-digits.yaml",
        "trainmaster job validate examples/kubeflow-tfjob.yaml   # Kubeflow/Volcano files too",
    ),
    "job run": (
        "trainmaster job run examples/pytorch-digits.yaml",
        "trainmaster job run --dry-run examples/volcano-job.yaml   # the job with every default filled in",
        "trainmaster job run examples/kubeflow-pytorchjob.yaml --backend ray",
    ),
    "job resume": ("trainmaster job resume pytorch-digits   # after its `job run` was killed",),
    "job convert": (
        "trainmaster job convert examples/kubeflow-pytorchjob.yaml",
        "trainmaster job convert examples/volcano-job.yaml --json",
    ),
    "job submit": (
        "trainmaster server --detach && trainmaster job submit examples/pytorch-digits.yaml",
        "trainmaster job submit examples/volcano-job.yaml --server http://10.0.0.5:8642",
    ),
    "job list": ("trainmaster job list", "trainmaster job list --json --server http://127.0.0.1:8642"),
    "job status": ("trainmaster job status pytorch-digits", "trainmaster job status 12 --json"),
    "job logs": (
        "trainmaster job logs pytorch-digits --role worker --index 1 --tail 20",
        "trainmaster job logs pytorch-digits -f   # follow until the instance ends",
    ),
    "job cancel": ("trainmaster job cancel pytorch-digits",),
    "job scale": ("trainmaster job scale pytorch-digits worker 3",),
    "job suspend": ("trainmaster job suspend pytorch-digits   # instances stopped, the job held",),
    "job unsuspend": ("trainmaster job unsuspend pytorch-digits   # admitted and started again",),
    "job explain": (
        "trainmaster job explain pytorch-digits   # which quota or capacity it waits for, its position",
        "trainmaster job explain 12 --json --server http://127.0.0.1:8642",
    ),
    "queue create": (
        "trainmaster queue create team-a --cpu 20 --memory 64Gi --cohort org --borrowing-limit cpu=100",
        "trainmaster queue create team-b --cpu 20 --cohort org --lending-limit cpu=10 --weight 2",
        "trainmaster queue create team-a --cpu 40 --replace   # change its quota",
    ),
    "queue list": ("trainmaster queue list", "trainmaster queue list --json --server http://127.0.0.1:8642"),
    "queue show": ("trainmaster queue show team-a   # usage, admitted jobs, waiting jobs in order",),
    "queue delete": ("trainmaster queue delete team-a   # once no job of it is left",),
    "job delete": ("trainmaster job delete pytorch-digits   # an ended job; cancel a running one first",),
    "aggregation demo": (
        "trainmaster aggregation demo --workers 4 --jobs 2 --elements 100000 --drop 0.02 --seed 1",
        "trainmaster aggregation demo --workers 4 --overflow --slots 16 --levels 2 --json",
        "trainmaster aggregation demo --workers 4 --precision int8 --rounds 3 --mtu 1500 --drop 0.01",
    ),
    "aggregation parameter-node": ("trainmaster aggregation parameter-node --port 7000",),
    "aggregation forwarding-node": (
        "trainmaster aggregation forwarding-node --parent 127.0.0.1:7000 --port 7001 --slots 64",
        "trainmaster aggregation forwarding-node --parent 127.0.0.1:7000 --slots 48 --partitions 3",
    ),
    "flsched schedule": (
        "trainmaster flsched schedule examples/flsched-problem.json --scheduler sa --seed 0",
        "trainmaster flsched schedule examples/flsched-problem.json --scheduler greedy --json",
    ),
    "flsched simulate": ("trainmaster flsched simulate --devices 100 --jobs 3 --per-round 10 --scheduler sa --seed 1",),
    "flsched train": ("trainmaster flsched train --scheduler sa --devices 20 --per-round 3 --seed 0",),
    "gateway init": (
        "trainmaster gateway init /tmp/silo --parties a,b --initiators alice",
        "trainmaster gateway init deploy --parties a,b --initiators alice "
        "--hosts gateway=gw.example.org,a=10.0.1.5,b=10.0.1.6",
    ),
    "gateway serve": ("trainmaster gateway serve --config /tmp/silo/gateway/config.yaml",),
    "gateway party serve": (
        "trainmaster gateway party serve --config /tmp/silo/a/config.yaml --data examples/gateway/data/a",
    ),
    "gateway task run": (
        "trainmaster gateway task run --config /tmp/silo/alice/config.yaml examples/gateway/task.yaml",
    ),
}


def add_examples(typer_app: Any, path: tuple[str, ...] = ()) -> None:
    """Give every command registered under ``typer_app`` that has examples here its epilog."""
    for info in typer_app.registered_commands:
        name = info.name or info.callback.__name__.lower().replace("_", "-")
        key = " ".join((*path, name))  # the hidden flat aliases (`run`, `task run`) show their group's
        examples = EXAMPLES.get(key) or EXAMPLES.get(f"job {key}") or EXAMPLES.get(f"gateway {key}")
        if examples and not info.epilog:
            info.epilog = "Examples:\n\n" + "\n\n".join(f"  {line}" for line in examples)
    for group in typer_app.registered_groups:
        add_examples(group.typer_instance, (*path, group.name))
