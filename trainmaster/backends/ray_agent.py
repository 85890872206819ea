"""The node agent on Ray: one long-lived actor per Ray node that owns that node's instances.

Why one actor per node and not one per instance: an actor costs Ray a worker process (seconds of
CPU to start), so 64 replicas as 64 actors took ~21 s to run; one agent per node takes a whole
batch of launch specs in one call and spawns them directly, as the local agent does.

The actor runs :class:`trainmaster.agent.NodeAgent` in its own worker process (the same agent
code as the local backend: instances spawned directly, a cgroup per instance where the node
offers cgroups, else the environment-marker fallback, exits journaled with fsync before they are
reported). Its state directory is ``<Ray session dir>/trainmaster/agents/<node id>`` on the node:
the session dir is local to the node and lives as long as the cluster; a node id is never
reused, so two agents never share a journal.

The actor is pinned to its node (``NodeAffinitySchedulingStrategy(node_id, soft=False)``),
named ``tm-agent-<node_id>`` and *detached*: it must outlive the controller that created it,
because the instances it owns keep running while a controller restarts; the new controller
finds it again by name. It asks Ray for no resources (``num_cpus=0``): instances are charged
against their job's placement group bundle, which the controller reserved and holds (see
``trainmaster.backends.ray``); the agent's own CPU use is noise beside theirs.

When the actor dies (``max_restarts=0``: Ray never restarts it, a killed worker or a lost node),
the controller reports its instances ``Lost`` and restarts them by policy, possibly on another
node at once. So no instance may outlive its agent: :class:`AgentGuard` is a small detached
process that holds the agent's state-dir lock and, when the agent's end of its pipe closes
(however it died, kill -9 included), kills every process tree the agent owned (its cgroups and
its markers), then releases the lock. A later agent on the same node takes that lock before it
starts (so it never runs beside a cleanup), then, as every restarted agent does, journals each
instance the old one left as ``AgentRestarted``.

Everything the controller sends is a :class:`~trainmaster.contract.LaunchSpec` (as a
dict); before it reaches the agent, :func:`bind_to_node` moves it to this node: its host is the
node's IP and each port it was given that is taken here is replaced by a free one of this node.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import ray

from trainmaster.contract import LaunchSpec, StartResult
from trainmaster.agent.core import AgentOptions, NodeAgent
from trainmaster.runtime.environment import instance_environment

NAMESPACE = "trainmaster"
AGENT_PREFIX = "tm-agent-"
ATTEMPT_RECORD = "ray-attempt.json"  # where an attempt runs (node, pid), for a controller that lost its handle
OWNER_LOCK = "owner.lock"  # held by the live agent of a state dir, then by its guard until it has cleaned up
LOCK_WAIT = 60.0  # how long a new agent waits for an earlier agent's guard to finish its cleanup


def agent_name(node_id: str) -> str:
    return f"{AGENT_PREFIX}{node_id}"


def agent_state_dir(node_id: str) -> Path:
    """``<Ray session dir>/trainmaster/agents/<node id>`` (see module doc); the system temp dir
    stands in when this process is not a Ray worker."""
    node = getattr(ray._private.worker, "_global_node", None)  # no public API names the session dir
    session = Path(node.get_session_dir_path()) if node is not None else Path(tempfile.gettempdir()) / "trainmaster-ray"
    return session / "trainmaster" / "agents" / node_id


def take_owner_lock(state_dir: Path, timeout: float = LOCK_WAIT) -> int:
    """Exclusive ``flock`` on the state dir's owner lock, waiting (backing off) while an earlier
    agent or its guard holds it; returns the fd (non-inheritable)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise RuntimeError(
                    f"node agent: {state_dir / OWNER_LOCK} still held after {timeout:g}s by an earlier agent "
                    "or its guard (still killing the instances it left); not starting a second agent"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


# The guard: detaches (forks, the parent exits), because when a Ray worker dies Ray SIGKILLs the
# worker's direct children and would take the guard along; ignores polite signals; blocks on
# stdin; at EOF (the agent is gone, however it died) kills every tree of the agent's node key,
# cgroups and markers alike, removes the emptied cgroups, and exits, which releases the owner
# lock it inherited (argv: node key, "1" when the agent uses cgroups, the lock's fd).
_GUARD_CODE = """
import os, signal, sys
if os.fork():
    os._exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
from trainmaster.agent.tree import MarkerTrees, kill_tree, make_trees
node_key, use_cgroups = sys.argv[1], sys.argv[2] == "1"
while sys.stdin.buffer.read(65536):
    pass
trees = make_trees(node_key, use_cgroups)
markers = MarkerTrees(node_key)
for owner in (trees, markers):
    for name in owner.leftovers():
        kill_tree(owner, name)
        owner.remove(name)
trees.close()
"""


class AgentGuard:
    """Kills the process trees of an agent when the agent's process ends (see module doc)."""

    def __init__(self, options: AgentOptions, lock_fd: int) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
        }
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _GUARD_CODE, options.node_key, "1" if options.use_cgroups else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=(lock_fd,),
        )
        assert proc.stdin is not None
        self._pipe: IO[bytes] = proc.stdin  # never written: only its closing matters
        proc.wait(timeout=30)  # the first process only forks the guard off and exits


