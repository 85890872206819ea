"""The Framework interface: a named set of roles and the code each role runs.

A job names its framework by id (``pytorch``), by module path (``pkg.module:Class``) or by a
``.py`` file. The controller asks the framework three things:

* :meth:`Framework.validate` -- problems with the job for this framework (role names, params),
  as ``"field.path: reason"`` lines, reported together with every other validation error;
* :meth:`Framework.defaults` -- the job with the framework's defaults filled in (a role's
  command when the user gave none, the dependencies between its roles, its status policy);
* :meth:`Framework.environment` -- extra environment of one instance, computed once the
  instance's dependencies are satisfied, so addresses of the roles it depends on are known.

Capability libraries never import the controller; a framework module imports its library and
tells the controller how to run it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainmaster.spec.model import Dependency, Job, Role


@dataclass(frozen=True)
class InstanceContext:
    """Everything a framework may use to build one instance's environment."""

    job_name: str
    role: str
    index: int  # replica index within the role
    replicas: int  # replicas of this role
    role_replicas: dict[str, int]  # replicas of every role of the job
    host: str  # the host this instance runs on
    ports: list[int]  # ports reserved for this instance (may be empty)
    services: dict[str, list[str]]  # role -> "host:port" of each of its instances (dependencies)
    params: dict[str, Any] = field(default_factory=dict)  # the job's frameworkParams
    output_dir: str = ""
    job_id: int = 0
    attempt: int = 0
    db_url: str = ""  # the store, where trainmaster.report() writes the instance's metrics

    @property
    def address(self) -> str:
        return f"{self.host}:{self.ports[0]}" if self.ports else self.host


def python_module(module: str, *args: str) -> list[str]:
    """A role command that runs a Python module with the controller's interpreter."""
    return [sys.executable, "-m", module, *args]


class Framework:
    """Base class: subclass it, set ``name`` (and ``role_names`` to restrict roles)."""

    name: ClassVar[str] = ""
    #: role names this framework knows; None accepts any name
    role_names: ClassVar[tuple[str, ...] | None] = None
    #: roles a job of this framework must have
    required_roles: ClassVar[tuple[str, ...]] = ()
    #: role -> roles it depends on (condition Running) unless the user says otherwise
    default_dependencies: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: roles that must have exactly one replica (a master, a server, a parameter node)
    single_instance_roles: ClassVar[tuple[str, ...]] = ()
    #: role -> why it needs a reserved port (others reach it there); ``ports: 0`` is an error
    port_roles: ClassVar[dict[str, str]] = {}

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        """The command a role runs when the job gives none (None: the user must give one)."""
        return None

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        """Framework-specific problems in the raw job ``spec`` (a dict that may be malformed)."""
        errors: list[str] = []
        names = [r.get("name") for r in roles]
        if self.role_names is not None:
            for i, name in enumerate(names):
                if isinstance(name, str) and name not in self.role_names:
                    errors.append(
                        f"spec.roles[{i}].name: framework '{self.name}' has no role "
                        f"'{name}' (roles: {', '.join(self.role_names)})"
                    )
        for required in self.required_roles:
            if required not in names:
                errors.append(f"spec.roles: framework '{self.name}' needs a role named '{required}'")
        for i, role in enumerate(roles):
            name = role.get("name")
            if not isinstance(name, str):
                continue  # the structural pass reports it
            if name in self.single_instance_roles and role.get("replicas", 1) != 1:
                errors.append(f"spec.roles[{i}].replicas: the {self.name} {name} must have exactly 1 replica")
            if name in self.port_roles and role.get("ports", 1) == 0:
                errors.append(f"spec.roles[{i}].ports: the {self.name} {name} needs a port{self.port_roles[name]}")
        return errors

    def defaults(self, job: Job) -> Job:
        """Fill the framework's defaults into ``job`` (a copy; the argument is not changed)."""
        from trainmaster.containers.policy import runs_in_container

        job = job.model_copy(deep=True)
        role_names = {r.name for r in job.spec.roles}
        for role in job.spec.roles:
            if "depends_on" not in role.model_fields_set:
                role.depends_on = [
                    Dependency(role=d) for d in self.default_dependencies.get(role.name, ()) if d in role_names
                ]
            # a role that runs an image with no command runs the image's entry point (Kubernetes);
            # one that runs on the host (including `auto` resolved to the host) gets the framework's
            if role.command is None and not runs_in_container(job.spec, role):
                role.command = self.role_command(job, role)
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        """Extra environment variables of one instance."""
        return {}

    def container_mounts(self, params: dict[str, Any], run_dir: str) -> list[dict[str, Any]]:
        """Bind mounts (``{"source", "target", "read_only"}``, sources in the job's folder) an
        instance of this framework gets where it runs in a container: the files its upstream
        counterpart mounts at a fixed path (Volcano's ``/etc/volcano``)."""
        return []
