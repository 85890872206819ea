"""Mechanisms: a Kubeflow MPIJob with real OpenMPI. 2 workers x 2 slots (slotsPerWorker): the
launcher, started once both workers run, gets an OpenMPI hostfile (``<job>-worker-<i> slots=2``)
and the rsh agent (``OMPI_MCA_plm_rsh_agent``); a plain ``mpirun python script.py`` starts 4 ranks
through the workers' rank hosts, so each rank runs inside a worker instance (its TM_ROLE and
TM_REPLICA_INDEX are the worker's, two ranks per worker), and an mpi4py allreduce checks its sum.
Skips, saying why, only where mpirun (Debian openmpi-bin) or mpi4py is missing."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from controller_harness import PY, Harness

SCRIPT = """
import json, os
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1)
assert total == 10, total  # 1 + 2 + 3 + 4
record = {"rank": comm.Get_rank(), "size": comm.Get_size(), "sum": total, "role": os.environ.get("TM_ROLE"),
          "worker": os.environ.get("TM_REPLICA_INDEX"), "host": MPI.Get_processor_name()}
with open(os.path.join(os.environ["OUT"], f"rank-{comm.Get_rank()}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {comm.Get_rank()} of {comm.Get_size()}: allreduce sum = {total}", flush=True)
"""


def missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found: install Debian's openmpi-bin (make system-deps)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e .[mpi])"
    return None


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
@pytest.mark.timeout(240)
def test_mpirun_starts_ranks_in_the_worker_instances(tmp_path: Path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    out = tmp_path / "ranks"
    out.mkdir()

    def replica(replicas: int, command: list[str]) -> dict:
        return {
            "replicas": replicas,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "mpi",
                            "image": "mpioperator/openmpi",
                            "command": command,
                            "env": [{"name": "OUT", "value": str(out)}],
                        }
                    ]
                }
            },
        }

    doc = {
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": {"name": "allreduce"},
        "spec": {
            "slotsPerWorker": 2,
            "mpiImplementation": "OpenMPI",
            "mpiReplicaSpecs": {
                "Launcher": replica(1, ["mpirun", "-x", "OUT", PY, str(script)]),
                "Worker": replica(2, ["/usr/sbin/sshd", "-De"]),
            },
        },
    }
    h = Harness(tmp_path)
    try:
        job_id = h.submit(doc)
        state = h.controller.run_job(job_id)
        status = h.status(job_id)
    finally:
        h.backend.close()
    logs = Path(status["runDir"]) / "logs"
    launcher_log = (logs / "launcher-0.log").read_text()
    assert state == "succeeded", launcher_log[-3000:]
    hostfile = (Path(status["runDir"]) / "mpi" / "hostfile-0").read_text()
    assert hostfile == "allreduce-worker-0 slots=2\nallreduce-worker-1 slots=2\n"
    ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(ranks) == [0, 1, 2, 3], launcher_log[-3000:]
    for rank, record in ranks.items():
        assert record["size"] == 4 and record["sum"] == 10
        assert record["role"] == "worker"  # started by mpirun inside a worker instance, not the launcher
        assert record["worker"] == str(rank // 2)  # by slot: ranks 0-1 on worker 0, 2-3 on worker 1
        assert f"rank {rank} of 4: allreduce sum = 10" in launcher_log
    for index in (0, 1):  # each worker's rank host ran mpirun's daemon (orted)
        assert "rank host runs:" in (logs / f"worker-{index}.log").read_text()
