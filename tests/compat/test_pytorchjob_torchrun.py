"""Mechanisms: a Kubeflow PyTorchJob's environment as the training operator sets it. With
``nprocPerNode: 2`` and 2 replicas, a bare ``torchrun script.py`` (no arguments: torchrun reads
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) starts 4 ranks
in one world: the script asserts WORLD_SIZE 4 and a gloo all-reduce sums every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from controller_harness import run_job_file, run_logs

SCRIPT = """
import os
import torch
import torch.distributed as dist

assert os.environ["WORLD_SIZE"] == "4", os.environ["WORLD_SIZE"]
dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
assert value.item() == 10.0, value.item()  # 1 + 2 + 3 + 4
print(f"rank {rank} of {dist.get_world_size()}: all_reduce sum = {value.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def replica(replicas: int, script: Path) -> dict:
    return {
        "replicas": replicas,
        "restartPolicy": "Never",
        "template": {
            "spec": {
                "containers": [{"name": "pytorch", "image": "pytorch/pytorch", "command": ["torchrun", str(script)]}]
            }
        },
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bare_torchrun_runs_replicas_times_nproc_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "torchrun-2x2"},
        "spec": {
            "nprocPerNode": 2,
            "pytorchReplicaSpecs": {"Master": replica(1, script), "Worker": replica(1, script)},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    # `torchrun` is the console script next to this interpreter, as in the training image
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc, status = run_job_file(path, tmp_path, timeout=220)
    logs = run_logs(tmp_path)
    assert proc.returncode == 0 and status["state"] == "succeeded", proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    for rank in range(4):
        assert f"rank {rank} of 4: all_reduce sum = 10" in logs, logs
