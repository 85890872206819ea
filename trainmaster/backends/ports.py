"""Ports handed to instances on one host: free by the OS's word and held by no live instance of
ours (the OS alone cannot say so for a port reserved but not yet bound)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

TRIES = 100


class PortPool:
    def __init__(self, host: str):
        self.host = host
        self._held: set[int] = set()

    def take(self, count: int, wanted: Sequence[int] = ()) -> list[int]:
        """``count`` ports; the i-th is ``wanted[i]`` (a role's declared containerPort) where no
        instance of ours holds it and nothing is bound to it here, else a free one."""
        return [
            wanted[i] if i < len(wanted) and self._take_wanted(wanted[i]) else self._take_one() for i in range(count)
        ]

    def _take_wanted(self, port: int) -> bool:
        if port in self._held:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed port in TIME_WAIT is free
            try:
                sock.bind((self.host, port))
            except OSError:
                return False
        self._held.add(port)
        return True

    def _take_one(self) -> int:
        for _ in range(TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((self.host, 0))
                port = sock.getsockname()[1]
            if port not in self._held:
                self._held.add(port)
                return port
        raise RuntimeError(f"could not find a free port on {self.host} after {TRIES} tries")

    def release(self, ports: list[int]) -> None:
        self._held.difference_update(ports)

    def hold(self, ports: list[int]) -> None:
        """Ports an adopted instance already uses: no new instance is given them."""
        self._held.update(ports)
