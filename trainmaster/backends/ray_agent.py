"""The node agent on Ray: one long-lived actor per Ray node that owns that node's instances.

Why one actor per node and not one per instance: an actor costs Ray a worker process (seconds of
CPU to start), so 64 replicas as 64 actors took ~21 s to run; one agent per node takes a whole
batch of launch specs in one call and spawns them directly, as the local agent does.

The actor is pinned to its node (``NodeAffinitySchedulingStrategy(node_id, soft=False)``),
named ``tm-agent-<node_id>`` and *detached*: it must outlive the controller that created it,
because the instances it owns keep running while a controller restarts; the new controller
finds it again by name. It asks Ray for no resources (``num_cpus=0``): instances are charged
against their job's placement group bundle, which the controller reserved and holds (see
``trainmaster.backends.ray``); the agent's own CPU use is noise beside theirs.

Everything the controller sends is a :class:`~trainmaster.agent.contract.LaunchSpec` (as a
dict); before it reaches the agent, :func:`bind_to_node` moves it to this node: its host is the
node's IP and each port it was given that is taken here is replaced by a free one of this node.
"""

from __future__ import annotations

import builtins
import json
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from trainmaster.agent.contract import LaunchSpec, NodeAgentAPI, StartResult
from trainmaster.backends.ray_standin_agent import ProcessGroupAgent
from trainmaster.runtime.environment import instance_environment
from trainmaster.runtime.files import InstanceFiles

NAMESPACE = "trainmaster"
AGENT_PREFIX = "tm-agent-"
ATTEMPT_RECORD = "ray-attempt.json"  # where an attempt runs (node, pid), for a controller that lost its handle


def agent_name(node_id: str) -> str:
    return f"{AGENT_PREFIX}{node_id}"


def make_node_agent(node_id: str) -> NodeAgentAPI:
    """THE SEAM: the agent core this node's actor wraps. The stand-in until the real
    ``trainmaster.agent.NodeAgent`` lands; the lead swaps this one call at merge."""
    return ProcessGroupAgent(node=node_id)


# (Ray's typing stubs lack max_concurrency, which Ray accepts for actors)
@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=8)  # type: ignore[call-overload]
class NodeAgentActor:
    """One node's agent: carries :class:`NodeAgentAPI` calls to the agent core on this node.

    Threaded (``max_concurrency``) so ``observe`` answers while a ``stop`` waits out its grace."""

    def __init__(self) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._agent = make_node_agent(self.node_id)

    def where(self) -> dict[str, Any]:
        return {"node": self.node_id, "ip": self.node_ip, "pid": os.getpid()}

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
    is not (Ray's own workers hold ports here too); put the node's address in the launch file
    (the dependency wait step reads it) and, without a wait step, recompute the environment."""
    if spec.host == node_ip:
        return spec
    ports = _ports_on_node(node_ip, spec.ports)
    files = InstanceFiles(spec.instance_dir)
    launch = files.read_launch()
    launch["context"]["host"], launch["context"]["ports"] = node_ip, ports
    env = spec.env if spec.depends else instance_environment(launch, {})
    if not spec.depends:
        launch["env"] = env
    files.write_launch(launch)
    return replace(spec, host=node_ip, ports=ports, env=env)


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
    return {"instance_id": result.instance_id, "error": result.error,
            "handle": result.handle.to_dict() if result.handle else None}


def _write_record(spec: LaunchSpec, result: StartResult, node_id: str) -> None:
    assert result.handle is not None
    record = {"instance_id": spec.instance_id, "node": node_id, "agent": agent_name(node_id),
              "pid": result.handle.pid, "host": spec.host, "ports": spec.ports, "gated": bool(spec.depends)}
    path = Path(spec.instance_dir) / ATTEMPT_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_record(instance_dir: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads((Path(instance_dir) / ATTEMPT_RECORD).read_text()))
    except (FileNotFoundError, ValueError):
        return None
