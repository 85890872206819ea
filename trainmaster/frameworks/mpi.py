"""``mpi``: an MPI/Horovod-style job (Kubeflow MPIJob semantics) without an MPI runtime.

Roles ``launcher`` (one instance) and ``worker``. The launcher depends on every worker having an
address and gets a hostfile (``OMPI_MCA_orte_default_hostfile`` and ``TM_HOSTFILE``) listing
them, one ``host slots=1`` line per worker, and ``TM_WORKER_ADDRESSES``; the job succeeds when
the launcher succeeds.
"""

from __future__ import annotations

from pathlib import Path

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.spec.model import Job, RoleSelector, StatusPolicy


class MPIFramework(Framework):
    name = "mpi"
    role_names = ("launcher", "worker")
    required_roles = ("launcher", "worker")
    default_dependencies = {"launcher": ("worker",)}

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=["launcher"]))
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        if ctx.role != "launcher":
            return {}
        workers = ctx.services.get("worker", [])
        hostfile = Path(ctx.output_dir or ".") / f"hostfile-{ctx.index}"
        hostfile.parent.mkdir(parents=True, exist_ok=True)
        hostfile.write_text("".join(f"{w.rpartition(':')[0]} slots=1\n" for w in workers))
        return {"TM_HOSTFILE": str(hostfile), "OMPI_MCA_orte_default_hostfile": str(hostfile),
                "TM_WORKER_ADDRESSES": ",".join(workers)}
