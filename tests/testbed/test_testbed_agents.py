"""Mechanisms: one node agent per testbed host (issue #14 part B, issue #16 section 1).

Each host's agent runs inside the host's network namespace with its own state dir, journal and
cgroups; the testbed backend routes every call by the handle's host. kill -9 of one host's
agent restarts only that host's instances (AgentRestarted, exit journaled), never two copies of a
replica at once; cancel leaves zero processes of the job (detached ones included); ``testbed
down`` stops the agents and leaves no process, cgroup or namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent_fixtures import ESCAPERS, PY, doubles, escapers, job_processes, shell_parent, starts
from helpers import wait_until
from controller_harness import Harness, events, job, step_until
from trainmaster.agent.client import agent_pid
from trainmaster.agent.core import AgentOptions
from trainmaster.agent.tree import CGROUP_ROOT, _own_cgroup, cgroups_available
from trainmaster.backends.testbed import TestbedBackend
from trainmaster.testbed import Testbed
from trainmaster.testbed.agents import host_agent_dir


RESTART_TWICE = {"policy": "OnFailure", "maxRestarts": 2, "backoffSeconds": 0}


def _namespace_of(pid: int) -> str:
    return subprocess.run(
        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True, timeout=20
    ).stdout.strip()


def _alive(pid: int) -> bool:
    """Exists and is not a zombie (an agent this test process spawned is one until reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _running(h: Harness, job_id: int, count: int, restarts: int | None = None) -> dict[str, Any]:
    return step_until(
        h,
        job_id,
        lambda s: (
            sum(i["state"] == "running" and (restarts is None or i["restarts"] == restarts) for i in s["instances"])
            == count
        ),
    )


def _cgroup_parents(bed: Testbed) -> list[Path]:
    """This testbed's agents' cgroup parents that exist now (one per host that ran an agent)."""
    own = _own_cgroup("pids")
    if cgroups_available() or own is None:
        return []
    found = []
    for host in [*bed.host_names, "sw"]:
        key = AgentOptions(host_agent_dir(bed.options.prefix, host).resolve(), node=host).node_key
        path = CGROUP_ROOT / "pids" / own.lstrip("/") / "trainmaster" / key
        if path.exists():
            found.append(path)
    return found


@pytest.fixture
def testbed_harness(make_testbed, tmp_path: Path):
    bed = make_testbed(hosts=2, link_rate=None)
    h = Harness(tmp_path, backend=TestbedBackend(bed))
    try:
        yield bed, h
    finally:
        h.backend.close()


def test_kill9_of_a_host_agent_restarts_only_its_instances_never_twice(
    testbed_harness, tmp_path: Path, isolated_home: Path
) -> None:
    """Each host's instances are children of that host's agent, inside the host's namespace.
    kill -9 of h1's agent: the next call starts a new agent on h1, which kills what the old one
    left and journals it AgentRestarted before any start; the restart policy starts h1's replica
    again; h2's replica is untouched; no replica ever had two live copies."""
    bed, h = testbed_harness
    locks = [tmp_path / f"r{n}.lock" for n in range(2)]
    job_id = h.submit(
        job(
            "hostagent",
            [
                {"name": f"r{n}", "command": shell_parent(lock, 300), "restartPolicy": RESTART_TWICE}
                for n, lock in enumerate(locks)
            ],
        )
    )
    status = _running(h, job_id, 2)
    wait_until(lambda: all(starts(lock) == 1 for lock in locks), what="both replicas")
    hosts = {i["role"]: i["address"].split(":")[0] for i in status["instances"]}
    assert hosts == {"r0": bed.address("h1"), "r1": bed.address("h2")}
    agents = {host: agent_pid(host_agent_dir(bed.options.prefix, host)) for host in ("h1", "h2")}
    assert None not in agents.values() and len(set(agents.values())) == 2
    for host, pid in agents.items():
        assert _namespace_of(pid) == bed.namespace(host)  # type: ignore[arg-type]
    for inst in status["instances"]:
        host = "h1" if inst["role"] == "r0" else "h2"
        assert _namespace_of(inst["pid"]) == bed.namespace(host)

    os.kill(agents["h1"], signal.SIGKILL)  # type: ignore[arg-type]
    status = step_until(
        h,
        job_id,
        lambda s: (
            {(i["role"], i["state"], i["restarts"]) for i in s["instances"]}
            == {("r0", "running", 1), ("r1", "running", 0)}
        ),
    )
    wait_until(lambda: starts(locks[0]) == 2, what="r0's second attempt")
    new_h1 = agent_pid(host_agent_dir(bed.options.prefix, "h1"))
    assert new_h1 not in (None, agents["h1"]) and _namespace_of(new_h1) == bed.namespace("h1")  # type: ignore[arg-type]
    assert agent_pid(host_agent_dir(bed.options.prefix, "h2")) == agents["h2"]
    restarting = events(status, "Restarting")
    assert len(restarting) == 1 and "AgentRestarted" in restarting[0]["message"]
    assert starts(locks[1]) == 1
    h.controller.cancel(job_id)
    assert h.controller.run_job(job_id) == "cancelled"
    assert doubles(tmp_path) == [] and job_processes(isolated_home) == []


def test_cancel_and_testbed_down_leave_no_process_cgroup_or_namespace(testbed_harness, isolated_home: Path) -> None:
    """cancel of a job spread over both hosts leaves none of its processes, setsid grandchildren
    and double-forked daemons included; then ``down`` with a second job still running stops
    the hosts' agents and leaves no agent, instance process, cgroup or namespace."""
    bed, h = testbed_harness
    job_id = h.submit(job("escapes", [{"name": "w", "replicas": 2, "command": [PY, "-c", ESCAPERS, "300"]}]))
    status = _running(h, job_id, 2)
    assert {i["address"].split(":")[0] for i in status["instances"]} == {bed.address("h1"), bed.address("h2")}
    wait_until(lambda: len(escapers()) == 4, what="two escapers per replica")
    h.controller.cancel(job_id)
    assert h.controller.run_job(job_id) == "cancelled"
    assert escapers() == [] and job_processes(isolated_home) == []

    second = h.submit(job("left", [{"name": "w", "replicas": 2, "command": [PY, "-c", ESCAPERS, "300"]}]))
    _running(h, second, 2)
    wait_until(lambda: len(escapers()) == 4, what="the second job's escapers")
    agents = [agent_pid(host_agent_dir(bed.options.prefix, host)) for host in ("h1", "h2")]
    if not cgroups_available():  # each host's agent owns its own cgroup parent
        assert len(_cgroup_parents(bed)) == 2
    h.backend.close()
    bed.down()
    assert escapers() == [] and job_processes(isolated_home) == []
    assert not any(_alive(pid) for pid in agents if pid is not None)
    assert _cgroup_parents(bed) == []
    assert not host_agent_dir(bed.options.prefix, "h1").parent.exists()
