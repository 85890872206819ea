"""Mechanism: no instance outlives its Ray node agent (issue 14 part 3; ``ray_agent.AgentGuard``
and ``ray_agent.take_owner_lock``). The actor's process hosts ``trainmaster.agent.NodeAgent``
beside a detached guard that holds the state dir's owner lock; when the host dies by kill -9, the
guard kills every process tree the agent owned (its main process, a child, a ``setsid``
double-forked daemon), cgroups or markers alike, and only then releases the lock, so the next
agent of the node (which takes the lock first) never runs beside the old instances.

No Ray cluster is needed: the host here is a plain process running what the actor's constructor
runs (:func:`trainmaster.backends.ray_agent.make_node_agent`'s parts with a test state dir)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainmaster
from controller_harness import pids_alive

pytest.importorskip("ray", reason="the optional ray extra (trainmaster[ray]) is not installed")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]
PACKAGE_ROOT = str(Path(trainmaster.__file__).resolve().parents[1])

# the host: guard first (it takes the owner lock), then the agent, then one instance whose command
# starts a child and a double-forked setsid daemon, each writing its pid; then it waits to be killed
HOST = """
import sys, time
from pathlib import Path
from trainmaster.contract import LaunchSpec
from trainmaster.agent.core import AgentOptions, NodeAgent
from trainmaster.backends.ray_agent import AgentGuard, take_owner_lock
state, work, use_cgroups = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
options = AgentOptions(state_dir=state, node="guardtest", use_cgroups=use_cgroups)
guard = AgentGuard(options, take_owner_lock(state))
agent = NodeAgent(options)
code = ("import os, subprocess, sys, time\\n"
        "w = sys.argv[1]\\n"
        "open(w + '/main', 'w').write(str(os.getpid()))\\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\\n"
        "open(w + '/child', 'w').write(str(c.pid))\\n"
        "if os.fork() == 0:\\n"
        "    os.setsid()\\n"
        "    if os.fork() == 0:\\n"
        "        open(w + '/daemon', 'w').write(str(os.getpid()))\\n"
        "        time.sleep(300)\\n"
        "    os._exit(0)\\n"
        "time.sleep(300)\\n")
spec = LaunchSpec(instance_id="guard/w-0/1", job_id=1, job_name="g", role="w", index=0, attempt=1,
                  argv=[sys.executable, "-c", code, str(work)], env={"PATH": "/usr/bin:/bin"}, cwd=None,
                  log_path=str(work / "w.log"), instance_dir=str(work / "w"), host="127.0.0.1")
[result] = agent.start([spec])
assert result.handle is not None, result.error
print("started", flush=True)
time.sleep(300)
"""


def modes() -> list:
    from trainmaster.agent.tree import cgroups_available

    why = cgroups_available()
    return [
        pytest.param(True, id="cgroups", marks=pytest.mark.skipif(bool(why), reason=why or "available")),
        pytest.param(False, id="markers"),
    ]


@pytest.mark.parametrize("use_cgroups", modes())
def test_the_guard_kills_a_dead_agents_trees_before_the_next_agent_may_start(tmp_path: Path, use_cgroups: bool) -> None:
    from trainmaster.backends.ray_agent import OWNER_LOCK, take_owner_lock

    state, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    pids: list[int] = []
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, str(state), str(work), "1" if use_cgroups else "0"],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": PACKAGE_ROOT},
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == b"started"
        deadline = time.monotonic() + 30
        while not all((work / n).exists() for n in ("main", "child", "daemon")) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int((work / n).read_text()) for n in ("main", "child", "daemon")]
        assert pids_alive(pids) == pids
        with pytest.raises(RuntimeError, match=OWNER_LOCK):  # the live agent (and its guard) hold it
            take_owner_lock(state, timeout=0.2)
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=30)
    try:
        fd = take_owner_lock(state, timeout=30)  # returns once the guard has cleaned up and exited
        os.close(fd)
        assert pids_alive(pids) == [], "an instance process outlived its agent"
    finally:
        clean_up(state, use_cgroups, pids)


def clean_up(state: Path, use_cgroups: bool, pids: list[int]) -> None:
    """What a failed test leaves: live instance processes and the agent's cgroups."""
    from trainmaster.agent.core import AgentOptions
    from trainmaster.agent.tree import kill_tree, make_trees

    for pid in pids_alive(pids):
        os.kill(pid, signal.SIGKILL)
    trees = make_trees(AgentOptions(state_dir=state, node="guardtest").node_key, use_cgroups)
    for name in trees.leftovers():
        kill_tree(trees, name)
        trees.remove(name)
    trees.close()
