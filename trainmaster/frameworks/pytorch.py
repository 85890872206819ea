"""``pytorch``: torch.distributed jobs (Kubeflow PyTorchJob semantics).

Roles ``master`` (one instance, rank 0, whose first port is the rendezvous port) and ``worker``
(ranks 1..N). Every instance gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK``; workers depend on the master, and the job succeeds when the master succeeds.
"""

from __future__ import annotations


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

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        if ctx.role == "master":
            master, rank = ctx.address, 0
        else:
            master, rank = ctx.services["master"][0], ctx.role_replicas.get("master", 0) + ctx.index
        host, _, port = master.rpartition(":")
        world = ctx.role_replicas.get("master", 0) + ctx.role_replicas.get("worker", 0)
        return {"MASTER_ADDR": host, "MASTER_PORT": port, "WORLD_SIZE": str(world),
                "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": str(rank)}
