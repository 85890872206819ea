"""``mpi``: an MPI/Horovod-style job (Kubeflow MPIJob semantics) without an MPI runtime.

Roles ``launcher`` (one instance) and ``worker``. The launcher depends on every worker having an
address and gets a hostfile (``OMPI_MCA_orte_default_hostfile`` and ``TM_HOSTFILE``) listing
them, one line per worker with its slots (``frameworkParams.slotsPerWorker``, default 1) in the
format of ``frameworkParams.mpiImplementation`` (OpenMPI ``host slots=N``; Intel MPI and MPICH
``host:N``, as the MPI operator writes them), and ``TM_WORKER_ADDRESSES``; the job succeeds when
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
        hostfile.write_text(hostfile_text(workers, int(ctx.params.get("slotsPerWorker", 1)),
                                          str(ctx.params.get("mpiImplementation", "OpenMPI"))))
        return {"TM_HOSTFILE": str(hostfile), "OMPI_MCA_orte_default_hostfile": str(hostfile),
                "TM_WORKER_ADDRESSES": ",".join(workers)}


def hostfile_text(workers: list[str], slots: int, implementation: str) -> str:
    """The launcher's hostfile: one line per worker ("host:port" addresses), in the format the
    MPI implementation reads."""
    hosts = [w.rpartition(":")[0] or w for w in workers]
    if implementation == "OpenMPI":
        return "".join(f"{host} slots={slots}\n" for host in hosts)
    return "".join(f"{host}:{slots}\n" for host in hosts)
