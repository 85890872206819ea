"""Ports handed to instances on one host: free by the OS's word and held by no live instance of
ours (the OS alone cannot say so for a port reserved but not yet bound)."""

from __future__ import annotations

import socket

TRIES = 100


class PortPool:
    def __init__(self, host: str):
        self.host = host
        self._held: set[int] = set()

    def take(self, count: int) -> list[int]:
        return [self._take_one() for _ in range(count)]

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
