"""One node agent per testbed host: where each keeps its state, how it is reached, how ``down``
ends them all.

A host's agent is the ordinary agent daemon (``python -m trainmaster.agent``) started with
``--netns <prefix>-<host>``: it joins the host's network namespace before anything else, so every
instance it spawns lives on that host (its sockets bind the host's address and cross the
testbed's links), while its cgroups, journal and Unix socket stay on the machine's file system.
Each host has its own state dir (``<home>/testbed/<prefix>/<host>/``), so each has its own lock,
journal and cgroup parent: a host's agent never touches another host's instances.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

from trainmaster.agent.client import AgentClient, agent_pid, ensure_agent
from trainmaster.agent.core import AgentOptions
from trainmaster.agent.tree import kill_tree, make_trees
from trainmaster.testbed.options import state_dir

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.jsonl"


def agents_dir(prefix: str) -> Path:
    """Where the agents of testbed ``prefix`` keep their state (one folder per host)."""
    return state_dir() / prefix


def host_agent_dir(prefix: str, host: str) -> Path:
    return agents_dir(prefix) / host


class HostAgentClient(AgentClient):
    """The agent of one testbed host: started on first use inside ``namespace``, and started
    again (inside it) when a call finds it gone, as the local backend's client does."""

    def __init__(self, state_dir: Path, host: str, namespace: str, linger: float = 10.0):
        super().__init__(state_dir, node=host, linger=linger, start=False)
        self.namespace = namespace

    def _connect(self) -> None:
        ensure_agent(self.state_dir, self.node, self.linger, extra_args=("--netns", self.namespace))
        super()._connect()

    def has_run(self) -> bool:
        """Whether an agent ever ran for this host (its journal exists): only those can hold
        an attempt, so only those are asked about one."""
        return (self.state_dir / JOURNAL_NAME).exists()


def stop_host_agents(prefix: str, grace: float = 5.0, timeout: float = 20.0) -> list[str]:
    """End every host agent of testbed ``prefix`` and leave nothing of them: SIGTERM (each stops
    its instances, grace then KILL, and removes their cgroups), SIGKILL after ``timeout``, then
    kill and remove whatever cgroups a killed agent left, and delete their state. Returns the
    hosts whose agent was running. Idempotent; works from the state dirs alone."""
    root = agents_dir(prefix)
    if not root.is_dir():
        return []
    dirs = sorted(p for p in root.iterdir() if p.is_dir())
    running = {d: pid for d in dirs if (pid := _agent_of(d)) is not None}
    for pid in running.values():
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace + timeout
    delay = 0.02
    while any(_alive(pid) for pid in running.values()) and time.monotonic() < deadline:
        time.sleep(delay)  # sleeping, not spinning: 20 ms up to 0.25 s
        delay = min(delay * 2, 0.25)
    for folder, pid in running.items():
        if _alive(pid):
            log.warning(
                "the agent of %s (pid %d) did not stop within %.0fs; killing it", folder.name, pid, grace + timeout
            )
            _signal(pid, signal.SIGKILL)
    for folder in dirs:
        _remove_leftover_trees(folder)
    shutil.rmtree(root, ignore_errors=True)
    return [folder.name for folder in running]


def _agent_of(folder: Path) -> int | None:
    """The pid of the agent serving ``folder``, if that pid is still that agent."""
    pid = agent_pid(folder)
    if pid is None:
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if str(folder).encode() in cmdline and _alive(pid) else None


def _remove_leftover_trees(folder: Path) -> None:
    """Kill and remove the instance cgroups of an agent that did not clean up (it was killed)."""
    options = AgentOptions(folder.resolve(), node=folder.name)
    trees = make_trees(options.node_key)
    for name in trees.leftovers():
        kill_tree(trees, name)
        if not trees.remove(name):
            log.warning("could not remove the cgroups of %s of host %s", name, folder.name)
    trees.close()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
