"""Framework registry: resolve a job's framework id to a :class:`Framework` instance.

A job file is data from whoever may submit jobs, so it must never make the controller import
code. A framework id therefore resolves only to

* a built-in framework (:data:`BUILTIN`),
* a framework installed as a package, through the ``trainmaster.frameworks`` entry-point group,
* or an entry of the operator's allow-list (:class:`FrameworkAllowList`): ``ID=TARGET`` where
  TARGET is a module path ``pkg.module:Class`` or a file ``path/to/fw.py[:Class]``, or a bare
  TARGET that jobs then name as their framework (the spec's "address" of a user's framework).

The allow-list travels in the ``TRAINMASTER_FRAMEWORKS`` environment variable (comma-separated
entries) because the instance processes, which resolve the framework again to build their
environment, inherit the controller's environment; ``--allow-framework`` on ``run``, ``server``
and ``validate`` adds to it. An id that is none of these is refused without importing anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.spec.model import MAX_FRAMEWORK_ID, Job
from trainmaster.spec.validate import mapping, raw_roles as roles_of

BUILTIN: dict[str, str] = {
    "command": "trainmaster.frameworks.command:CommandFramework",
    "pytorch": "trainmaster.frameworks.pytorch:PyTorchFramework",
    "mpi": "trainmaster.frameworks.mpi:MPIFramework",
    "tensorflow": "trainmaster.frameworks.tensorflow:TensorFlowFramework",
    "pipeline": "trainmaster.frameworks.pipeline:PipelineFramework",
    "crosssilo": "trainmaster.frameworks.crosssilo:CrossSiloFramework",
    "ina": "trainmaster.frameworks.ina:InaFramework",
    "federated": "trainmaster.frameworks.federated:FederatedFramework",
}

ENTRY_POINT_GROUP = "trainmaster.frameworks"


class UnknownFramework(LookupError):
    """The framework id names nothing we can load; the message says what was tried."""


def _load_object(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _load_file(path: Path, attr: str | None) -> Any:
    spec = importlib.util.spec_from_file_location(f"trainmaster_user_framework_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise UnknownFramework(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attr) if attr else module


def _as_framework(obj: Any, origin: str) -> Framework:
    if inspect.ismodule(obj):
        found = [
            v
            for v in vars(obj).values()
            if inspect.isclass(v) and issubclass(v, Framework) and v is not Framework and v.__module__ == obj.__name__
        ]
        if len(found) != 1:
            raise UnknownFramework(
                f"{origin} must define exactly one Framework subclass "
                f"(found {len(found)}); name it as '{origin}:ClassName'"
            )
        obj = found[0]
    if inspect.isclass(obj) and issubclass(obj, Framework):
        return obj()
    if isinstance(obj, Framework):
        return obj
    raise UnknownFramework(f"{origin} is not a trainmaster Framework")


ALLOW_LIST_VARIABLE = "TRAINMASTER_FRAMEWORKS"


@dataclass(frozen=True)
class FrameworkAllowList:
    """The operator's framework ids beyond the installed ones: id -> import target."""

    targets: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, entries: list[str]) -> "FrameworkAllowList":
        """``ID=TARGET`` or ``TARGET`` entries (a ValueError names a malformed one)."""
        targets = []
        for entry in entries:
            entry = entry.strip()
            if not entry:
                continue
            ident, sep, target = entry.partition("=")
            if not sep:
                ident, target = entry, entry
            if not ident.strip() or not target.strip():
                raise ValueError(
                    f"'{entry}' is not ID=TARGET or TARGET (a module 'pkg.mod:Class' or a file 'path/fw.py')"
                )
            targets.append((ident.strip(), target.strip()))
        return cls(tuple(targets))

    @classmethod
    def from_environment(cls) -> "FrameworkAllowList":
        return cls.parse(os.environ.get(ALLOW_LIST_VARIABLE, "").split(","))

    def target(self, framework_id: str) -> str | None:
        return dict(self.targets).get(framework_id)

    def exported(self, entries: list[str]) -> str:
        """The environment value with ``entries`` added (what ``--allow-framework`` sets)."""
        FrameworkAllowList.parse(entries)  # refuse a malformed entry before exporting it
        current = [e for e in os.environ.get(ALLOW_LIST_VARIABLE, "").split(",") if e.strip()]
        return ",".join(current + [e for e in entries if e not in current])


