"""Framework registry: resolve a job's framework id to a :class:`Framework` instance.

Resolution order: a built-in id, a third-party id from the ``trainmaster.frameworks``
entry-point group, a module path ``pkg.module:Class``, or a Python file ``path/to/fw.py``
(optionally ``path/to/fw.py:Class``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext
from trainmaster.spec.model import Job

BUILTIN: dict[str, str] = {
    "command": "trainmaster.frameworks.command:CommandFramework",
    "pytorch": "trainmaster.frameworks.pytorch:PyTorchFramework",
    "mpi": "trainmaster.frameworks.mpi:MPIFramework",
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
        found = [v for v in vars(obj).values()
                 if inspect.isclass(v) and issubclass(v, Framework) and v is not Framework
                 and v.__module__ == obj.__name__]
        if len(found) != 1:
            raise UnknownFramework(f"{origin} must define exactly one Framework subclass "
                                   f"(found {len(found)}); name it as '{origin}:ClassName'")
        obj = found[0]
    if inspect.isclass(obj) and issubclass(obj, Framework):
        return obj()
    if isinstance(obj, Framework):
        return obj
    raise UnknownFramework(f"{origin} is not a trainmaster Framework")


@cache
def get_framework(framework_id: str) -> Framework:
    """The framework named by ``framework_id``; :class:`UnknownFramework` if none."""
    if framework_id in BUILTIN:
        return _as_framework(_load_object(BUILTIN[framework_id]), framework_id)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == framework_id:
            return _as_framework(ep.load(), framework_id)
    path_part, _, attr = framework_id.partition(".py:")
    if framework_id.endswith(".py") or attr:
        path = Path(framework_id if framework_id.endswith(".py") else path_part + ".py")
        if not path.is_file():
            raise UnknownFramework(f"framework file {path} does not exist")
        return _as_framework(_load_file(path.resolve(), attr or None), framework_id)
    if ":" in framework_id or "." in framework_id:
        try:
            return _as_framework(_load_object(framework_id), framework_id)
        except (ImportError, AttributeError) as exc:
            raise UnknownFramework(f"cannot load '{framework_id}': {exc}") from None
    known = sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    raise UnknownFramework(f"unknown framework '{framework_id}' (built in: {', '.join(known)}; "
                           "or give a module path 'pkg.module:Class' or a .py file)")


def framework_errors(spec: dict[str, Any], raw_roles: list[dict[str, Any]]) -> list[str]:
    """Validation lines for the job's framework: unknown id, or the framework's own checks."""
    framework_id = spec.get("framework", "command")
    if not isinstance(framework_id, str):
        return []  # the structural pass reports the type error
    try:
        framework = get_framework(framework_id)
    except UnknownFramework as exc:
        return [f"spec.framework: {exc}"]
    except Exception as exc:  # a user's framework module that fails to import
        return [f"spec.framework: loading '{framework_id}' failed: {type(exc).__name__}: {exc}"]
    errors = framework.validate(spec, raw_roles)
    for i, role in enumerate(raw_roles):
        if role.get("command") is None and not _framework_has_command(framework, role.get("name")):
            errors.append(f"spec.roles[{i}].command: required (framework '{framework_id}' "
                          f"has no built-in code for role '{role.get('name')}')")
    return errors


def _framework_has_command(framework: Framework, role_name: Any) -> bool:
    return type(framework).role_command is not Framework.role_command and (
        framework.role_names is None or role_name in framework.role_names)


def apply_defaults(job: Job) -> Job:
    """The job with its framework's defaults filled in."""
    return get_framework(job.spec.framework).defaults(job)


__all__ = ["BUILTIN", "Framework", "InstanceContext", "UnknownFramework", "apply_defaults",
           "framework_errors", "get_framework"]
