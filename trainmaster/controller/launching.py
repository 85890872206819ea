"""What the controller hands a node agent for one attempt: the one place a :class:`LaunchSpec`
is built (and, without dependencies, where the instance's environment is resolved)."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

from trainmaster.agent.contract import Dependency, LaunchSpec
from trainmaster.containers.policy import container_launch, runs_in_container
from trainmaster.backends.base import Placement
from trainmaster.frameworks import get_framework
from trainmaster.runtime.environment import instance_environment
from trainmaster.spec.model import Job
from trainmaster.spec.paths import job_working_dir
from trainmaster.store.models import InstanceRow, JobRow

INTERPRETERS = ("python", "python3", "python3.11")


def resolve_argv(argv: list[str]) -> list[str]:
    """``python ...`` runs with the interpreter Trainmaster runs under, so jobs see its packages."""
    if argv and argv[0] in INTERPRETERS:
        return [sys.executable, *argv[1:]]
    return list(argv)


def instance_id(job: JobRow, inst: InstanceRow) -> str:
    """Unique per attempt across the store: ``<job uid>/<role>-<index>/<attempt>``."""
    return f"{job.uid}/{inst.label}/{inst.attempt}"


def pod_facts(job: JobRow, inst: InstanceRow) -> dict[str, str]:
    """The name (Kubeflow's ``<job>-<role>-<index>``) and uid (one per attempt) an instance has
    where a role asks for them as ``metadata.name`` / ``metadata.uid``."""
    return {
        "name": f"{job.name}-{inst.label}",
        "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"trainmaster:{instance_id(job, inst)}")),
    }


def launch_spec(
    job: JobRow,
    spec: Job,
    inst: InstanceRow,
    placement: Placement,
    environ: dict[str, str],
    db_url: str,
    log_path: str,
    instance_dir: str,
    containers: bool = False,
) -> LaunchSpec:
    """The typed launch of ``inst``'s current attempt.

    ``environ`` is the controller's environment, which the instance inherits. Without
    dependencies the environment is resolved here, in full; with them the wait step resolves it
    with the same function once it knows the addresses it waited for (``env_inputs``).
    ``containers``: the backend's agents run containers (else every role runs on the host)."""
    role = spec.spec.role(inst.role)
    context: dict[str, Any] = {
        "job_name": job.name,
        "role": role.name,
        "index": inst.index,
        "replicas": role.replicas,
        "role_replicas": {r.name: r.replicas for r in spec.spec.roles},
        "host": placement.host,
        "ports": placement.ports,
        "params": spec.spec.framework_params,
        "output_dir": os.path.join(job.run_dir, "output"),
        # where trainmaster.report() stores this attempt's metric points
        "job_id": job.id,
        "attempt": inst.attempt,
        "db_url": db_url,
    }
    inputs = {"framework": spec.spec.framework, "context": context, "role_env": dict(role.env)}
    if role.env_fields:  # what a Kubernetes pod would know of itself (see field_values)
        inputs["env_fields"] = {name: path.value for name, path in role.env_fields.items()}
        inputs["pod"] = pod_facts(job, inst)
    depends = [
        Dependency(d.role, d.condition.value, d.timeout_seconds, spec.spec.role(d.role).replicas)
        for d in role.depends_on
    ]
    container = None
    if containers and runs_in_container(spec.spec, role):
        mounts = get_framework(spec.spec.framework).container_mounts(spec.spec.framework_params, job.run_dir)
        container = container_launch(job.run_dir, role, mounts)
    if container is not None:  # the container's environment is its image's plus the instance's, never the host's
        environ = {}
    env = environ if depends else instance_environment({**inputs, "env": environ}, {})
    argv = [] if container is not None else resolve_argv([*(role.command or []), *role.args])
    resources = role.resources
    return LaunchSpec(
        instance_id=instance_id(job, inst),
        job_id=job.id,
        job_name=job.name,
        role=role.name,
        index=inst.index,
        attempt=inst.attempt,
        argv=argv,
        env=env,
        cwd=job_working_dir(job.run_dir, role.working_dir),
        log_path=log_path,
        instance_dir=instance_dir,
        host=placement.host,
        ports=list(placement.ports),
        cpu=resources.cpu,
        memory=resources.memory_bytes,
        gpu=resources.gpu,
        depends=depends,
        db_url=db_url if depends else "",
        env_inputs=inputs,
        container=container,
    )
