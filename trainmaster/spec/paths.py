"""Where a job's paths (``workingDir``, ``output.path``) may point, and what they are relative to.

A submitted job runs with the server's rights, so the paths it names are confined: a relative
path resolves against the job's own folder (its run directory, ``<runs>/<id>-<name>``), never
against the server's working directory, and may not climb out of it with ``..``; an absolute
path is accepted only under a directory the operator allowed (``--allow-path``). ``trainmaster
run`` runs the user's own job with the user's rights: there relative paths resolve against the
directory the command runs in, which is also allowed for absolute paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmaster.spec.model import Job


@dataclass(frozen=True)
class PathPolicy:
    """The operator's rule for job paths.

    ``base``: the directory relative paths resolve against, or None for the job's run folder
    (known only once the job is stored). ``allowed_roots``: directories absolute paths may be in.
    """

    base: Path | None = None
    allowed_roots: tuple[Path, ...] = ()

    @classmethod
    def for_command_line(cls, extra_roots: list[Path] | None = None) -> "PathPolicy":
        """``trainmaster run``/``validate``: relative to, and allowed under, the current directory."""
        cwd = Path.cwd()
        return cls(base=cwd, allowed_roots=(cwd, *(extra_roots or [])))

    def roots(self) -> tuple[str, ...]:
        return tuple(os.path.normpath(os.path.abspath(root)) for root in self.allowed_roots)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def path_problem(value: str, policy: PathPolicy) -> str | None:
    """Why ``value`` may not be used under ``policy``, or None when it may."""
    if value.startswith("~"):
        return "'~' is not expanded; give a path relative to the job's folder"
    if os.path.isabs(value):
        normal = os.path.normpath(value)
        if any(_inside(normal, root) for root in policy.roots()):
            return None
        allowed = ", ".join(policy.roots()) or "none"
        return (
            f"absolute path {value!r} is outside the directories the operator allows "
            f"(allowed: {allowed}); give a path relative to the job's folder, or ask the "
            "operator to allow its directory (--allow-path)"
        )
    normal = os.path.normpath(value)
    if normal == ".." or normal.startswith("../"):
        return f"{value!r} climbs out of the job's folder with '..'; give a path inside it"
    return None


def path_errors(raw: dict[str, Any], policy: PathPolicy) -> list[str]:
    """``field.path: reason`` lines for every job path ``policy`` refuses; reads the raw document
    so that these are reported together with every other problem (wrong types are left to the
    structural pass)."""
    spec: dict[str, Any] = raw["spec"] if isinstance(raw.get("spec"), dict) else {}
    found: list[tuple[str, Any]] = []
    output = spec.get("output")
    if isinstance(output, dict):
        found.append(("spec.output.path", output.get("path")))
    roles = spec.get("roles")
    for i, role in enumerate(roles if isinstance(roles, list) else []):
        if isinstance(role, dict):
            found.append((f"spec.roles[{i}].workingDir", role.get("workingDir")))
            volumes = role.get("volumes")
            for j, volume in enumerate(volumes if isinstance(volumes, list) else []):
                if isinstance(volume, dict):  # a bind mount: confined as any other job path
                    found.append((f"spec.roles[{i}].volumes[{j}].hostPath", volume.get("hostPath")))
    errors = []
    for where, value in found:
        if isinstance(value, str) and "\x00" not in value:
            problem = path_problem(value, policy)
            if problem:
                errors.append(f"{where}: {problem}")
    return errors


def anchored(job: Job, policy: PathPolicy) -> Job:
    """``job`` with its relative paths made absolute against ``policy.base`` (unchanged when the
    base is the job's run folder: the controller anchors them once the folder exists)."""
    if policy.base is None:
        return job
    job = job.model_copy(deep=True)
    if job.spec.output is not None:
        job.spec.output.path = str(policy.base / job.spec.output.path)
    for role in job.spec.roles:
        if role.working_dir is not None:
            role.working_dir = str(policy.base / role.working_dir)
        for volume in role.volumes:
            if volume.host_path is not None:
                volume.host_path = str(policy.base / volume.host_path)
    return job


def in_job_folder(run_dir: str, path: str | None) -> str | None:
    """A job path as the controller uses it: absolute ones as they are, relative ones inside the
    job's run folder (what a submitted job's ``workingDir`` and ``output.path`` mean)."""
    if path is None:
        return None
    return os.path.normpath(os.path.join(run_dir, path))


def job_working_dir(run_dir: str, working_dir: str | None) -> str | None:
    """An instance's working directory: a relative ``workingDir`` is a folder of the job's own,
    created on first use; an absolute one (allowed by the operator) must exist already."""
    path = in_job_folder(run_dir, working_dir)
    if path is not None and working_dir is not None and not os.path.isabs(working_dir):
        Path(path).mkdir(parents=True, exist_ok=True)
    return path
