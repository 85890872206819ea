"""The job description a user writes (``apiVersion: trainmaster/v1, kind: Job``), as typed data.

Field names are the camelCase names users write in YAML; Python code uses snake_case. Unknown
fields are errors, so a typo never silently changes a job. Behaviour (defaults, validation,
status roll-up) lives in sibling modules.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator
from pydantic.alias_generators import to_camel

API_VERSION: Literal["trainmaster/v1"] = "trainmaster/v1"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_PORTS_PER_INSTANCE = 64
# Bounds that keep every value inside what the store (64-bit integers), the OS (path lengths)
# and a sane cluster can hold, so that no input reaches a layer that cannot take it.
MAX_REPLICAS = 10_000  # per role
MAX_ROLES = 100
MAX_RESTARTS = 10_000
MAX_BACKOFF_SECONDS = 3600.0
MAX_DEPENDENCY_TIMEOUT_SECONDS = 7 * 24 * 3600.0
MAX_CPU = 100_000.0
MAX_GPU = 10_000
MAX_MEMORY_BYTES = 2**62
MAX_FRAMEWORK_ID = 256
MAX_PATH_LENGTH = 1024
MAX_PATH_COMPONENT = 255


class SpecModel(BaseModel):
    """Base: camelCase aliases, strict about unknown fields, assignment re-validated."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True)

    def dump(self) -> dict[str, Any]:
        """The model as the user would write it (camelCase, no unset optionals)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class RestartPolicyKind(str, Enum):
    NEVER = "Never"
    ON_FAILURE = "OnFailure"
    ALWAYS = "Always"
    # Kubeflow's ExitCode: exit codes 1-127 are permanent errors (no restart), 128-255 (killed
    # by a signal, e.g. 137 out of memory) retryable
    EXIT_CODE = "ExitCode"


class RestartScope(str, Enum):
    """What a restart restarts (Volcano's RestartPod, RestartTask and RestartJob actions)."""

    INSTANCE = "Instance"  # only the instance that ended
    ROLE = "Role"  # every instance of its role, stopped and started afresh
    JOB = "Job"  # every instance of the job


class RestartPolicy(SpecModel):
    """When a finished instance is started again, how often, and how long to wait first.

    ``Always`` restarts after success too (a service role); ``OnFailure`` only after a non-zero
    exit. ``backoffSeconds`` doubles on each restart of the same instance, capped at 60 s.
    ``scope`` ``Role`` or ``Job`` restarts the whole role or job instead (the running instances
    are stopped first); ``maxRestarts`` then counts those restarts. ``exitCodes`` restricts the
    restarts after a failure to those exit codes (Volcano's ``exitCode`` policies); ``ExitCode``
    (Kubeflow) restarts after a signal (exit codes 128-255) only.
    """

    policy: RestartPolicyKind = RestartPolicyKind.NEVER
    scope: RestartScope = RestartScope.INSTANCE
    exit_codes: Annotated[list[Annotated[int, Field(ge=1, le=255)]], Field(min_length=1, max_length=255)] | None = None
    max_restarts: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] = 3
    backoff_seconds: Annotated[float, Field(ge=0, le=MAX_BACKOFF_SECONDS)] = 1.0


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
    # every instance of the role has a host and ports (it may itself still wait): what a
    # framework needs to hand every member the whole cluster (TF_CONFIG); it cannot deadlock,
    # so a role may wait for its own role's placements and such edges form no cycle
    PLACED = "Placed"


class Dependency(SpecModel):
    """Wait, before running the role's code, until every instance of ``role`` meets ``condition``."""

    role: str
    condition: DependencyCondition = DependencyCondition.RUNNING
    timeout_seconds: Annotated[float, Field(gt=0, le=MAX_DEPENDENCY_TIMEOUT_SECONDS)] = 600.0


_MEMORY_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_memory(value: str | int | float) -> int:
    """Kubernetes-style quantity (``512Mi``, ``2G``, ``1000``) to bytes, at most 4 EiB."""
    if isinstance(value, (int, float)):
        if value != value or value < 0:
            raise ValueError("must be >= 0")
        if value > MAX_MEMORY_BYTES:
            raise ValueError(f"must be at most {MAX_MEMORY_BYTES} bytes (4Ei)")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([KMGTkmgt]i?)?\s*", value)
    if not match:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValueError(f"'{shown}' is not a memory quantity like 512Mi or 2G")
    number = float(match.group(1)) * _MEMORY_UNITS[(match.group(2) or "").lower()]
    if number > MAX_MEMORY_BYTES:
        raise ValueError(f"must be at most {MAX_MEMORY_BYTES} bytes (4Ei)")
    return int(number)


