"""The typed contract between the controller and a node agent (what kubelet's CRI is to Kubernetes).

A node agent is the only owner of instance processes on its node. The controller (through a
backend) hands it :class:`LaunchSpec` s and refers to what it started only by
:class:`InstanceHandle`; it learns how each instance is doing from :class:`InstanceStatus`.
Every message that crosses the controller/agent boundary is one of these dataclasses, so the
local agent (a daemon on a Unix socket), the Ray agent (one actor per Ray node) and the testbed
agents (one per network-namespace host) all speak the same protocol: :class:`NodeAgentAPI`.

Values are plain JSON types so that a message serialises with :func:`dataclasses.asdict` and is
rebuilt with ``Type.from_dict``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol


class InstancePhase(str, Enum):
    """What the agent knows of one instance attempt."""

    WAITING = "waiting"  # alive, still in its dependency wait step (no role command yet)
    RUNNING = "running"  # the role command runs
    EXITED = "exited"  # the whole process tree is gone and the exit is journaled
    START_FAILED = "start_failed"  # the OS refused to start it (missing program, bad cwd...)
    LOST = "lost"  # the agent cannot account for it (its node or the agent's journal was lost)


@dataclass(frozen=True)
class Dependency:
    """Wait until ``replicas`` instances of ``role`` are ``condition`` (Running: have an address)."""

    role: str
    condition: str  # "Running" | "Succeeded"
    timeout: float
    replicas: int


@dataclass(frozen=True)
class ContainerLaunch:
    """Run the instance in an OCI container from ``image`` (:mod:`trainmaster.containers`).

    Kubernetes semantics: ``command`` replaces the image's ENTRYPOINT and ``args`` its CMD; None
    keeps the image's own. ``working_dir`` is a path inside the container. ``mounts`` are bind
    mounts ``{"source", "target", "read_only"}`` already checked against the operator's policy.
    """

    image: str
    command: list[str] | None = None
    args: list[str] | None = None
    working_dir: str | None = None
    mounts: list[dict[str, Any]] = field(default_factory=list)
    pull_policy: str = "IfNotPresent"  # IfNotPresent | Never | Always
    # podman has no pull timeout (a registry that accepts and never answers holds a pull for
    # minutes): the agent kills a client whose container does not exist this long after its start
    create_timeout: float = 600.0


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a node agent needs to start one attempt of one instance.

    ``env`` is the instance's complete environment when ``depends`` is empty; with dependencies
    the wait step completes it with the addresses it waited for (one resolver:
    :func:`trainmaster.runtime.environment.instance_environment`).
    """

    instance_id: str  # unique per attempt across the store: "<job uid>/<role>-<index>/<attempt>"
    job_id: int
    job_name: str
    role: str
    index: int
    attempt: int
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    log_path: str
    instance_dir: str
    host: str
    ports: list[int] = field(default_factory=list)
    cpu: float = 0.0
    memory: int = 0  # bytes; 0 = no limit
    gpu: int = 0
    depends: list[Dependency] = field(default_factory=list)
    # what instance_environment needs besides the waited-for addresses ({"framework", "context",
    # "role_env"}): with depends the wait step resolves the environment from these and ``env``
    # (then the base environment); without, ``env`` is resolved already and these only inform
    env_inputs: dict[str, Any] = field(default_factory=dict)
    # set: the instance runs in a container (``argv`` is then unused); ``env`` is the
    # container's environment, not the host's
    container: ContainerLaunch | None = None

    def to_dict(self) -> dict[str, Any]:
        # shallow (asdict deep-copies every env of a 64-spec batch: a tenth of a local start)
        data = dict(self.__dict__)
        data["depends"] = [d.__dict__ for d in self.depends]
        data["container"] = None if self.container is None else asdict(self.container)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchSpec:
        container = data.get("container")
        return cls(
            **{
                **data,
                "depends": [Dependency(**d) for d in data.get("depends", [])],
                "container": None if container is None else ContainerLaunch(**container),
            }
        )


@dataclass(frozen=True)
class InstanceHandle:
    """How the controller names an attempt the agent started: node + instance id (+ pid, for
    people reading ``status``; the agent never trusts a pid alone). ``ports``: those its spec
    was given on the node, so a controller that re-finds the attempt after a crash (it never
    stored the handle) holds them again and gives them to no other instance."""

    node: str
    instance_id: str
    pid: int | None = None
    ports: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceHandle:
        return cls(data["node"], data["instance_id"], data.get("pid"), list(data.get("ports") or []))


@dataclass(frozen=True)
class InstanceStatus:
    """One attempt as its agent sees it now."""

    handle: InstanceHandle
    phase: InstancePhase
    exit_code: int | None = None
    reason: str = ""  # machine reason: Completed, Error, Killed, StartFailed, DependencyTimeout, AgentRestarted...
    message: str = ""
    started_at: float | None = None  # epoch seconds the process was spawned
    command_started_at: float | None = None  # epoch seconds the role command itself started
    ended_at: float | None = None
    cpu_seconds: float = 0.0  # user + system, the whole tree
    peak_rss: int = 0  # bytes, the whole tree (cgroup peak where available)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phase"] = self.phase.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceStatus:
        return cls(
            **{**data, "handle": InstanceHandle.from_dict(data["handle"]), "phase": InstancePhase(data["phase"])}
        )


@dataclass(frozen=True)
class StartResult:
    """The answer to one :class:`LaunchSpec`: a handle, or why it could not start."""

    instance_id: str
    handle: InstanceHandle | None
    error: str = ""  # names the program and the OS error when handle is None


class NodeAgentAPI(Protocol):
    """The whole protocol. Implemented in-process by the agent core and, over a transport, by
    each agent client."""

    node: str

    def start(self, specs: list[LaunchSpec]) -> list[StartResult]:
        """Start each spec (idempotent per ``instance_id``: a repeated start returns the first
        handle and starts nothing)."""

    def stop(self, instance_ids: list[str], grace: float) -> list[InstanceStatus]:
        """TERM every process of each instance's tree, KILL what is left after ``grace``; return
        once every tree is gone, with the journaled exits."""

    def observe(self, instance_ids: list[str]) -> list[InstanceStatus]:
        """Each instance's status (an unknown id is LOST)."""

    def forget(self, instance_ids: list[str]) -> None:
        """Drop the journal records of ended instances the controller has stored."""

    # last: in a class body that defines ``list``, later annotations would name the method
    def list(self) -> list[InstanceStatus]:
        """Every instance this agent holds a record of."""
