"""The launch contract: what a node is asked to run and what it says back (what kubelet's CRI
is to Kubernetes). The ground floor of the package: it imports nothing of ours, and the agent,
the container runtime, the backends, the controller and the store all speak it.

A node agent is the only owner of instance processes on its node. The controller (through a
backend) hands it :class:`LaunchSpec` s and refers to what it started only by
:class:`InstanceHandle`; it learns how each instance is doing from :class:`InstanceStatus`, whose
:class:`InstancePhase` is the one vocabulary of an attempt's phase every backend reports in
(:func:`trainmaster.spec.states.observed_state` maps it to the controller's instance states).
Every message that crosses the controller/agent boundary is one of these dataclasses, so the
local agent (a daemon on a Unix socket), the Ray agent (one actor per Ray node) and the testbed
agents (one per network-namespace host) all speak the same protocol: :class:`NodeAgentAPI`.

Values are plain JSON types so that a message serialises with :func:`dataclasses.asdict` and is
rebuilt with ``Type.from_dict``: JSON exists only on the wire and at the store's edge.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol


class InstancePhase(str, Enum):
    """What a node knows of one instance attempt: the one phase vocabulary of agents and backends."""

    STARTING = "starting"  # alive, its role command not yet running (dependency wait, container creation)
    RUNNING = "running"  # the role command runs
    EXITED = "exited"  # the whole tree is gone and the exit is journaled (a refused start: 127, StartFailed)
    LOST = "lost"  # nobody can account for it (its node, its agent or the agent's journal was lost)
    UNREACHABLE = "unreachable"  # its node does not answer now; it may still be running

    @classmethod
    def _missing_(cls, value: object) -> InstancePhase | None:
        # journals written before the vocabulary was one: "waiting" and "start_failed"
        return {"waiting": cls.STARTING, "start_failed": cls.EXITED}.get(str(value))


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
    # the job's metadata.annotations, as a pod carries them to its kubelet (a hollow node reads
    # its simulated run time there: trainmaster.backends.hollow)
    annotations: dict[str, str] = field(default_factory=dict)

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
    """How the controller names an attempt a node started, on every backend: node + instance id
    (+ pid, for people reading ``status``; an agent never trusts a pid alone). ``node`` is empty
    while the backend does not know it yet (a Ray bundle being placed again). ``ports``: those
    its spec was given on the node, so a controller that re-finds the attempt after a crash (it
    never stored the handle) holds them again and gives them to no other instance.
    ``instance_dir``: where the attempt's files are, for a backend that finds an attempt there
    (Ray's attempt record); empty where none needs it.

    Stored on the instance's row as JSON (``trainmaster.store.models.HandleColumn``, the one
    place it is converted)."""

    node: str
    instance_id: str
    pid: int | None = None
    ports: list[int] = field(default_factory=list)
    instance_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        # by hand: ``asdict`` deep-copies field by field, and an agent answers a 64-spec start
        # with 64 handles while the batch's last commands still need the cores
        return {
            "node": self.node,
            "instance_id": self.instance_id,
            "pid": self.pid,
            "ports": list(self.ports),
            "instance_dir": self.instance_dir,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceHandle:
        """Rebuilt from its JSON; unknown keys (handles stored before they were typed) are ignored."""
        return cls(
            str(data.get("node") or ""),
            str(data["instance_id"]),
            data.get("pid"),
            [int(p) for p in data.get("ports") or []],
            str(data.get("instance_dir") or ""),
        )


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
        data = dict(self.__dict__)  # every field a plain value but the handle and the phase
        data["handle"] = self.handle.to_dict()
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "handle": None if self.handle is None else self.handle.to_dict(),
            "error": self.error,
        }


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


#: The controller's secrets: no process it starts (instance, node agent) gets them.
SECRET_VARIABLES = frozenset({"TRAINMASTER_TOKEN", "TRAINMASTER_DB", "TM_DB_URL"})


def without_secrets(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less :data:`SECRET_VARIABLES` (a node agent's environment: its instances
    never see it, but another process of its user could read it in ``/proc``)."""
    return {k: v for k, v in environ.items() if k not in SECRET_VARIABLES}
