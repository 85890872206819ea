"""The testbed backend: instances run on the hosts of a testbed (``trainmaster testbed up``).

Each host runs its own node agent (:mod:`trainmaster.testbed.agents`: the agent daemon inside
the host's network namespace, with its own state dir, journal and cgroups), so this backend is a
thin router: it places an instance on a host, hands that host's agent the instance's typed
:class:`LaunchSpec` (one batch per host), and sends every later call for an instance to the agent
named by its :class:`InstanceHandle`'s ``node``. Each instance gets its host's address as
``TM_HOST`` and ports free on that host, so roles really talk across the testbed's capped links.

Placement: round robin over ``h1..hN``; a job pins a role to a host with an annotation
``testbed/<role>: <host>`` (``sw`` is the switch host, where a forwarding node belongs).
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from dataclasses import replace
from typing import Iterator, Sequence

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
from trainmaster.backends.local import machine_resources
from trainmaster.contract import InstanceHandle, InstancePhase, LaunchSpec
from trainmaster.errors import UserError
from trainmaster.testbed import SWITCH, Testbed, iproute
from trainmaster.testbed.agents import HostAgentClient, host_agent_dir

PIN_ANNOTATION = "testbed/"
FIRST_PORT, LAST_PORT = 20000, 32000  # below Linux's ephemeral range: never an outgoing port
TESTBED_VARIABLE = "TRAINMASTER_TESTBED"  # the testbed of `--backend testbed` (default prefix: tm)


def create(options: BackendOptions) -> TestbedBackend:
    """The registry's factory (``--backend testbed``): the testbed of ``trainmaster testbed up``
    (``--prefix tm``, or ``$TRAINMASTER_TESTBED``)."""
    return TestbedBackend(Testbed.load(os.environ.get(TESTBED_VARIABLE) or "tm"))


class TestbedBackend(Backend):
    name = "testbed"
    running_at_start = True  # an agent answers once every command of its batch has exec'd
    runs_containers = True  # each host's agent runs them in that host's network namespace
    __test__ = False

    def __init__(self, testbed: Testbed, capacity: Resources | None = None, linger: float = 10.0):
        iproute.require_root_and_tools()  # joining a host's namespace needs root too
        self._capacity = capacity or machine_resources()
        self.testbed = testbed
        hosts = [*testbed.host_names, SWITCH]
        self._host_of = {testbed.address(h): h for h in hosts}
        self._round_robin = itertools.cycle(testbed.host_names)
        self._taken: dict[str, set[int]] = {h: set() for h in hosts}  # ports in use, per host
        prefix = testbed.options.prefix
        self.agents = {h: HostAgentClient(host_agent_dir(prefix, h), h, testbed.namespace(h), linger) for h in hosts}

    def capacity(self) -> Resources:
        return self._capacity

    # ---- placement ---------------------------------------------------------------------------
    def place(self, request: PlacementRequest) -> Placement:
        """Round robin over the hosts, unless the job pins the role (``testbed/<role>: <host>``)."""
        host = request.annotations.get(PIN_ANNOTATION + request.role)
        if host is None:
            return self._place_on(next(self._round_robin), request.ports, request.wanted_ports)
        if host not in self.agents:
            raise UserError(
                f"annotation {PIN_ANNOTATION}{request.role}: no host {host!r} on testbed "
                f"{self.testbed.options.prefix!r} (hosts: "
                f"{', '.join(self.testbed.host_names)}, {SWITCH})"
            )
        return self._place_on(host, request.ports, request.wanted_ports)

    def _place_on(self, host: str, count: int, wanted: Sequence[int] = ()) -> Placement:
        """``count`` ports of ``host``: the declared ``wanted`` ones no instance there holds
        (a host's namespace holds nothing else), the rest free ones of our range."""
        taken = self._taken[host]
        declared = [p if p not in taken else None for p in list(wanted)[:count]]
        held = taken | {p for p in declared if p is not None}
        free = iter(p for p in range(FIRST_PORT, LAST_PORT) if p not in held)
        chosen = [p if p is not None else next(free, None) for p in declared]
        chosen += [next(free, None) for _ in range(count - len(chosen))]
        if None in chosen:
            raise RuntimeError(f"host {host} has no {count} free ports left in {FIRST_PORT}-{LAST_PORT}")
        ports = [p for p in chosen if p is not None]
        taken.update(ports)
        return Placement(self.testbed.address(host), ports)

    def release(self, placement: Placement) -> None:
        host = self._host_of.get(placement.host)
        if host is not None:
            self._taken[host].difference_update(placement.ports)

    def adopt(self, handle: InstanceHandle) -> bool:
        alive = super().adopt(handle)
        if alive and handle.node in self._taken:
            self._taken[handle.node].update(handle.ports)
        return alive

    # ---- the agents' protocol, routed by host ----------------------------------------------------
    def _host(self, request: LaunchRequest) -> str:
        host = self._host_of.get(request.placement.host)
        if host is None:
            raise RuntimeError(f"{request.placement.host} is not an address of testbed {self.testbed.options.prefix!r}")
        return host

    def start(self, requests: list[LaunchRequest]) -> Iterator[InstanceHandle | StartFailure]:
        """One round trip per host for the whole batch; results come back in request order."""
        by_host: dict[str, list[tuple[int, LaunchSpec]]] = defaultdict(list)
        for position, request in enumerate(requests):
            by_host[self._host(request)].append((position, request.spec))
        results: dict[int, InstanceHandle | StartFailure] = {}
        for host, batch in by_host.items():
            answers = self.agents[host].start([spec for _, spec in batch])
            for (position, spec), answer in zip(batch, answers):
                # the agent's handle (``node`` is the host) with the ports, which a controller
                # that adopts the instance after a restart must hold on that host again
                results[position] = (
                    replace(answer.handle, ports=list(spec.ports)) if answer.handle else StartFailure(answer.error)
                )
        return (results[position] for position in range(len(requests)))

    def observe(self, handles: list[InstanceHandle]) -> list[Observation]:
        found: dict[int, Observation] = {}
        for host, batch in _by_node(handles).items():
            if host not in self.agents:  # not an agent's handle (a pre-agent controller's)
                for position, _ in batch:
                    found[position] = Observation(
                        InstancePhase.LOST, reason="Lost", message=f"no agent of this testbed holds it (node {host!r})"
                    )
                continue
            statuses = self.agents[host].observe([h.instance_id for _, h in batch])
            for (position, _), status in zip(batch, statuses):
                found[position] = observation(status)
        return [found[position] for position in range(len(handles))]

    def stop(self, handles: list[InstanceHandle], grace: float) -> None:
        for host, batch in _by_node(handles).items():
            if host in self.agents:
                self.agents[host].stop([h.instance_id for _, h in batch], grace)

    def forget(self, handles: list[InstanceHandle]) -> None:
        for host, batch in _by_node(handles).items():
            if host in self.agents:
                self.agents[host].forget([h.instance_id for _, h in batch])

    def recover(self, instance_id: str, instance_dir: str) -> InstanceHandle | None:
        """Ask every host whose agent ever ran (an attempt ids one host only)."""
        for client in self.agents.values():
            if not client.has_run():
                continue
            status = client.observe([instance_id])[0]
            if status.phase != InstancePhase.LOST:  # the agent's handle: its node, pid and ports
                return InstanceHandle(client.node, instance_id, status.handle.pid, status.handle.ports)
        return None

    def close(self) -> None:
        for client in self.agents.values():
            client.close()


def _by_node(handles: list[InstanceHandle]) -> dict[str, list[tuple[int, InstanceHandle]]]:
    groups: dict[str, list[tuple[int, InstanceHandle]]] = defaultdict(list)
    for position, handle in enumerate(handles):
        groups[handle.node].append((position, handle))
    return groups
