"""``pytorch``: torch.distributed jobs (Kubeflow PyTorchJob semantics).

Roles ``master`` (one instance, rank 0, whose first port is the rendezvous port) and ``worker``
(ranks 1..N). Every instance gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, the
``PET_*`` variables torchrun reads (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``) and, with one process per instance, ``LOCAL_RANK``;
``frameworkParams.nprocPerNode`` (a PyTorchJob's ``nprocPerNode``) makes ``WORLD_SIZE`` nodes x
nproc. Workers depend on the master, and the job succeeds when the master succeeds.
"""

from __future__ import annotations

from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.spec.model import Job, StatusPolicy


class PyTorchFramework(Framework):
    name = "pytorch"
    role_names = ("master", "worker")
    required_roles = ("master",)
    default_dependencies = {"worker": ("master",)}
    single_instance_roles = ("master",)
    port_roles = {"master": " for rendezvous"}

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(preset="kubeflow")
        return job

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        params = spec.get("frameworkParams")
        nproc = params.get("nprocPerNode", 1) if isinstance(params, dict) else 1
        if not isinstance(nproc, int) or isinstance(nproc, bool) or not 1 <= nproc <= 1024:
            errors.append("spec.frameworkParams.nprocPerNode: must be an integer from 1 to 1024")
        return errors

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        if ctx.role == "master":
            master, rank = ctx.address, 0
        else:
            master, rank = ctx.services["master"][0], ctx.role_replicas.get("master", 0) + ctx.index
        host, _, port = master.rpartition(":")
        nodes = ctx.role_replicas.get("master", 0) + ctx.role_replicas.get("worker", 0)
        nproc = int(ctx.params.get("nprocPerNode", 1))
        env = {
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
            "WORLD_SIZE": str(nodes * nproc),
            "RANK": str(rank),
            # torchrun reads its arguments from PET_* (as the Kubeflow operator sets them), so a
            # bare `torchrun script.py` starts nprocPerNode processes in a world of nodes x nproc
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": host,
            "PET_MASTER_PORT": port,
        }
        if nproc == 1:  # the instance is the training process itself
            env.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank)})
        return env