def check_job_path(value: str) -> str:
    """A path a job names (``workingDir``, ``output.path``) that the OS can take: no NUL, at
    most 1024 characters, components of at most 255. Whether it may leave the job's folder is
    the operator's policy, checked at load time (:mod:`trainmaster.spec.paths`)."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    if not value.strip():
        raise ValueError("must not be empty")
    if len(value) > MAX_PATH_LENGTH:
        raise ValueError(f"is {len(value)} characters long; at most {MAX_PATH_LENGTH}")
    if any(len(part) > MAX_PATH_COMPONENT for part in value.split("/")):
        raise ValueError(f"has a path component longer than {MAX_PATH_COMPONENT} characters")
    return value


class Resources(SpecModel):
    """What one instance requests; the controller admits a job only when its gang fits.

    Like Kubernetes requests, nothing is requested unless stated, so small jobs run anywhere.
    """

    cpu: Annotated[float, Field(ge=0, le=MAX_CPU, allow_inf_nan=False)] = 0.0
    memory: Annotated[str, Field(max_length=64)] | Annotated[int, Field(ge=0, le=MAX_MEMORY_BYTES)] = 0
    gpu: Annotated[int, Field(ge=0, le=MAX_GPU)] = 0

    @field_validator("memory")
    @classmethod
    def _check_memory(cls, value: str | int) -> str | int:
        parse_memory(value)
        return value

    @property
    def memory_bytes(self) -> int:
        return parse_memory(self.memory)


class RuntimeKind(str, Enum):
    """Where a role's instances run: this machine's own software, or a container from the
    role's image; ``auto`` (what converted Kubeflow/Volcano files get) picks a container when a
    container runtime is present, and the host when the role gives a command and none is."""

    HOST = "host"
    CONTAINER = "container"
    AUTO = "auto"


class PullPolicy(str, Enum):
    """Kubernetes' imagePullPolicy."""

    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"
    ALWAYS = "Always"


class InstanceField(str, Enum):
    """What a role's ``envFields`` may name: Kubernetes' ``valueFrom.fieldRef`` paths that mean
    something for an instance here. Every instance shares its node's network (processes and
    containers alike), so its pod IP is its host's address, as for a Kubernetes ``hostNetwork``
    pod, and its node is named by that address."""

    POD_IP = "status.podIP"
    HOST_IP = "status.hostIP"
    NODE_NAME = "spec.nodeName"
    POD_NAME = "metadata.name"  # <job>-<role>-<index>, as Kubeflow names its pods
    POD_UID = "metadata.uid"  # a UUID per attempt (a restarted Kubeflow pod is a new pod)


MAX_VOLUMES = 32


class Volume(SpecModel):
    """A bind mount into a role's containers: ``hostPath`` (relative to the job's folder, or an
    absolute path the operator allows; see :mod:`trainmaster.spec.paths`) or ``emptyDir`` (a
    fresh folder of the job's, shared by the instances of the role on a node)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]
    mount_path: Annotated[str, AfterValidator(check_job_path)]
    host_path: Annotated[str, AfterValidator(check_job_path)] | None = None
    empty_dir: bool = False
    read_only: bool = False

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path inside the container")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "Volume":
        if (self.host_path is None) == (not self.empty_dir):
            raise ValueError("give exactly one of hostPath or emptyDir: true")
        return self


class Role(SpecModel):
    """A named group of identical instances (master, worker, ps, device...)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    command: Annotated[list[str], Field(min_length=1)] | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # variables whose value is a fact of the instance (its address, name...), known at launch
    env_fields: dict[str, InstanceField] = Field(default_factory=dict)
    # relative to the job's folder; see trainmaster.spec.paths
    working_dir: Annotated[str, AfterValidator(check_job_path)] | None = None
    # with a container runtime: ``command`` replaces the image's ENTRYPOINT, ``args`` its CMD
    image: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")] | None = None
    runtime: RuntimeKind | None = None  # None: the job's, else host
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    volumes: Annotated[list[Volume], Field(max_length=MAX_VOLUMES)] = Field(default_factory=list)
    ports: Annotated[int, Field(ge=0, le=MAX_PORTS_PER_INSTANCE)] = 1
    # a Kubernetes container's ``ports[].containerPort``: an instance's first ports are these
    # numbers where free on its node (instances share their node's network), else free ones
    container_ports: Annotated[
        list[Annotated[int, Field(ge=1, le=65535)]], Field(max_length=MAX_PORTS_PER_INSTANCE)
    ] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    status_policy: StatusPolicy = Field(default_factory=StatusPolicy)
    depends_on: list[Dependency] = Field(default_factory=list)

    @model_validator(mode="after")
    def _container_needs_image(self) -> "Role":
        if self.runtime == RuntimeKind.CONTAINER and self.image is None:
            raise ValueError("runtime: container needs an image")
        if self.volumes and self.image is None:
            raise ValueError("volumes are mounted into containers: give the role an image")
        if len(set(self.container_ports)) != len(self.container_ports):
            raise ValueError("containerPorts: each port once")
        if self.container_ports and "ports" not in self.model_fields_set:
            self.__dict__["ports"] = len(self.container_ports)  # not re-validated: set directly
        elif len(self.container_ports) > self.ports:
            raise ValueError(f"ports: {self.ports} is fewer than the {len(self.container_ports)} containerPorts")
        both = sorted(set(self.env) & set(self.env_fields))
        if both:
            raise ValueError(f"{', '.join(both)}: set in both env and envFields; keep one")
        return self

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
    KUBERNETES = "kubernetes"


