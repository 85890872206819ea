"""Which roles run in containers, what they mount, and the refusal when no runtime is here.

The rule (one place): a role's ``runtime``, else its job's, else ``host``. ``container`` always
runs the role's image; ``auto`` (converted Kubeflow/Volcano files) is the operator's choice
(``--runtime``, :func:`pin_auto_roles` when the job is loaded) where one is made, else runs it
when a container runtime is present, and on the host when none is and the role gives a command. A role that
needs a container where none can run is refused at load time, saying how to install a runtime
or how to run on the host instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from trainmaster.agent.contract import ContainerLaunch
from trainmaster.containers.runtime import unavailable
from trainmaster.spec.model import Job, JobSpec, Role, RuntimeKind
from trainmaster.spec.paths import in_job_folder, job_working_dir


CONTAINER_BACKENDS = ("local", "ray", "testbed")  # whose node agents run LaunchSpec.container


def pin_auto_roles(job: Job, operator: RuntimeKind | None) -> Job:
    """``job`` with each ``auto`` role that names an image pinned to the operator's choice
    (``trainmaster run|server --runtime host|container``), so every later step (framework
    defaults, the refusal, the launch) and the stored job say the same; unchanged without one."""
    if operator in (None, RuntimeKind.AUTO):
        return job
    job = job.model_copy(deep=True)
    for role in job.spec.roles:
        if role.image is not None and (role.runtime or job.spec.runtime) == RuntimeKind.AUTO:
            role.runtime = operator
    return job


def resolved_runtime(spec: JobSpec, role: Role, backend_runs_containers: bool = True) -> RuntimeKind:
    """HOST or CONTAINER for ``role``: its ``runtime``, else its job's, else host; ``auto`` (no
    operator's choice pinned it when loaded) is a container where a runtime is present (and the
    backend runs containers) or where the role gives no command (it runs its image's entry
    point), else the host."""
    kind = role.runtime or spec.runtime or RuntimeKind.HOST
    if role.image is None:
        return RuntimeKind.HOST
    if kind == RuntimeKind.AUTO:
        present = backend_runs_containers and unavailable() == ""
        kind = RuntimeKind.CONTAINER if role.command is None or present else RuntimeKind.HOST
    return kind


def runs_in_container(spec: JobSpec, role: Role, backend_runs_containers: bool = True) -> bool:
    return resolved_runtime(spec, role, backend_runs_containers) == RuntimeKind.CONTAINER


def container_problems(job: Job, backend: str = "local") -> list[str]:
    """``spec.roles[i] (name): why`` for each role this machine (and ``backend``) cannot run
    as asked: one that runs in a container where no runtime is (or on a backend whose agents
    do not run containers), or one that runs on the host with no command."""
    problems = []
    backend_runs = backend in CONTAINER_BACKENDS
    for i, role in enumerate(job.spec.roles):
        where = f"spec.roles[{i}] ({role.name})"
        if runs_in_container(job.spec, role, backend_runs):
            why = (
                unavailable()
                if backend_runs
                else (
                    f"the {backend} backend does not run containers (the local, Ray and testbed backends do); "
                    "run it with --backend local, or on the host with 'runtime: host' and a command"
                )
            )
            if why:
                what = (
                    "runs in a container"
                    if role.command is not None
                    else "gives no command, so it runs its image's entry point in a container"
                )
                problems.append(
                    f"{where}: {what} from image '{role.image}', but {why}"
                    + ("" if role.command is not None else " (and give the role a command)")
                )
        elif role.command is None and role.image is not None:
            problems.append(
                f"{where}: gives no command, so it runs its image's entry point, but it runs on "
                f"the host (runtime: host, or the operator's --runtime host); run it in a container "
                "or give it a command"
            )
    return problems


def container_launch(run_dir: str, role: Role, framework_mounts: list[dict[str, Any]] | None = None) -> ContainerLaunch:
    """The container of one instance of ``role``: the job's folder is mounted at its own path
    (so the job's files, its output folder and ``workingDir`` are where the role expects
    them); ``emptyDir`` volumes are folders of the job's; ``hostPath`` ones are relative to
    the job's folder, or absolute paths the operator allowed when the job was loaded; then
    ``framework_mounts``, what the job's framework mounts at fixed paths."""
    mounts = [{"source": run_dir, "target": run_dir, "read_only": False}]
    working_dir = job_working_dir(run_dir, role.working_dir) if role.working_dir else None
    if working_dir:  # a bind mount's source must exist; the folder is the job's
        Path(working_dir).mkdir(parents=True, exist_ok=True)
    if working_dir and not _inside(working_dir, run_dir):
        mounts.append({"source": working_dir, "target": working_dir, "read_only": False})
    for volume in role.volumes:
        if volume.empty_dir:
            source = str(Path(run_dir) / "volumes" / role.name / volume.name)
            Path(source).mkdir(parents=True, exist_ok=True)
        else:
            assert volume.host_path is not None
            source = in_job_folder(run_dir, volume.host_path) or volume.host_path
        mounts.append({"source": source, "target": volume.mount_path, "read_only": volume.read_only})
    mounts += framework_mounts or []  # the framework's own (Framework.container_mounts)
    return ContainerLaunch(
        image=role.image or "",
        command=role.command,
        args=role.args or None,
        working_dir=working_dir,
        mounts=mounts,
        pull_policy=role.image_pull_policy.value,
    )


def _inside(path: str, root: str) -> bool:
    path, root = os.path.normpath(path), os.path.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


#: Files Volcano's svc plugin mounts in every pod of a job that uses it.
_VOLCANO_FILE = re.compile(r"/etc/volcano(?:/[A-Za-z0-9_.-]*)?")


def host_file_reads(job: Job) -> list[str]:
    """``spec.roles[i] (name): what`` for each role that runs on the host (``runtime: host``, the
    operator's ``--runtime host``, or ``auto`` where no container runtime is) but whose command
    reads a file Volcano's svc plugin mounts at ``/etc/volcano``: there it would read this
    machine's ``/etc/volcano`` (another job's, or nothing), not its own job's. In a container the
    folder is mounted there (:meth:`CommandFramework.container_mounts`)."""
    found = []
    for i, role in enumerate(job.spec.roles):
        if runs_in_container(job.spec, role):
            continue
        read = sorted(set(_VOLCANO_FILE.findall(" ".join([*(role.command or []), *role.args]))))
        if read:
            copies = ", ".join(path.replace("/etc/volcano", "$VC_HOSTS_DIR", 1) for path in read)
            found.append(
                f"spec.roles[{i}] ({role.name}): its command reads {', '.join(read)}, which Volcano's svc "
                f"plugin mounts in a container; on the host the job's copy is {copies}"
            )
    return found
