"""A whole deployment on loopback (CA, keys, configs, data files, one process per service).

Used by the tests and the benchmark; each service runs as ``python -m trainmaster ... serve`` in its
own session, exactly as a user would start it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from trainmaster.gateway.initiator.client import Initiator
from trainmaster.gateway.config import ServiceConfig, load_config
from trainmaster.gateway.crypto.provision import init_deployment, ports_needed
from trainmaster.gateway.executors.sandbox.bubblewrap import unavailable_reason as sandbox_unavailable_reason
from trainmaster.gateway.net.tls import client_ssl_context


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """A base port with ``n`` consecutive free ports (bind-tested) below the ephemeral range, so no
    outgoing connection of this machine takes one of them between the test and the services' bind."""
    rng = np.random.default_rng()
    high = max(20000 + n + 1, _ephemeral_low() - n)
    for _ in range(200):
        base = int(rng.integers(20000, high))
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def breast_cancer_split(n_parties: int) -> tuple[list[str], list[np.ndarray]]:
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    names = [n.replace(" ", "_") for n in d.feature_names] + ["label"]
    rows = np.column_stack([d.data, d.target.astype(float)])
    return names, np.array_split(rows, n_parties)


def write_csv(path: Path, names: list[str], rows: np.ndarray) -> None:
    with path.open("w") as fh:
        fh.write(",".join(names) + "\n")
        for r in rows:
            fh.write(",".join(repr(float(v)) for v in r) + "\n")


def wait_until_serving(cfg: ServiceConfig, endpoint: str, timeout_s: float = 30.0) -> None:
    """Poll ``endpoint``/v1/health over mutual TLS (as ``cfg``'s identity) until it answers."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(verify=client_ssl_context(cfg), timeout=2.0) as http:
        while time.monotonic() < deadline:
            try:
                if http.get(f"{endpoint}/v1/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{endpoint} did not answer /v1/health within {timeout_s}s")


class Deployment:
    """Gateway + parties as separate processes; party i holds data id ``m_<name>``."""

    def __init__(
        self,
        root: Path,
        parties: list[str],
        overrides: dict[str, dict[str, Any]] | None = None,
        initiators: list[str] | None = None,
    ):
        self.root, self.parties = root, parties
        self.initiators = initiators or ["initiator"]
        self.configs = init_deployment(
            root / "deploy", parties, port_base=free_port_block(ports_needed(len(parties))), initiators=initiators
        )
        self.isolation_fallback = sandbox_unavailable_reason()
        if self.isolation_fallback is not None:  # e.g. not root: executors run unsandboxed here, and say so
            warnings.warn(f"local deployment runs executors with isolation: process: {self.isolation_fallback}")
            overrides = {p: {"isolation": "process", **(overrides or {}).get(p, {})} for p in parties} | {
                k: v for k, v in (overrides or {}).items() if k not in parties
            }
        for name, extra in (overrides or {}).items():
            data = yaml.safe_load(self.configs[name].read_text())
            data.update(extra)
            self.configs[name].write_text(yaml.safe_dump(data))
        self.names, self.splits = breast_cancer_split(len(parties))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name, rows in zip(parties, self.splits):
            d = root / "data" / name
            d.mkdir(parents=True)
            write_csv(d / f"m_{name}.csv", self.names, rows)

    def cfg(self, name: str) -> ServiceConfig:
        return load_config(self.configs[name])

    def start(self, name: str) -> None:
        if name == "gateway":
            args = ["gateway", "serve", "--config", str(self.configs[name])]
        else:
            args = ["party", "serve", "--config", str(self.configs[name]), "--data", str(self.root / "data" / name)]
        log = open(self.root / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "trainmaster", *args], stdout=log, stderr=log, start_new_session=True
        )

    def wait_ready(self, name: str, timeout_s: float = 30.0) -> None:
        cfg = self.cfg(name)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(verify=client_ssl_context(self.cfg("operator")), timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited: {(self.root / f'{name}.log').read_text()[-2000:]}")
                try:
                    if http.get(f"https://{cfg.host}:{cfg.port}/v1/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{name} not ready within {timeout_s}s")

    def start_all(self) -> "Deployment":
        """Start every service and wait until each answers; if one does not, stop them all."""
        try:
            for name in ["gateway", *self.parties]:
                self.start(name)
            for name in ["gateway", *self.parties]:
                self.wait_ready(name)
        except BaseException:
            self.stop_all()
            raise
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)

    def health(self, name: str) -> dict[str, Any]:
        """The service's health with its counters (asked as the operator: only it sees them)."""
        cfg = self.cfg(name)
        with httpx.Client(verify=client_ssl_context(self.cfg("operator")), timeout=5.0) as http:
            return http.get(f"https://{cfg.host}:{cfg.port}/v1/health").json()

    def initiator(self, timeout_s: float = 60.0, name: str | None = None, **options: Any) -> Initiator:
        name = name or self.initiators[0]
        return Initiator(self.cfg(name), timeout_s=timeout_s, results_dir=self.root / "results" / name, **options)

    def url(self, name: str) -> str:
        cfg = self.cfg(name)
        return f"https://{cfg.host}:{cfg.port}"
