"""Helpers of the container tests (a plain module, not conftest: several conftest.py files live in
this tree and ``from conftest import`` would pick whichever loaded first)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from helpers import wait_until
from trainmaster.agent.client import AgentClient, ensure_agent
from trainmaster.contract import ContainerLaunch, InstancePhase, InstanceStatus, LaunchSpec
from trainmaster.agent.core import AgentOptions
from trainmaster.containers.runtime import AGENT_LABEL, ContainerRuntime

REPO = str(Path(__file__).resolve().parents[1])


def labelled(podman: ContainerRuntime, key: str, running_only: bool = False) -> list[str]:
    argv = [*podman.base(), "ps", "--filter", f"label={AGENT_LABEL}={key}", "--format", "{{.Names}}"]
    if not running_only:
        argv.insert(len(podman.base()) + 1, "--all")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.split()


class AgentUnderTest:
    """A node agent daemon of the test's own, and what a test asks of it."""

    def __init__(self, state_dir: Path, tmp_path: Path):
        self.state_dir, self.tmp_path = state_dir, tmp_path
        self.key = AgentOptions(state_dir=state_dir).node_key
        self.start_daemon()

    def start_daemon(self) -> None:
        ensure_agent(self.state_dir, linger=60)
        self.client = AgentClient(self.state_dir, linger=60)

    def spec(
        self, name: str, container: ContainerLaunch, attempt: int = 1, env: dict[str, str] | None = None, **extra: Any
    ) -> LaunchSpec:
        return LaunchSpec(
            instance_id=f"job/{name}/{attempt}",
            job_id=1,
            job_name="job",
            role=name,
            index=0,
            attempt=attempt,
            argv=[],
            env=dict(env or {}),
            cwd=None,
            log_path=str(self.tmp_path / f"{name}.log"),
            instance_dir=str(self.tmp_path / name),
            host="127.0.0.1",
            container=container,
            **extra,
        )

    def run(self, specs: list[LaunchSpec], timeout: float = 90) -> list[InstanceStatus]:
        results = self.client.start(specs)
        assert all(r.handle for r in results), [r.error for r in results]
        return self.exited([s.instance_id for s in specs], timeout)

    def exited(self, ids: list[str], timeout: float = 90) -> list[InstanceStatus]:
        def done() -> list[InstanceStatus] | None:
            statuses = self.client.observe(ids)
            return statuses if all(s.phase == InstancePhase.EXITED for s in statuses) else None

        return wait_until(done, timeout, f"{ids} to exit")

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()


def container_cgroups(key: str = "") -> list[str]:
    """The container cgroup parents of an agent key (every agent's with ``key`` empty)."""
    return sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"*/trainmaster-containers/{key or '*'}"))
