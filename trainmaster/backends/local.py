"""The local backend: one node agent on this machine owns every instance process.

This is a thin client: the agent (``python -m trainmaster.agent``, started on first use and
shared by every controller of the same Trainmaster home) spawns, tracks, stops and journals the
instances; the backend chooses ports, hands the agent typed :class:`LaunchSpec` s in one batch,
and passes the agent's :class:`InstanceStatus` on as the controller's :class:`Observation`. A
handle is the agent's :class:`InstanceHandle`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import psutil

from trainmaster.agent.client import AgentClient, AgentUnavailable
from trainmaster.backends.base import (
    Backend,
    BackendOptions,
    LaunchRequest,
    Observation,
    Placement,
    PlacementRequest,
    Resources,
    StartFailure,
    observation,
)
from trainmaster.backends.ports import PortPool
from trainmaster.contract import InstanceHandle, InstancePhase
from trainmaster.store.db import home

log = logging.getLogger(__name__)

NODE = "local"
WATCH_SECONDS = 5.0  # one wait_exit request (the watcher asks again right after; it ends this long after close)
WATCH_RETRY = 1.0  # seconds between attempts to reach an agent that is not there


def agent_state_dir() -> Path:
    """Where the local node agent keeps its journal, socket, lock and log."""
    return home() / "agent"


def create(options: BackendOptions) -> LocalBackend:
    """The registry's factory (``--backend local``): this machine, or ``options.cpus`` of it."""
    machine = machine_resources()
    return LocalBackend(machine if options.cpus is None else replace(machine, cpu=options.cpus))


def machine_resources() -> Resources:
    """This machine's CPUs and memory."""
    return Resources(cpu=float(os.cpu_count() or 1), memory=psutil.virtual_memory().total)


class LocalBackend(Backend):
    name = "local"
    running_at_start = True  # the agent answers once every command has exec'd
    runs_containers = True

    def __init__(
        self,
        capacity: Resources | None = None,
        host: str = "127.0.0.1",
        state_dir: Path | None = None,
        linger: float = 10.0,
        watch_seconds: float = WATCH_SECONDS,
    ):
        self._capacity = capacity or machine_resources()
        self._host = host
        self._ports = PortPool(host)
        self.agent = AgentClient(state_dir or agent_state_dir(), node=NODE, linger=linger)
        self._watcher: threading.Thread | None = None
        self._wakes: list[Callable[[], Callable[[], None] | None]] = []  # weak references to wakes
        self._closing = threading.Event()
        self._watch_seconds = watch_seconds

    def capacity(self) -> Resources:
        return self._capacity

    def place(self, request: PlacementRequest) -> Placement:
        return Placement(self._host, self._ports.take(request.ports, request.wanted_ports))

    def release(self, placement: Placement) -> None:
        self._ports.release(placement.ports)

    def prepare_start(self, log_paths: list[str]) -> None:
        """The agent creates the instances' log files on a thread of its own while the pass
        commits (see :meth:`NodeAgent.prepare`); an agent that cannot be reached now is met
        again, and reported, by the start."""
        try:
            self.agent.prepare(log_paths)
        except AgentUnavailable as exc:
            log.debug("the node agent did not take the hint to prepare %d start(s): %s", len(log_paths), exc)

    def start(self, requests: list[LaunchRequest]) -> Iterator[InstanceHandle | StartFailure]:
        """One round trip to the agent for the whole batch."""
        for result in self.agent.start([r.spec for r in requests]):
            yield result.handle if result.handle else StartFailure(result.error)

    def observe(self, handles: list[InstanceHandle]) -> list[Observation]:
        if not handles:
            return []
        return [observation(s) for s in self.agent.observe([h.instance_id for h in handles])]

    def stop(self, handles: list[InstanceHandle], grace: float) -> None:
        if handles:
            self.agent.stop([h.instance_id for h in handles], grace)

    def forget(self, handles: list[InstanceHandle]) -> None:
        if handles:
            self.agent.forget([h.instance_id for h in handles])

    def recover(self, instance_id: str, instance_dir: str) -> InstanceHandle | None:
        status = self.agent.observe([instance_id])[0]
        if status.phase == InstancePhase.LOST:
            return None
        return InstanceHandle(NODE, instance_id, status.handle.pid, status.handle.ports)

    def adopt(self, handle: InstanceHandle) -> bool:
        self._ports.hold(handle.ports)  # held until its exit is observed (then released), live or not
        return super().adopt(handle)

    def watch_exits(self, wake: Callable[[], None]) -> None:
        """A daemon thread on a connection of its own blocks in the agent's ``wait_exit`` and
        calls every registered ``wake`` after each change (an exit or a refused start); one
        thread per backend, whatever the number of controllers using it.

        The thread holds the backend and the wakes' owners only weakly: a backend dropped
        without :meth:`close` ends its watcher (and the watcher's connection, which would keep
        the agent from lingering out) within one ``wait_exit`` of being collected."""
        if self._watcher is not None and any(ref() == wake for ref in self._wakes):
            return  # already woken by it (a controller's run_job called again)
        self._wakes.append(weakref.WeakMethod(wake) if hasattr(wake, "__self__") else (lambda: wake))
        if self._watcher is not None:
            return
        client = AgentClient(self.agent.state_dir, node=NODE, start=False)
        self._watcher = threading.Thread(
            target=_watch,
            args=(client, self._wakes, self._closing, self._watch_seconds),
            name="agent-exits",
            daemon=True,
        )
        weakref.finalize(self, self._closing.set)
        self._watcher.start()

    def close(self) -> None:
        self._closing.set()
        self.agent.close()


def _watch(
    client: AgentClient,
    wakes: list[Callable[[], Callable[[], None] | None]],
    closing: threading.Event,
    seconds: float,
) -> None:
    """The exit watcher's loop (a function, not a method: it must not keep its backend alive)."""
    seen = -1
    while not closing.is_set():
        try:
            count = client.wait_exit(seen, seconds)
        except AgentUnavailable as exc:  # no agent now (none started yet, or it was killed)
            log.debug("waiting %.0fs for the node agent to watch exits: %s", WATCH_RETRY, exc)
            closing.wait(WATCH_RETRY)
            continue
        if count != seen:
            if seen >= 0 or count > 0:
                for ref in list(wakes):
                    wake = ref()
                    if wake is not None:
                        wake()
            seen = count
    client.close()