def allow_frameworks(entries: list[str]) -> None:
    """Add operator-approved frameworks for this process and the instances it starts."""
    os.environ[ALLOW_LIST_VARIABLE] = FrameworkAllowList.from_environment().exported(entries)
    get_framework.cache_clear()


def installed_frameworks() -> list[str]:
    """Every id a job may name: built in, installed through entry points, and allow-listed."""
    allowed = [ident for ident, _ in FrameworkAllowList.from_environment().targets]
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(allowed))


@cache
def get_framework(framework_id: str) -> Framework:
    """The framework named by ``framework_id``; :class:`UnknownFramework` if none (nothing is
    imported for an id that is not built in, installed or allow-listed)."""
    if framework_id in BUILTIN:
        return _as_framework(_load_object(BUILTIN[framework_id]), framework_id)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == framework_id:
            return _as_framework(ep.load(), framework_id)
    target = FrameworkAllowList.from_environment().target(framework_id)
    if target is None:
        raise UnknownFramework(
            f"unknown framework '{framework_id}' (installed: "
            f"{', '.join(installed_frameworks())}); a framework of your own must be "
            "installed as a package (entry-point group 'trainmaster.frameworks') "
            "or allowed by the operator (--allow-framework ID=TARGET)"
        )
    return _load_target(target, framework_id)


def _load_target(target: str, framework_id: str) -> Framework:
    path_part, _, attr = target.partition(".py:")
    if target.endswith(".py") or attr:
        path = Path(target if target.endswith(".py") else path_part + ".py")
        if not path.is_file():
            raise UnknownFramework(f"framework file {path} (allowed as '{framework_id}') does not exist")
        return _as_framework(_load_file(path.resolve(), attr or None), framework_id)
    try:
        return _as_framework(_load_object(target), framework_id)
    except (ImportError, AttributeError) as exc:
        raise UnknownFramework(f"cannot load '{target}' (allowed as '{framework_id}'): {exc}") from None


def framework_errors(raw: dict[str, Any]) -> list[str]:
    """Validation lines for the job's framework (unknown id, or the framework's own checks) of
    the raw document ``raw``, which may be malformed: the spec's validation lists them with its
    own (:func:`trainmaster.spec.validate.validate`'s ``checks``)."""
    spec, raw_roles = mapping(raw.get("spec")), roles_of(raw)
    framework_id = spec.get("framework", "command")
    if not isinstance(framework_id, str) or len(framework_id) > MAX_FRAMEWORK_ID:
        return []  # the structural pass reports the type error
    try:
        framework = get_framework(framework_id)
    except UnknownFramework as exc:
        return [f"spec.framework: {exc}"]
    except Exception as exc:  # a user's framework module that fails to import
        return [f"spec.framework: loading '{framework_id}' failed: {type(exc).__name__}: {exc}"]
    errors = framework.validate(spec, raw_roles)
    for i, role in enumerate(raw_roles):
        if not isinstance(role.get("name"), str):
            continue  # the structural pass reports the name
        if (
            role.get("command") is None
            and not role.get("image")
            and not _framework_has_command(framework, role.get("name"))
        ):
            errors.append(
                f"spec.roles[{i}].command: required (framework '{framework_id}' "
                f"has no built-in code for role '{role.get('name')}')"
            )
    return errors


def _framework_has_command(framework: Framework, role_name: Any) -> bool:
    return type(framework).role_command is not Framework.role_command and (
        framework.role_names is None or role_name in framework.role_names
    )


def apply_defaults(job: Job) -> Job:
    """The job with its framework's defaults filled in."""
    return get_framework(job.spec.framework).defaults(job)


__all__ = [
    "BUILTIN",
    "Framework",
    "FrameworkAllowList",
    "allow_frameworks",
    "installed_frameworks",
    "InstanceContext",
    "UnknownFramework",
    "apply_defaults",
    "framework_errors",
    "get_framework",
]
