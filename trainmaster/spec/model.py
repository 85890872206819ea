"""The job description a user writes (``apiVersion: trainmaster/v1, kind: Job``), as typed data.

Field names are the camelCase names users write in YAML; Python code uses snake_case. Unknown
fields are errors, so a typo never silently changes a job. Behaviour (defaults, validation,
status roll-up) lives in sibling modules.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator
from pydantic.alias_generators import to_camel

API_VERSION = "trainmaster/v1"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_PORTS_PER_INSTANCE = 64


class SpecModel(BaseModel):
    """Base: camelCase aliases, strict about unknown fields, assignment re-validated."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )

    def dump(self) -> dict[str, Any]:
        """The model as the user would write it (camelCase, no unset optionals)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class RestartPolicyKind(str, Enum):
    NEVER = "Never"
    ON_FAILURE = "OnFailure"
    ALWAYS = "Always"


class RestartPolicy(SpecModel):
    """When a finished instance is started again, how often, and how long to wait first.

    ``Always`` restarts after success too (a service role); ``OnFailure`` only after a non-zero
    exit. ``backoffSeconds`` doubles on each restart of the same instance, capped at 60 s.
    """

    policy: RestartPolicyKind = RestartPolicyKind.NEVER
    max_restarts: Annotated[int, Field(ge=0)] = 3
    backoff_seconds: Annotated[float, Field(ge=0)] = 1.0


class RoleSelector(SpecModel):
    """``{roles: [a, b]}``: every named role is in the state."""

    roles: list[str] = Field(min_length=1)


class InstanceCount(SpecModel):
    """``{instances: N}``: at least N instances over all roles are in the state (Volcano minSuccess)."""

    instances: PositiveInt


# A condition over per-state counts: "any" (>= 1), "all" (every member), N (>= N members),
# {roles: [...]} (those roles, job level only), {instances: N} (job level: across all roles).
Condition = Union[Literal["any", "all"], PositiveInt, RoleSelector, InstanceCount]


class StatusPolicy(SpecModel):
    """How member states (instances of a role, or roles of a job) roll up into one state.

    ``failed`` is checked first, then ``succeeded``; ``preset`` fills both from a named policy
    (see :data:`trainmaster.spec.status.PRESETS`), and explicit fields override the preset.
    """

    preset: str | None = None
    failed: Condition | None = None
    succeeded: Condition | None = None


class DependencyCondition(str, Enum):
    RUNNING = "Running"  # every instance of the role has a recorded address
    SUCCEEDED = "Succeeded"  # every instance of the role has succeeded


class Dependency(SpecModel):
    """Wait, before running the role's code, until every instance of ``role`` meets ``condition``."""

    role: str
    condition: DependencyCondition = DependencyCondition.RUNNING
    timeout_seconds: Annotated[float, Field(gt=0)] = 600.0


_MEMORY_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                 "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_memory(value: str | int | float) -> int:
    """Kubernetes-style quantity (``512Mi``, ``2G``, ``1000``) to bytes."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("must be >= 0")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTkmgt]i?)?\s*", value)
    if not match:
        raise ValueError(f"'{value}' is not a memory quantity like 512Mi or 2G")
    return int(float(match.group(1)) * _MEMORY_UNITS[(match.group(2) or "").lower()])


class Resources(SpecModel):
    """What one instance requests; the controller admits a job only when its gang fits.

    Like Kubernetes requests, nothing is requested unless stated, so small jobs run anywhere.
    """

    cpu: Annotated[float, Field(ge=0)] = 0.0
    memory: str | int = 0
    gpu: Annotated[int, Field(ge=0)] = 0

    @field_validator("memory")
    @classmethod
    def _check_memory(cls, value: str | int) -> str | int:
        parse_memory(value)
        return value

    @property
    def memory_bytes(self) -> int:
        return parse_memory(self.memory)


class Role(SpecModel):
    """A named group of identical instances (master, worker, ps, device...)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]
    replicas: PositiveInt = 1
    command: list[str] | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    image: str | None = None  # only meaningful where a backend runs images; ignored locally
    ports: Annotated[int, Field(ge=0, le=MAX_PORTS_PER_INSTANCE)] = 1
    resources: Resources = Field(default_factory=Resources)
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    status_policy: StatusPolicy = Field(default_factory=StatusPolicy)
    depends_on: list[Dependency] = Field(default_factory=list)

    @field_validator("env", mode="before")
    @classmethod
    def _stringify_env(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v if isinstance(v, str) else _scalar_text(v) for k, v in value.items()}
        return value


def _scalar_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value  # anything else fails validation as "not a string"


class Backend(str, Enum):
    LOCAL = "local"
    RAY = "ray"


PRIORITY_CLASSES = {"low": -100, "normal": 0, "high": 100, "critical": 1000}


class Scheduling(SpecModel):
    """Gang size, queue and priority; ``minAvailable`` defaults to every replica of the job."""

    min_available: PositiveInt | None = None
    queue: Annotated[str, Field(pattern=NAME_PATTERN)] = "default"
    priority_class: str = "normal"
    backend: Backend | None = None

    @field_validator("priority_class")
    @classmethod
    def _known_priority(cls, value: str) -> str:
        if value not in PRIORITY_CLASSES:
            raise ValueError(f"must be one of {', '.join(PRIORITY_CLASSES)}")
        return value

    @property
    def priority(self) -> int:
        return PRIORITY_CLASSES[self.priority_class]


class Output(SpecModel):
    path: str


class JobSpec(SpecModel):
    framework: str = "command"
    framework_params: dict[str, Any] = Field(default_factory=dict)
    roles: list[Role] = Field(min_length=1)
    status_policy: StatusPolicy = Field(default_factory=StatusPolicy)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    output: Output | None = None

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)

    @property
    def total_replicas(self) -> int:
        return sum(role.replicas for role in self.roles)


class Metadata(SpecModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Job(SpecModel):
    api_version: Literal["trainmaster/v1"] = API_VERSION
    kind: Literal["Job"] = "Job"
    metadata: Metadata
    spec: JobSpec

    @property
    def name(self) -> str:
        return self.metadata.name
