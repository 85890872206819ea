"""The testbed backend: instances run on the hosts of a testbed (``trainmaster testbed up``).

Until each host runs its own node agent, this is the local backend with a per-host launcher:
an attempt is the local backend's process started inside the host's network namespace
(``ip netns exec`` execs it, so pid, process group and exit recording stay the local backend's).
Each instance gets its host's address as ``TM_HOST`` and ports free on that host, so roles
really talk across the testbed's capped links.

Placement: round robin over ``h1..hN``; a job pins a role to a host with an annotation
``testbed/<role>: <host>`` (``sw`` is the switch host, where a forwarding node belongs).
"""

from __future__ import annotations

import itertools
from typing import Any

from trainmaster.backends.base import Capacity, LaunchRequest, Placement
from trainmaster.backends.legacy_local import LegacySubprocessBackend
from trainmaster.errors import UserError
from trainmaster.testbed import SWITCH, Testbed, iproute

PIN_ANNOTATION = "testbed/"
FIRST_PORT, LAST_PORT = 20000, 32000  # below Linux's ephemeral range: never an outgoing port


class TestbedBackend(LegacySubprocessBackend):
    name = "testbed"
    __test__ = False

    def __init__(self, testbed: Testbed, capacity: Capacity | None = None):
        iproute.require_root_and_tools()  # entering a host's namespace needs root too
        super().__init__(capacity)
        self.testbed = testbed
        self._host_of = {testbed.address(h): h for h in [*testbed.host_names, SWITCH]}
        self._round_robin = itertools.cycle(testbed.host_names)
        self._taken: dict[str, set[int]] = {address: set() for address in self._host_of}  # ports in use, per host

    def place(self, ports: int, resources: dict[str, Any]) -> Placement:
        return self._place_on(next(self._round_robin), ports)

    def place_role(self, role: str, ports: int, resources: dict[str, Any],
                   annotations: dict[str, str]) -> Placement:
        host = annotations.get(PIN_ANNOTATION + role)
        if host is None:
            return self.place(ports, resources)
        if host not in self.testbed.host_names and host != SWITCH:
            raise UserError(f"annotation {PIN_ANNOTATION}{role}: no host {host!r} on testbed "
                            f"{self.testbed.options.prefix!r} (hosts: "
                            f"{', '.join(self.testbed.host_names)}, {SWITCH})")
        return self._place_on(host, ports)

    def _place_on(self, host: str, count: int) -> Placement:
        address = self.testbed.address(host)
        taken = self._taken[address]
        free = [p for p in range(FIRST_PORT, LAST_PORT) if p not in taken][:count]
        if len(free) < count:
            raise RuntimeError(f"host {host} has no {count} free ports left in "
                               f"{FIRST_PORT}-{LAST_PORT}")
        taken.update(free)
        return Placement(address, free)

    def release(self, placement: Placement) -> None:
        self._taken.get(placement.host, set()).difference_update(placement.ports)

    def adopt(self, handle: dict[str, Any]) -> bool:
        alive = super().adopt(handle)
        if alive and handle.get("host") in self._taken:
            self._taken[handle["host"]].update(handle.get("ports", []))
        return alive

    def spawn_spec(self, request: LaunchRequest) -> tuple[list[str], dict[str, str], str | None]:
        argv, env, cwd = super().spawn_spec(request)
        host = self._host_of.get(request.placement.host)
        if host is None:
            raise RuntimeError(f"{request.placement.host} is not an address of testbed "
                               f"{self.testbed.options.prefix!r}")
        return self.testbed.exec_argv(host, argv), env, cwd
