"""The Backend protocol: instance-level operations the controller needs from any engine.

The controller owns all decisions (when to start, restart, stop); a backend only places,
starts, observes and stops single instances, and reports each one's address. Every backend
passes the same behavioural suite (``tests/backends``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator, Sequence

from trainmaster.agent.contract import LaunchSpec


@dataclass(frozen=True)
class Capacity:
    """What a backend can hold at once (CPUs, bytes of memory, GPUs)."""

    cpu: float
    memory: int
    gpu: int = 0

    def fits(self, cpu: float, memory: int, gpu: int = 0) -> bool:
        return cpu <= self.cpu + 1e-9 and memory <= self.memory and gpu <= self.gpu

    def minus(self, cpu: float, memory: int, gpu: int = 0) -> Capacity:
        return Capacity(self.cpu - cpu, self.memory - memory, self.gpu - gpu)


@dataclass(frozen=True)
class Placement:
    """Where an instance will run: its host and the ports reserved for it there."""

    host: str
    ports: list[int]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.ports[0]}" if self.ports else self.host


@dataclass
class LaunchRequest:
    """One attempt of one instance, as the controller hands it to a backend: where it was placed,
    the typed launch contract a node agent starts (:class:`LaunchSpec`), and the role's resources
    as written (the Ray backend sizes a gang's bundles from them)."""

    placement: Placement
    spec: LaunchSpec
    resources: dict[str, Any] = field(default_factory=dict)

    @property
    def job_id(self) -> int:
        return self.spec.job_id

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def instance_dir(self) -> str:
        return self.spec.instance_dir

    @property
    def gated(self) -> bool:
        """Has dependencies: running only once its wait step has passed."""
        return bool(self.spec.depends)


@dataclass(frozen=True)
class StartFailure:
    """An attempt the OS refused to start: why, naming the program (or path) and the OS error."""

    message: str


class Phase(str, Enum):
    STARTING = "starting"  # process exists, still in its dependency wait step
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"  # the backend cannot find it any more (host down, process vanished)
    UNREACHABLE = "unreachable"  # its host does not answer now; it may still be running


@dataclass(frozen=True)
class Observation:
    phase: Phase
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    host: str = ""  # where it runs, when the backend learns that only after start (Ray's node)
    ports: list[int] | None = None  # its ports, when that node had to give it others than reserved
    # when the attempt's command started (epoch seconds), where the backend knows it: an attempt
    # can pass its wait step, run and end between two polls without ever being seen running
    command_started: float | None = None
    cpu_seconds: float = 0.0  # the instance's whole tree, where the backend measures it
    peak_rss: int = 0  # bytes


class Backend(ABC):
    """A place where instances run."""

    name: str = ""
    running_at_start: bool = False  # a started attempt without a wait step runs at once (no poll needed)
    runs_containers: bool = False  # its agents run LaunchSpec.container (podman); else roles run on the host
    # how its instances reach the controller's instance channel: "unix" (a socket on this
    # machine: local agent, testbed hosts) or "tcp" (instances on other machines: Ray nodes, pods)
    instance_channel: str = "unix"

    @abstractmethod
    def capacity(self) -> Capacity:
        """Total resources of the backend (admission compares requests against it)."""

    @abstractmethod
    def place(self, ports: int, resources: dict[str, Any], wanted: Sequence[int] = ()) -> Placement:
        """Choose where a new instance goes and reserve its ports: the i-th is ``wanted[i]`` (the
        role's declared containerPorts) where free on that host, else a free one."""

    def place_role(
        self,
        role: str,
        ports: int,
        resources: dict[str, Any],
        annotations: dict[str, str],
        wanted: Sequence[int] = (),
    ) -> Placement:
        """Place an instance of ``role``: backends that can pin a role to a host (the testbed
        reads the job's ``testbed/<role>`` annotations) override this; the rest place alike."""
        return self.place(ports, resources, wanted) if wanted else self.place(ports, resources)

    @abstractmethod
    def start(self, request: LaunchRequest) -> dict[str, Any]:
        """Start one attempt; return a JSON-able handle that identifies it safely.

        The caller has created ``request.instance_dir``; what to run is ``request.spec``."""

    def start_all(self, requests: list[LaunchRequest]) -> Iterator[dict[str, Any] | StartFailure]:
        """Start several attempts; their handles come back in order, each as soon as it is
        known, so the caller records one before the next starts. One the OS refuses
        (a missing working directory, an executable that cannot run) comes back as a
        :class:`StartFailure` and the others still start."""
        return (start_or_error(self, request) for request in requests)

    @abstractmethod
    def poll(self, handle: dict[str, Any]) -> Observation:
        """The instance's phase now."""

    def poll_all(self, handles: list[dict[str, Any]]) -> list[Observation]:
        """Several instances' phases (one round trip where the backend can)."""
        return [self.poll(handle) for handle in handles]

    def forget(self, handles: list[dict[str, Any]]) -> None:
        """The controller has stored these ended instances' exits; the backend may drop them."""

    def handle_of(self, instance_id: str) -> dict[str, Any] | None:
        """The handle of an attempt started under ``instance_id`` whose handle was never recorded
        (the controller died between the start and saving it), or None if it never started."""
        return None

    def reserve_ports(self, ports: list[int]) -> None:
        """Hold ports an adopted instance already uses, so no new instance is given them."""

    @abstractmethod
    def stop(self, handles: list[dict[str, Any]], grace: float) -> None:
        """Stop instances: ask politely, then force after ``grace`` seconds."""

    @abstractmethod
    def release(self, placement: Placement) -> None:
        """Free a placement's reservations (ports) once its instance has ended."""

    def reserve_gang(self, job_id: int, bundles: list[dict[str, Any]]) -> tuple[bool, str]:
        """Reserve every instance's resources of a job at once (gang scheduling).

        ``bundles`` holds one ``{"cpu", "memory", "gpu"}`` per instance. Returns ``(True, "")``
        when reserved, or ``(False, reason)`` while it cannot be placed (the job stays pending
        with that reason). Backends without such a mechanism rely on the controller's own
        capacity accounting and accept at once.
        """
        return True, ""

    def release_gang(self, job_id: int) -> None:
        """Free what :meth:`reserve_gang` reserved (called when the job ends)."""

    def adopt(self, handle: dict[str, Any]) -> bool:
        """Re-attach to an instance started by an earlier controller; False if it is gone."""
        return self.poll(handle).phase in (Phase.STARTING, Phase.RUNNING)

    def find(self, instance_dir: str) -> dict[str, Any] | None:
        """The handle of a live instance started from ``instance_dir`` whose handle was never
        recorded (a controller crash between starting it and saving the handle), or None."""
        return None

    def watch_exits(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever an instance ends (a server's reconcile loop then runs its next
        pass at once instead of after its interval). Backends that cannot tell leave it uncalled."""

    def close(self) -> None:
        """Release backend-wide resources."""


def start_or_error(backend: Backend, request: LaunchRequest) -> dict[str, Any] | StartFailure:
    """``backend.start(request)``, with the OS's refusal returned instead of raised."""
    try:
        return backend.start(request)
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        return StartFailure(
            f"could not start: {error.strerror or error}{where}; check the role's command and workingDir"
        )
