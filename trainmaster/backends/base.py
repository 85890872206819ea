"""The backend boundary: where the controller's decisions become processes on nodes.

Design note. The controller owns every decision (admit, start, restart, stop); a backend only
carries them out on its nodes and reports back. The boundary is the node agent's own verbs,
typed end to end, after TorchX's ``Scheduler`` (a few verbs, typed results, a dry run):

* ``place`` an attempt (a host and its reserved ports), ``release`` the placement once it ended;
* ``start`` a batch of :class:`LaunchRequest` s (each carries the :class:`LaunchSpec` an agent
  runs), getting back an :class:`InstanceHandle` or a :class:`StartFailure` per request;
* ``observe`` attempts by handle (an :class:`Observation` each), ``stop`` them (grace, then
  KILL), ``forget`` those whose exits the controller stored;
* ``recover`` the handle of an attempt an earlier controller started but never recorded, and
  ``adopt`` one it did record;
* ``reserve_gang`` / ``release_gang`` a job's instances as :class:`Resources` bundles at once.

Everything that crosses is a frozen dataclass. A handle is an :class:`InstanceHandle` on every
backend (node + attempt id, pid and ports for people and re-adoption); it becomes JSON only at
the store's edge (the column type of ``InstanceRow.handle``) and on an agent's wire. An
attempt's phase has one vocabulary, :class:`~trainmaster.contract.InstancePhase`, which agents
report and backends pass on; :func:`trainmaster.spec.states.observed_state` maps it onto the
controller's instance states, in one place. Backends are found by name in a registry
(:mod:`trainmaster.backends.registry`): the built-in ones, and third-party ones installed in the
entry point group ``trainmaster.backends``, as frameworks are. The dry run (``job run
--dry-run``) builds the same :class:`LaunchSpec` s the controller would hand a backend, without one.

This module sits on the controller's layer (``tools/layers.py``): the controller imports it and
never a backend; backends implement it a layer above, and the API layer picks one by name. A new
backend subclasses :class:`Backend` (six abstract verbs; the rest have defaults that fit a
backend without gangs or exit watches), gives a ``create(options: BackendOptions)`` factory,
is named in ``registry.BUILTIN`` (or an entry point), and passes the shared behavioural suite
(``tests/backends``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from trainmaster.contract import InstanceHandle, InstancePhase, InstanceStatus, LaunchSpec

__all__ = [
    "Backend",
    "BackendOptions",
    "GangReservation",
    "InstanceHandle",
    "InstancePhase",
    "LaunchRequest",
    "Observation",
    "Placement",
    "PlacementRequest",
    "Resources",
    "StartFailure",
    "observation",
]


@dataclass(frozen=True)
class Resources:
    """CPUs, bytes of memory and GPUs: what a backend holds, what is free, what an instance or a
    gang bundle needs."""

    cpu: float = 0.0
    memory: int = 0
    gpu: int = 0

    def fits(self, need: Resources) -> bool:
        return need.cpu <= self.cpu + 1e-9 and need.memory <= self.memory and need.gpu <= self.gpu

    def minus(self, used: Resources) -> Resources:
        return Resources(self.cpu - used.cpu, self.memory - used.memory, self.gpu - used.gpu)

    def plus(self, freed: Resources) -> Resources:
        return Resources(self.cpu + freed.cpu, self.memory + freed.memory, self.gpu + freed.gpu)


@dataclass(frozen=True)
class BackendOptions:
    """What a backend is built with (the ``run`` / ``server`` flags): its factory's argument."""

    cpus: float | None = None  # CPUs the local backend offers (default: the machine's)
    address: str | None = None  # the cluster to join (Ray's address); None: the backend's default


