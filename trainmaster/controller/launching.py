"""What the controller hands a node agent for one attempt: the one place a :class:`LaunchSpec`
is built (and, without dependencies, where the instance's environment is resolved), for a
running job and for a dry run (:func:`planned_launches`)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from trainmaster.backends.base import Placement, PlacementRequest, Resources
from trainmaster.containers.policy import container_launch
from trainmaster.contract import ContainerLaunch, Dependency, LaunchSpec
from trainmaster.frameworks import get_framework
from trainmaster.runtime.environment import host_environment, instance_environment
from trainmaster.spec.model import Job, Role
from trainmaster.spec.paths import job_working_dir
from trainmaster.store.models import InstanceRow, JobRow

INTERPRETERS = ("python", "python3", "python3.11")


@dataclass(frozen=True)
class ChannelGrant:
    """What one attempt gets to reach its controller: the channel's address and its own token."""

    url: str
    token: str


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


@dataclass(frozen=True)
class RoleLaunch:
    """What every instance of one role shares in its launch (:func:`role_launch`), made once per
    role and start instead of once per replica: a 64-replica gang's start built each of these 64
    times on the way from its submit to its first spawn."""

    role: Role
    placement: PlacementRequest  # what each instance asks of the backend
    replicas: dict[str, int]  # every role's replicas (the framework's context)
    output_dir: str
    argv: list[str]  # empty in a container
    environ: dict[str, str]  # the host variables an instance starts with ({} in a container)
    cwd: str | None
    depends: list[Dependency]
    container: ContainerLaunch | None


def role_launch(
    job: JobRow, spec: Job, role: Role, environ: dict[str, str], channel_url: str, containers: bool
) -> RoleLaunch:
    """The part of :func:`launch_spec` every instance of ``role`` shares.

    ``environ`` is the controller's environment: the instance takes only its host variables
    (:func:`~trainmaster.runtime.environment.host_environment`), never the store's URL or a
    token. ``channel_url``: where the instances reach the controller. ``containers``: the
    backend's agents run containers (else every role runs on the host)."""
    depends = [
        Dependency(d.role, d.condition.value, d.timeout_seconds, spec.spec.role(d.role).replicas)
        for d in role.depends_on
    ]
    container = None
    if containers and spec.spec.runs_in_container(role):
        mounts = get_framework(spec.spec.framework).container_mounts(spec.spec.framework_params, job.run_dir)
        container = container_launch(job.run_dir, role, mounts)
    if container is not None and channel_url.startswith("unix://"):  # the channel's folder, so a restarted
        folder = os.path.dirname(channel_url.removeprefix("unix://"))  # controller's new socket shows too
        container = replace(container, mounts=[*container.mounts, {"source": folder, "target": folder}])
    need = Resources(role.resources.cpu, role.resources.memory_bytes, role.resources.gpu)
    return RoleLaunch(
        role=role,
        placement=PlacementRequest(role.name, role.ports, need, tuple(role.container_ports), spec.metadata.annotations),
        replicas={r.name: r.replicas for r in spec.spec.roles},
        output_dir=os.path.join(job.run_dir, "output"),
        argv=[] if container is not None else resolve_argv([*(role.command or []), *role.args]),
        environ={} if container is not None else host_environment(environ),  # a container has its image's
        cwd=job_working_dir(job.run_dir, role.working_dir),
        depends=depends,
        container=container,
    )


def launch_spec(
    job: JobRow,
    spec: Job,
    shared: RoleLaunch,
    inst: InstanceRow,
    placement: Placement,
    channel: ChannelGrant,
    log_path: str,
    instance_dir: str,
) -> LaunchSpec:
    """The typed launch of ``inst``'s current attempt; ``shared``: its role's part
    (:func:`role_launch`). ``channel``: where and as whom the instance reaches the controller.
    Without dependencies the environment is resolved here, in full; with them the wait step
    resolves it with the same function once it knows the addresses it waited for
    (``env_inputs``)."""
    role = shared.role
    context: dict[str, Any] = {
        "job_name": job.name,
        "role": role.name,
        "index": inst.index,
        "replicas": role.replicas,
        "role_replicas": dict(shared.replicas),
        "host": placement.host,
        "ports": placement.ports,
        "params": spec.spec.framework_params,
        "output_dir": shared.output_dir,
        "job_id": job.id,
        "attempt": inst.attempt,
        # the instance's channel to the controller (report, publish, the wait step) and its token
        "channel": channel.url,
        "channel_token": channel.token,
    }
    inputs = {"framework": spec.spec.framework, "context": context, "role_env": dict(role.env)}
    if role.env_fields:  # what a Kubernetes pod would know of itself (see field_values)
        inputs["env_fields"] = {name: path.value for name, path in role.env_fields.items()}
        inputs["pod"] = pod_facts(job, inst)
    depends = list(shared.depends)
    env = dict(shared.environ) if depends else instance_environment({**inputs, "env": shared.environ}, {})
    resources = shared.placement.resources
    return LaunchSpec(
        instance_id=instance_id(job, inst),
        job_id=job.id,
        job_name=job.name,
        role=role.name,
        index=inst.index,
        attempt=inst.attempt,
        argv=list(shared.argv),
        env=env,
        cwd=shared.cwd,
        log_path=log_path,
        instance_dir=instance_dir,
        host=placement.host,
        ports=list(placement.ports),
        cpu=resources.cpu,
        memory=resources.memory,
        gpu=resources.gpu,
        depends=depends,
        env_inputs=inputs,
        container=shared.container,
        annotations=spec.metadata.annotations,
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


#: The channel a dry run shows: the real one is the controller's, its token minted per attempt.
PLANNED_CHANNEL = ChannelGrant(url="unix://<the controller's instance channel>", token="<minted at launch>")


def planned_launches(
    spec: Job, run_dir: str, containers: bool, place: Callable[[PlacementRequest], Placement]
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
        shared = role_launch(job, spec, role, {}, PLANNED_CHANNEL.url, containers)
        for index in range(role.replicas):
            inst = InstanceRow(role=role.name, index=index, attempt=1)
            placement = place(shared.placement)
            launches.append(
                launch_spec(
                    job,
                    spec,
                    shared,
                    inst,
                    placement,
                    PLANNED_CHANNEL,
                    os.path.join(run_dir, "logs", f"{inst.label}.log"),
                    os.path.join(run_dir, "instances", inst.label),
                )
            )
    return launches