PRIORITY_CLASSES = {"low": -100, "normal": 0, "high": 100, "critical": 1000}


class Scheduling(SpecModel):
    """Gang size, queue and priority; ``minAvailable`` defaults to every replica of the job."""

    min_available: Annotated[int, Field(ge=1, le=MAX_ROLES * MAX_REPLICAS)] | None = None
    queue: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)] = "default"
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
    """Where a successful job's outputs are copied: relative to the job's folder (see
    :mod:`trainmaster.spec.paths`)."""

    path: Annotated[str, AfterValidator(check_job_path)]


MAX_SECONDS = 10**9  # about 31 years: any deadline or TTL a user means


class RunPolicy(SpecModel):
    """How long a job may run, how long its record outlives it, how many restarts it may spend
    in all, and whether it waits to be resumed (Kubeflow's ``runPolicy``, with its meanings).

    ``backoffLimit`` counts the restarts of failed instances over the whole job (a role's
    ``maxRestarts`` counts per instance); once spent, the next failure fails the job
    (``BackoffLimitExceeded``). ``activeDeadlineSeconds`` counts from the job's start (its
    admission); past it the job fails (``DeadlineExceeded``) and its instances are stopped.
    ``ttlSecondsAfterFinished`` deletes the ended job (record, events, run folder) that long
    after it ended. ``suspend`` holds the job: it is not admitted (a running one has its
    instances stopped and goes back to the queue) until ``trainmaster job resume`` clears it."""

    backoff_limit: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] | None = None
    active_deadline_seconds: Annotated[int, Field(ge=1, le=MAX_SECONDS)] | None = None
    ttl_seconds_after_finished: Annotated[int, Field(ge=0, le=MAX_SECONDS)] | None = None
    suspend: bool = False


class JobSpec(SpecModel):
    framework: Annotated[str, Field(min_length=1, max_length=MAX_FRAMEWORK_ID)] = "command"
    framework_params: dict[str, Any] = Field(default_factory=dict)
    roles: list[Role] = Field(min_length=1, max_length=MAX_ROLES)
    status_policy: StatusPolicy = Field(default_factory=StatusPolicy)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    output: Output | None = None
    runtime: RuntimeKind | None = None  # the default of roles that name none (host when unset)

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)

    def runs_in_container(self, role: Role) -> bool:
        """Whether ``role`` runs its image in a container, as the job says: its ``runtime``, else
        the job's, else the host. Loading pins every ``auto`` to host or container (the container
        policy, :func:`trainmaster.containers.policy.settle_runtimes`, decides there, once); an
        ``auto`` that a job stored before that still carries runs in a container only when the
        role gives no command (it can only run its image's entry point)."""
        if role.image is None:
            return False
        kind = role.runtime or self.runtime or RuntimeKind.HOST
        if kind == RuntimeKind.AUTO:
            return role.command is None
        return kind == RuntimeKind.CONTAINER

    @property
    def total_replicas(self) -> int:
        return sum(role.replicas for role in self.roles)


class Metadata(SpecModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]

    @field_validator("name")
    @classmethod
    def _not_an_id(cls, value: str) -> str:
        if value.isdigit():
            raise ValueError(f"must not be only digits: a number refers to a job id (add a letter, e.g. 'job-{value}')")
        return value

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