@dataclass(frozen=True)
class PlacementRequest:
    """What a new attempt needs from a node: ``ports`` ports (the i-th is ``wanted_ports[i]``,
    the role's declared containerPorts, where free on that host) and its resources.
    ``annotations`` are the job's: a backend that can pin a role to a host reads them (the
    testbed's ``testbed/<role>``)."""

    role: str
    ports: int
    resources: Resources = Resources()
    wanted_ports: tuple[int, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where an instance will run: its host and the ports reserved for it there."""

    host: str
    ports: list[int]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.ports[0]}" if self.ports else self.host


@dataclass(frozen=True)
class LaunchRequest:
    """One attempt of one instance, as the controller hands it to a backend: where it was placed,
    the typed launch contract a node agent starts (:class:`LaunchSpec`), and the role's
    resources (the Ray backend charges the attempt to a gang bundle of that size)."""

    placement: Placement
    spec: LaunchSpec
    resources: Resources = Resources()

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


@dataclass(frozen=True)
class Observation:
    """One attempt as its backend sees it now."""

    phase: InstancePhase
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


@dataclass(frozen=True)
class GangReservation:
    """The answer to :meth:`Backend.reserve_gang`: reserved, or why not yet (the job stays
    pending with that reason)."""

    reserved: bool
    reason: str = ""


# reasons that only restate the exit code; the controller's messages already say it
_PLAIN_REASONS = ("Completed", "Error")


def observation(status: InstanceStatus) -> Observation:
    """What a node agent's :class:`InstanceStatus` tells the controller (every agent-backed
    backend reports through this one function)."""
    cpu, peak = status.cpu_seconds, status.peak_rss
    if status.phase == InstancePhase.STARTING:
        return Observation(
            InstancePhase.STARTING,
            reason=status.reason or "WaitingForDependencies",
            cpu_seconds=cpu,
            peak_rss=peak,
        )
    if status.phase == InstancePhase.RUNNING:
        return Observation(
            InstancePhase.RUNNING, command_started=status.command_started_at, cpu_seconds=cpu, peak_rss=peak
        )
    if status.phase == InstancePhase.EXITED:
        return Observation(
            InstancePhase.EXITED,
            exit_code=status.exit_code,
            reason="" if status.reason in _PLAIN_REASONS else status.reason,
            message=status.message,
            command_started=status.command_started_at,
            cpu_seconds=cpu,
            peak_rss=peak,
        )
    if status.phase == InstancePhase.LOST:
        return Observation(InstancePhase.LOST, reason="Lost", message=status.message)
    return Observation(status.phase, reason=status.reason, message=status.message)


class Backend(ABC):
    """A place where instances run (see the module's design note)."""

    name: str = ""
    running_at_start: bool = False  # a started attempt without a wait step runs at once (no observe needed)
    runs_containers: bool = False  # its agents run LaunchSpec.container (podman); else roles run on the host
    runs_processes: bool = True  # False: simulated nodes (hollow) that write no files in a job's run folder
    # how its instances reach the controller's instance channel: "unix" (a socket on this
    # machine: local agent, testbed hosts) or "tcp" (instances on other machines: Ray nodes, pods)
    instance_channel: str = "unix"

    @abstractmethod
    def capacity(self) -> Resources:
        """Total resources of the backend (admission compares requests against it)."""

    @abstractmethod
    def place(self, request: PlacementRequest) -> Placement:
        """Choose where a new attempt goes and reserve its ports there."""

    @abstractmethod
    def release(self, placement: Placement) -> None:
        """Free a placement's reservations (ports) once its attempt has ended."""

    def prepare_start(self, log_paths: list[str]) -> None:
        """A hint, given while the controller's pass still builds and commits the intents of
        attempts whose logs are ``log_paths``: make ready what starting them will need, on cores
        the pass leaves idle. Nothing may run yet, and the start may never come (the pass may
        fail, the job end first). It never raises. The default does nothing."""

    @abstractmethod
    def start(self, requests: list[LaunchRequest]) -> Iterator[InstanceHandle | StartFailure]:
        """Start attempts; their handles come back in order, each as soon as it is known, so
        the caller records one before the next starts. One the OS refuses (a missing working
        directory, an executable that cannot run) comes back as a :class:`StartFailure` and
        the others still start. The caller has created no ``instance_dir``: agents do."""

    @abstractmethod
    def observe(self, handles: list[InstanceHandle]) -> list[Observation]:
        """Each attempt's phase now, in order (one round trip where the backend can)."""

    @abstractmethod
    def stop(self, handles: list[InstanceHandle], grace: float) -> None:
        """Stop attempts: ask politely, then force after ``grace`` seconds. A backend may return
        once the stop is durably under way rather than done (Kubernetes: the deletions accepted
        by the API server) if it guarantees the processes end soon after ``grace`` and that no
        later attempt of the same instance starts while an earlier one still runs."""

    def forget(self, handles: list[InstanceHandle]) -> None:
        """The controller has stored these ended attempts' exits; the backend may drop them."""

    def recover(self, instance_id: str, instance_dir: str) -> InstanceHandle | None:
        """The handle of an attempt started under ``instance_id`` (its files in ``instance_dir``)
        whose handle was never recorded (the controller died between the start and saving it),
        running or ended; None if it never started."""
        return None

    def adopt(self, handle: InstanceHandle) -> bool:
        """Re-attach to an attempt an earlier controller started, holding its ports again so no
        new instance is given them; False if it is gone."""
        return self.observe([handle])[0].phase in (InstancePhase.STARTING, InstancePhase.RUNNING)

    def reserve_gang(self, job_id: int, bundles: list[Resources]) -> GangReservation:
        """Reserve every instance's resources of a job at once (gang scheduling), one bundle
        per instance. Backends without such a mechanism rely on the controller's own capacity
        accounting and accept at once."""
        return GangReservation(True)

    def release_gang(self, job_id: int) -> None:
        """Free what :meth:`reserve_gang` reserved (called when the job ends)."""

    def watch_exits(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever an attempt ends (a server's reconcile loop then runs its next
        pass at once instead of after its interval). Backends that cannot tell leave it uncalled."""

    def close(self) -> None:
        """Release backend-wide resources (never the attempts: they outlive a controller)."""
