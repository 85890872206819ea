"""What the controller hands a node agent for one attempt: the one place a :class:`LaunchSpec`
is built (and, without dependencies, where the instance's environment is resolved), for a
running job and for a dry run (:func:`planned_launches`)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from trainmaster.backends.base import Placement, PlacementRequest, Resources
from trainmaster.contract import Dependency, LaunchSpec
from trainmaster.containers.policy import container_launch, runs_in_container
from trainmaster.runtime.environment import instance_environment
from trainmaster.spec.model import Job, Role
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
    container = container_launch(job.run_dir, role) if containers and runs_in_container(spec.spec, role) else None
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


def dependency_order(spec: Job) -> list[Role]:
    """Roles with no dependencies first, then each role after those it depends on."""
    done: list[Role] = []
    names: set[str] = set()
    remaining = list(spec.spec.roles)
    while remaining:
        ready = [r for r in remaining if all(d.role in names for d in r.depends_on)] or remaining[:1]
        for role in ready:
            done.append(role)
            names.add(role.name)
            remaining.remove(role)
    return done


def planned_launches(
    spec: Job, run_dir: str, db_url: str, containers: bool, place: Callable[[PlacementRequest], Placement]
) -> list[LaunchSpec]:
    """The :class:`LaunchSpec` of each instance's first attempt, in start order, as
    :func:`launch_spec` builds them once the job is admitted (a dry run: nothing is stored or
    started). The job is taken as stored with id 0 in ``run_dir``; ``place`` stands for the
    backend's placement; the instances inherit no environment (a controller adds its own at
    launch). ``run_dir`` should be a scratch folder: frameworks and containers prepare files
    there as they would for the job."""
    job = JobRow(id=0, uid="dry-run", name=spec.name, run_dir=run_dir)
    launches = []
    for role in dependency_order(spec):
        need = Resources(role.resources.cpu, role.resources.memory_bytes, role.resources.gpu)
        for index in range(role.replicas):
            inst = InstanceRow(role=role.name, index=index, attempt=1)
            placement = place(
                PlacementRequest(role.name, role.ports, need, tuple(role.container_ports), spec.metadata.annotations)
            )
            launches.append(
                launch_spec(
                    job,
                    spec,
                    inst,
                    placement,
                    {},
                    db_url,
                    os.path.join(run_dir, "logs", f"{inst.label}.log"),
                    os.path.join(run_dir, "instances", inst.label),
                    containers,
                )
            )
    return launches
