"""``mpi``: MPI jobs (Kubeflow MPIJob semantics) where ``mpirun`` really starts ranks in the workers.

Roles ``launcher`` (one instance) and ``worker``. As the MPI operator runs an SSH server in each
worker pod, every worker instance runs a *rank host* by default
(:mod:`trainmaster.frameworks.mpi_rsh`) that runs commands for ``mpirun`` inside the instance.
The launcher starts once every worker runs and gets:

* a hostfile naming each worker ``<job>-worker-<i>`` with its slots
  (``frameworkParams.slotsPerWorker``, default 1) in the format of
  ``frameworkParams.mpiImplementation``: OpenMPI ``host slots=N``, Intel MPI and MPICH ``host:N``,
  as the operator writes them; its path in ``TM_HOSTFILE`` and in the implementation's own
  variable (``OMPI_MCA_orte_default_hostfile``, ``I_MPI_HYDRA_HOST_FILE``, ``HYDRA_HOST_FILE``);
* the remote-shell agent that reaches those names (``OMPI_MCA_plm_rsh_agent``,
  ``I_MPI_HYDRA_BOOTSTRAP_EXEC`` or ``HYDRA_LAUNCHER_EXEC``): a script running
  ``python -m trainmaster.frameworks.mpi_rsh``, with the name -> address map in ``TM_MPI_HOSTS``;
* OpenMPI settings a local run needs: no tree spawn (only the launcher knows the map), TCP over
  the loopback interface when every worker is on 127.0.0.1 (OpenMPI leaves ``lo`` out by default),
  and, as root, ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)`` (the operator's images run as a user).

So a plain ``mpirun python train.py`` in the launcher runs ``replicas x slotsPerWorker`` ranks, in
the worker instances. The job succeeds when the launcher succeeds.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.frameworks.mpi_rsh import HOSTS_VARIABLE, KEY_VARIABLE, job_key
from trainmaster.spec.model import Job, Role, RoleSelector, StatusPolicy

LOOPBACK = ("127.", "localhost", "::1")


class MPIFramework(Framework):
    name = "mpi"
    role_names = ("launcher", "worker")
    required_roles = ("launcher", "worker")
    default_dependencies = {"launcher": ("worker",)}
    single_instance_roles = ("launcher",)
    port_roles = {"worker": " (its rank host listens there for mpirun)"}

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        if role.name == "worker":  # the part the SSH server plays in the operator's worker pods
            return [sys.executable, "-m", "trainmaster.frameworks.mpi_rsh", "serve"]
        return None

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=["launcher"]))
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        # `python` in mpirun's command line (run by the rank host's shell) is the interpreter
        # Trainmaster runs under, as a role command's own `python` is
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
        env = {KEY_VARIABLE: job_key(ctx.output_dir or "."), "PATH": path}
        if ctx.role != "launcher":
            return env
        workers = ctx.services.get("worker", [])
        names = [worker_name(ctx.job_name, i) for i in range(len(workers))]
        implementation = str(ctx.params.get("mpiImplementation", "OpenMPI"))
        folder = Path(ctx.output_dir or ".").parent / "mpi"
        folder.mkdir(parents=True, exist_ok=True)
        hostfile = folder / f"hostfile-{ctx.index}"
        hostfile.write_text(hostfile_text(names, int(ctx.params.get("slotsPerWorker", 1)), implementation))
        agent = folder / "rsh-agent"
        agent.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m trainmaster.frameworks.mpi_rsh "$@"\n')
        agent.chmod(0o755)
        env.update(
            {
                "TM_HOSTFILE": str(hostfile),
                "TM_WORKER_ADDRESSES": ",".join(workers),
                HOSTS_VARIABLE: ",".join(f"{n}={a}" for n, a in zip(names, workers)),
            }
        )
        if implementation == "OpenMPI":
            env.update(
                {
                    "OMPI_MCA_orte_default_hostfile": str(hostfile),
                    "OMPI_MCA_plm_rsh_agent": str(agent),
                    "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
                }
            )
            if workers and all(w.startswith(LOOPBACK) for w in workers):
                env.update({"OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"})
            if os.geteuid() == 0:
                env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        elif implementation == "Intel":
            env.update(
                {
                    "I_MPI_HYDRA_HOST_FILE": str(hostfile),
                    "I_MPI_HYDRA_BOOTSTRAP": "rsh",
                    "I_MPI_HYDRA_BOOTSTRAP_EXEC": str(agent),
                }
            )
        else:  # MPICH
            env.update({"HYDRA_HOST_FILE": str(hostfile), "HYDRA_LAUNCHER": "rsh", "HYDRA_LAUNCHER_EXEC": str(agent)})
        return env


def worker_name(job_name: str, index: int) -> str:
    """A worker's host name in the hostfile: its pod's name under the MPI operator."""
    return f"{job_name}-worker-{index}"


def hostfile_text(hosts: list[str], slots: int, implementation: str) -> str:
    """The launcher's hostfile: one line per worker, in the format the MPI implementation reads."""
    if implementation == "OpenMPI":
        return "".join(f"{host} slots={slots}\n" for host in hosts)
    return "".join(f"{host}:{slots}\n" for host in hosts)