def make_node_agent(node_id: str) -> tuple[NodeAgent, AgentGuard]:
    """This node's agent core and its guard. The guard comes first: it holds the owner lock
    from the start, and the agent's reaper (which reaps every child) is not running yet."""
    options = AgentOptions(state_dir=agent_state_dir(node_id), node=node_id)
    lock_fd = take_owner_lock(options.state_dir)
    guard = AgentGuard(options, lock_fd)
    return NodeAgent(options), guard


# (Ray's typing stubs lack max_concurrency, which Ray accepts for actors)
@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=8)  # type: ignore[call-overload]
class NodeAgentActor:
    """One node's agent: carries :class:`NodeAgentAPI` calls to the agent core on this node.

    Threaded (``max_concurrency``) so ``observe`` answers while a ``stop`` waits out its grace
    (the agent core is thread-safe)."""

    def __init__(self) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._agent, self._guard = make_node_agent(self.node_id)

    def where(self) -> dict[str, Any]:
        """Where this agent runs and how it owns process trees (for people and tests)."""
        return {
            "node": self.node_id,
            "ip": self.node_ip,
            "pid": os.getpid(),
            "trees": self._agent.trees.kind,
            "state_dir": str(self._agent.options.state_dir),
        }

    def start(self, specs: builtins.list[dict[str, Any]]) -> builtins.list[dict[str, Any]]:
        """Start a batch; each answer is the :class:`StartResult` plus the host and ports the
        attempt really has on this node."""
        bound = [bind_to_node(LaunchSpec.from_dict(s), self.node_ip) for s in specs]
        answers = []
        for spec, result in zip(bound, self._agent.start(bound)):
            if result.handle is not None:
                _write_record(spec, result, self.node_id)
            answers.append({"result": _result_dict(result), "host": spec.host, "ports": spec.ports})
        return answers

    def stop(self, instance_ids: builtins.list[str], grace: float) -> builtins.list[dict[str, Any]]:
        return [s.to_dict() for s in self._agent.stop(instance_ids, grace)]

    def observe(self, instance_ids: builtins.list[str]) -> builtins.list[dict[str, Any]]:
        return [s.to_dict() for s in self._agent.observe(instance_ids)]

    def list(self) -> builtins.list[dict[str, Any]]:
        return [s.to_dict() for s in self._agent.list()]

    def forget(self, instance_ids: builtins.list[str]) -> None:
        self._agent.forget(instance_ids)


def bind_to_node(spec: LaunchSpec, node_ip: str) -> LaunchSpec:
    """Move an attempt to this node: the controller chose its host and ports before it knew
    the node, so keep each port that is free here and take a free one of the node's for any that
    is not (Ray's own workers hold ports here too); put the node's address in the spec's
    environment inputs (the dependency wait step resolves the environment from them) and,
    without a wait step, resolve the environment again (one resolver:
    :func:`~trainmaster.runtime.environment.instance_environment`)."""
    if spec.host == node_ip:
        return spec
    ports = _ports_on_node(node_ip, spec.ports)
    context = {**spec.env_inputs.get("context", {}), "host": node_ip, "ports": ports}
    inputs = {**spec.env_inputs, "context": context}
    env = spec.env if spec.depends else instance_environment({**inputs, "env": spec.env}, {})
    return replace(spec, host=node_ip, ports=ports, env=env, env_inputs=inputs)


def _ports_on_node(node_ip: str, wanted: list[int]) -> list[int]:
    """``wanted``, with each port that is taken on ``node_ip`` replaced by a free one there."""
    ports: list[int] = []
    for port in wanted:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((node_ip, port))
            except OSError:
                probe.bind((node_ip, 0))
            ports.append(probe.getsockname()[1])
    return ports


def _result_dict(result: StartResult) -> dict[str, Any]:
    return {
        "instance_id": result.instance_id,
        "error": result.error,
        "handle": result.handle.to_dict() if result.handle else None,
    }


def _write_record(spec: LaunchSpec, result: StartResult, node_id: str) -> None:
    assert result.handle is not None
    record = {
        "instance_id": spec.instance_id,
        "node": node_id,
        "agent": agent_name(node_id),
        "pid": result.handle.pid,
        "host": spec.host,
        "ports": spec.ports,
        "gated": bool(spec.depends),
    }
    path = Path(spec.instance_dir) / ATTEMPT_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)  # the controller leaves creating it to the node
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_record(instance_dir: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads((Path(instance_dir) / ATTEMPT_RECORD).read_text()))
    except (FileNotFoundError, ValueError):
        return None
