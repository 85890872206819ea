"""The Ray backend: one node agent actor per Ray node starts and owns that node's instances.

How an instance reaches a process (see ``trainmaster.backends.ray_agent`` for the agent side):

* Gang scheduling is one Ray placement group per job, one bundle per instance, so nothing starts
  until Ray has reserved every instance's resources at once. Each instance (role + index) takes
  a bundle of its size and keeps it across attempts.
* The instance's node is its bundle's node (``placement_group_table``); the launch goes to that
  node's agent. All launches of one reconcile pass that go to one node are ONE ``start`` call.
* Resources: the process an agent spawns is not a Ray worker, so Ray neither counts nor limits
  it; what charges it against the cluster is its bundle, which the placement group holds from
  admission until the job ends (so no other Ray work can take those CPUs/GPUs/memory). An
  instance started outside any gang (a bare ``start``) goes to the controller's own node and is
  charged nowhere: the controller's own accounting is then all that limits it.
* Node loss: when a node's agent cannot be reached because its actor died, because Ray's GCS
  reports the node dead (asked every NODE_CHECK_PERIOD), or because it did not answer an observe
  within OBSERVE_TIMEOUT and the node's raylet refuses connections (a node killed outright,
  known before Ray's health checks conclude), its instances are reported ``Lost`` with a message
  naming the node (and whether the node itself is gone); the controller's restart policy
  restarts them. An agent is started on every live node ahead of need, so a restarted instance
  never waits for Ray to start one. Ray reschedules the lost node's bundles
  onto nodes with room, and a restarted instance follows its bundle there (until the bundle is
  placed again its start waits, reported as starting).

Ray is an optional extra: only ``backends/ray*.py`` import it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainmaster.agent.contract import InstancePhase, InstanceStatus, LaunchSpec
from trainmaster.backends.base import Backend, Capacity, LaunchRequest, Observation, Phase, Placement, StartFailure
from trainmaster.backends.ports import PortPool
from trainmaster.backends.local import observation as agent_observation
from trainmaster.backends.ray_agent import ATTEMPT_RECORD, NAMESPACE, NodeAgentActor, agent_name, read_record
from trainmaster.spec.model import parse_memory

__all__ = ["ATTEMPT_RECORD", "NAMESPACE", "RayBackend", "connect"]

log = logging.getLogger(__name__)

MIN_BUNDLE_CPU = 0.01  # Ray rejects empty bundles; a role asking for no CPU still gets a token one
CALL_TIMEOUT = 5.0  # a lookup (handle_of) waits at most this long for an agent's answer
# An observe waits at most this long for a node's agent: past it the node's raylet is probed
# (a refused connection means the node's Ray processes are gone, so its agent and, through the
# agent's guard, its instances with them) and otherwise its instances read as unreachable for
# SILENT_FOR seconds without asking again, so a pass never blocks on a dead node once per instance.
OBSERVE_TIMEOUT = 1.0
SILENT_FOR = 1.0
RAYLET_PROBE_TIMEOUT = 0.25
# How often a pass asks Ray's GCS which nodes are dead (its health checks' verdict): a node it
# reports dead is lost at once, without waiting for its agent actor's death to reach us.
NODE_CHECK_PERIOD = 0.25
DEFERRED_CHECK_PERIOD = 0.1  # how often deferred launches look for their bundle's new node
START_WAIT = 60.0  # a stop waits at most this long for the start call it must follow
STOP_SLACK = 15.0  # a stop's answer may come this long after its grace (the KILL, the wait for the trees)
GANG_WAIT = 0.2  # each reconcile pass waits this long for a placement group, then reports pending
# Ray places a new placement group in the background, within a second or so when it fits: until
# it has waited this long, a gang is reported as being placed, not diagnosed as not fitting
GANG_SETTLE = 5.0
# One observe call per node answers every poll of one reconcile pass: the controller polls
# instance by instance, and 64 round trips to an actor would cost more than the pass itself.
OBSERVE_TTL = 0.05


def connect(address: str | None = None, num_cpus: int | None = None, node_ip: str = "127.0.0.1") -> None:
    """Join ``address``, or start a private local cluster; a no-op when Ray is already up.

    ``address="local"`` rather than nothing, so an unrelated cluster another program left
    running on this machine is never joined by accident. A private cluster listens on
    ``node_ip`` only (loopback by default): it has no other machine to talk to.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet: dict[str, Any] = {"namespace": NAMESPACE, "logging_level": logging.ERROR, "log_to_driver": False}
    if address:
        ray.init(address=address, **quiet)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            _node_ip_address=node_ip,
            **quiet,
        )


@dataclass
class _Gang:
    group: PlacementGroup
    bundles: list[dict[str, float]]
    since: float
    holders: dict[str, int] = field(default_factory=dict)  # "role-index" -> its bundle, for every attempt


@dataclass
class _ClusterView:
    """One look at the cluster for a whole batch of launches: each job's bundle -> node table,
    and the live nodes (read when first needed)."""

    bundles: dict[int, dict[int, str]] = field(default_factory=dict)
    alive: set[str] | None = None


@dataclass
class _StartCall:
    """One batched ``start`` sent to a node's agent, not yet answered."""

    ref: Any  # ray.ObjectRef
    node: str
    instance_ids: list[str]


@dataclass
class _Deferred:
    """A launch whose bundle Ray has not placed yet (its node was lost): sent once it is."""

    spec: LaunchSpec
    job_id: int
    bundle: int


@dataclass
class _Snapshot:
    at: float
    statuses: dict[str, InstanceStatus]


class RayBackend(Backend):
    name = "ray"
    runs_containers = True  # each node's agent (trainmaster.agent.NodeAgent) runs them with its podman

    def __init__(self, address: str | None = None, num_cpus: int | None = None, node_ip: str = "127.0.0.1"):
        """``node_ip``: the address of a private local cluster (ignored when joining ``address``).
        Instances' addresses are their nodes' IPs, known once their agent has started them."""
        connect(address, num_cpus, node_ip)
        self._ports = PortPool("127.0.0.1")  # ports chosen here, checked on the node
        self._gangs: dict[int, _Gang] = {}
        self._agents: dict[str, Any] = {}  # node id -> its agent's ActorHandle
        self._node_ips: dict[str, str] = {}
        self._raylets: dict[str, tuple[str, int]] = {}  # node id -> its raylet's address (probed when silent)
        self._dead: set[str] = set()  # nodes known dead: never sent a launch again
        self._silent: dict[str, tuple[float, str]] = {}  # node -> when its agent last failed to answer, why
        self._nodes_checked = 0.0
        self._deferred_checked = 0.0
        self._where: dict[str, str] = {}  # instance id -> node id
        self._live: dict[str, set[str]] = {}  # node id -> instance ids not known to have ended
        self._calls: dict[str, _StartCall] = {}
        self._bound: dict[str, tuple[str, list[int]]] = {}  # instance id -> host, ports on its node
        self._refused: dict[str, str] = {}  # instance id -> why its node could not start it
        self._deferred: dict[str, _Deferred] = {}
        self._snapshots: dict[str, _Snapshot] = {}
        self._ended: dict[str, Observation] = {}

    # ---- resources ---------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        total = ray.cluster_resources()
        return Capacity(
            cpu=float(total.get("CPU", 0.0)), memory=int(total.get("memory", 0)), gpu=int(total.get("GPU", 0))
        )

    def place(self, ports: int, resources: dict[str, Any], wanted: Sequence[int] = ()) -> Placement:
        return Placement(self._ports.host, self._ports.take(ports, wanted))

    def release(self, placement: Placement) -> None:
        self._ports.release(placement.ports)

    # ---- gang scheduling ---------------------------------------------------------------------
    def reserve_gang(self, job_id: int, bundles: list[dict[str, Any]]) -> tuple[bool, str]:
        gang = self._gangs.get(job_id)
        if gang is None:
            ray_bundles = [_bundle(b) for b in bundles]
            group = placement_group(ray_bundles, strategy="PACK", name=f"tm-gang-{job_id}-{os.getpid()}")
            gang = self._gangs[job_id] = _Gang(group, ray_bundles, time.monotonic())
        if gang.group.wait(timeout_seconds=GANG_WAIT):
            return True, ""
        return False, self._gang_reason(gang)

    def _gang_reason(self, gang: _Gang) -> str:
        """Which resources the placement group lacks, so the user knows what to change."""
        waited = time.monotonic() - gang.since
        if waited < GANG_SETTLE:  # placing takes Ray a moment: nothing to diagnose yet
            return gang_pending_reason(gang.bundles, waited, {}, {})
        return gang_pending_reason(gang.bundles, waited, ray.cluster_resources(), ray.available_resources())

    def release_gang(self, job_id: int) -> None:
        gang = self._gangs.pop(job_id, None)
        if gang is not None:
            remove_placement_group(gang.group)

    def _bundle_for(self, request: LaunchRequest) -> int | None:
        """The bundle an instance is charged to: the one it held before, else a free one of its
        size; None outside a gang (or beyond it, after a scale-up)."""
        gang = self._gangs.get(request.job_id)
        if gang is None:
            return None
        key = f"{request.role}-{request.index}"
        if key in gang.holders:
            return gang.holders[key]
        wanted = _bundle({**request.resources, "memory": _memory_bytes(request.resources.get("memory", 0))})
        taken = set(gang.holders.values())
        for index, bundle in enumerate(gang.bundles):
            if index not in taken and bundle == wanted:
                gang.holders[key] = index
                return index
        return None

    def _bundle_node(self, job_id: int, bundle: int, view: _ClusterView) -> str | None:
        """The live node Ray placed a bundle on; None while it is being placed again (its node was
        lost: for a moment the table may still name the dead node, and an agent pinned there could
        never start)."""
        if job_id not in view.bundles:
            view.bundles[job_id] = dict(placement_group_table(self._gangs[job_id].group)["bundles_to_node_id"])
        node = view.bundles[job_id].get(bundle) or None
        if node is None:
            return None
        if view.alive is None:
            view.alive = self._alive_nodes()
        return node if node in view.alive else None

    # ---- agents ------------------------------------------------------------------------------
    def _agent_on(self, node: str) -> Any:
        """The node's agent actor, created on that node when there is none yet."""
        agent = self._agents.get(node)
        if agent is None:
            agent = NodeAgentActor.options(  # type: ignore[attr-defined]
                name=agent_name(node),
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote()
            self._agents[node] = agent
        return agent

    def _agent_found(self, node: str) -> Any:
        """The node's agent if one runs (never creates one: there is nothing to observe on a new one)."""
        agent = self._agents.get(node)
        if agent is None:
            try:
                agent = self._agents[node] = ray.get_actor(agent_name(node), namespace=NAMESPACE)
            except ValueError:
                return None
        return agent

    def _alive_nodes(self) -> set[str]:
        """The nodes Ray's GCS reports alive, less those this backend found dead before Ray did."""
        alive = set()
        for info in ray.nodes():
            self._node_ips[info["NodeID"]] = info["NodeManagerAddress"]
            if info.get("NodeManagerPort"):
                self._raylets[info["NodeID"]] = (info["NodeManagerAddress"], int(info["NodeManagerPort"]))
            if info["Alive"]:
                alive.add(info["NodeID"])
        return alive - self._dead

    def _check_nodes(self) -> None:
        """Lose every node holding live instances that Ray reports dead (at most every
        NODE_CHECK_PERIOD seconds): noticed when Ray's health checks decide, not when the death
        of the node's agent actor reaches this driver (which may take longer)."""
        now = time.monotonic()
        if now - self._nodes_checked < NODE_CHECK_PERIOD or not self._live:
            return
        self._nodes_checked = now
        alive = self._alive_nodes()
        for node in [n for n in self._live if n not in alive]:
            self._lose_node(node, "Ray's health checks declared it dead")
        for node in alive - set(self._agents):
            # an agent on every node before it is needed (a node that joined, or one that had no
            # instance yet): an instance restarted there after a node loss then does not wait for
            # Ray to start the agent's worker process (seconds of CPU). Not waited for here.
            self._agent_on(node)

    def _raylet_gone(self, node: str) -> bool:
        """True when the node's raylet refuses connections: its Ray processes are gone (a node
        killed outright), known before Ray's health checks conclude. A timeout or any other
        error proves nothing (a slow or partitioned node): False."""
        address = self._raylets.get(node)
        if address is None:
            return False
        try:
            with socket.create_connection(address, timeout=RAYLET_PROBE_TIMEOUT):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _node_alive(self, node: str) -> bool:
        return node in self._alive_nodes()

    def _home_node(self) -> str:
        """Where an instance outside any gang runs: the node this controller joined."""
        return str(ray.get_runtime_context().get_node_id())

    def _lose_node(self, node: str, why: str, node_gone: bool = False) -> None:
        """The node's agent is gone: every instance it held is lost, with a message naming the
        node. ``node_gone``: the node itself is known gone (its raylet refuses connections)."""
        alive = not node_gone and self._node_alive(node)
        where = f"node {node[:12]} ({self._node_ips.get(node, 'address unknown')})"
        if alive:
            reason, message = "AgentLost", f"the node agent on {where} died ({why}); its instances ended with it"
        else:
            reason, message = (
                "NodeLost",
                (f"{where} was lost: {why}" if node_gone else f"{where} was lost: Ray reports it dead ({why})"),
            )
        log.warning("%s", message)
        if not alive:
            self._dead.add(node)
        self._silent.pop(node, None)
        for instance_id in self._live.pop(node, set()):
            self._calls.pop(instance_id, None)
            self._ended.setdefault(instance_id, Observation(Phase.LOST, reason=reason, message=message))
        self._agents.pop(node, None)
        self._snapshots.pop(node, None)

    # ---- instances ---------------------------------------------------------------------------
    def start(self, request: LaunchRequest) -> dict[str, Any]:
        [handle] = list(self.start_all([request]))
        assert isinstance(handle, dict)  # a refused start comes back later, from poll (StartFailed)
        return handle

    def start_all(self, requests: list[LaunchRequest]) -> Iterator[dict[str, Any] | StartFailure]:
        """Send each node's launches to its agent in ONE call, without waiting for the answer:
        until it comes (the first call on a node waits for Ray to start the agent), the
        instances read as starting, so a reconcile pass never blocks on the cluster."""
        batches: dict[str, list[LaunchSpec]] = {}
        handles: list[dict[str, Any] | StartFailure] = []
        view = _ClusterView()
        for request in requests:
            spec = request.spec
            bundle = self._bundle_for(request)
            node = self._bundle_node(request.job_id, bundle, view) if bundle is not None else self._home_node()
            if node is None and bundle is not None:
                self._deferred[spec.instance_id] = _Deferred(spec, request.job_id, bundle)
            elif node is not None:
                batches.setdefault(node, []).append(spec)
            handles.append(
                {
                    "backend": self.name,
                    "instance_id": spec.instance_id,
                    "node": node,
                    "agent": agent_name(node) if node else None,
                    "pid": None,
                    "instance_dir": request.instance_dir,
                    "gated": request.gated,
                    "host": request.placement.host,
                    "ports": request.placement.ports,
                    "job_id": request.job_id,
                    "bundle": bundle,
                }
            )
        for node, specs in batches.items():
            self._dispatch(node, specs)
        return iter(handles)

    def _dispatch(self, node: str, specs: list[LaunchSpec]) -> None:
        call = _StartCall(
            self._agent_on(node).start.remote([s.to_dict() for s in specs]), node, [s.instance_id for s in specs]
        )
        for spec in specs:
            self._calls[spec.instance_id] = call
            self._where[spec.instance_id] = node
            self._live.setdefault(node, set()).add(spec.instance_id)

    def _collect(self, call: _StartCall) -> None:
        """Take in a start call's answer: each attempt's host and ports, or why it could not start."""
        for instance_id in call.instance_ids:
            self._calls.pop(instance_id, None)
        try:
            answers = ray.get(call.ref)
        except RayActorError as exc:
            self._lose_node(call.node, _first_line(exc))
            return
        for answer in answers:
            result = answer["result"]
            if result["error"]:
                self._refused[result["instance_id"]] = result["error"]
            else:
                self._bound[result["instance_id"]] = (answer["host"], list(answer["ports"]))
        self._snapshots.pop(call.node, None)

    def _try_deferred(self, instance_id: str) -> Observation:
        deferred = self._deferred[instance_id]
        self._send_deferred()
        if instance_id in self._deferred:
            return Observation(
                Phase.STARTING,
                reason="BundlePending",
                message=f"waiting for Ray to place its placement group bundle {deferred.bundle} again",
            )
        node = self._where[instance_id]
        return Observation(Phase.STARTING, reason="AgentStarting", message=f"sent to the agent of node {node[:12]}")

    def _send_deferred(self) -> None:
        """Send every deferred launch whose bundle Ray has placed again, one ``start`` call per
        node, from one look at the cluster (at most every DEFERRED_CHECK_PERIOD seconds): after a
        node loss its many instances are polled one by one, and a look and a call for each
        would cost a pass seconds."""
        now = time.monotonic()
        if now - self._deferred_checked < DEFERRED_CHECK_PERIOD:
            return
        self._deferred_checked = now
        view = _ClusterView()
        batches: dict[str, list[LaunchSpec]] = {}
        for instance_id, deferred in list(self._deferred.items()):
            if deferred.job_id not in self._gangs:
                continue
            node = self._bundle_node(deferred.job_id, deferred.bundle, view)
            if node is not None:
                del self._deferred[instance_id]
                batches.setdefault(node, []).append(deferred.spec)
        for node, specs in batches.items():
            self._dispatch(node, specs)

    def _node_of(self, handle: dict[str, Any]) -> str | None:
        instance_id = handle["instance_id"]
        node = self._where.get(instance_id) or handle.get("node")
        if node is None:  # its bundle was being placed when the handle was saved
            record = read_record(handle["instance_dir"])
            node = record["node"] if record and record["instance_id"] == instance_id else None
        if node is not None:
            self._where[instance_id] = node
            self._live.setdefault(node, set()).add(instance_id)
        return node

    def poll(self, handle: dict[str, Any]) -> Observation:
        return self._poll(handle, fresh=False)

    def _poll(self, handle: dict[str, Any], fresh: bool) -> Observation:
        """``fresh``: ask the agent now, not from the pass's snapshot (adopt and find, which
        judge an attempt another backend may have stopped moments ago)."""
        instance_id = handle["instance_id"]
        self._check_nodes()
        if instance_id in self._ended:
            return self._ended[instance_id]
        if instance_id in self._deferred:
            return self._try_deferred(instance_id)
        node = self._node_of(handle)
        if node is None:
            return self._end(
                instance_id, Observation(Phase.LOST, reason="NotStarted", message="no node agent holds a record of it")
            )
        call = self._calls.get(instance_id)
        if call is not None:
            if not ray.wait([call.ref], timeout=0)[0]:
                return Observation(
                    Phase.STARTING, reason="AgentStarting", message=f"the agent of node {node[:12]} is starting it"
                )
            self._collect(call)
            if instance_id in self._ended:
                return self._ended[instance_id]
        if instance_id in self._refused:
            return self._end(
                instance_id,
                Observation(Phase.EXITED, exit_code=127, reason="StartFailed", message=self._refused[instance_id]),
            )
        return self._observe(node, instance_id, fresh)

    def _observe(self, node: str, instance_id: str, fresh: bool) -> Observation:
        snapshot = self._snapshots.get(node)
        if (
            fresh
            or snapshot is None
            or time.monotonic() - snapshot.at > OBSERVE_TTL
            or instance_id not in snapshot.statuses
        ):
            silent = self._silent.get(node)
            if silent is not None and time.monotonic() - silent[0] < SILENT_FOR:
                return Observation(Phase.UNREACHABLE, reason="AgentSlow", message=silent[1])
            agent = self._agent_found(node)
            if agent is None:
                self._lose_node(node, "no agent actor by that name is alive")
                return self._ended[instance_id]
            ids = sorted(i for i in self._live.get(node, ()) if i not in self._calls and i not in self._ended)
            try:
                raw = ray.get(agent.observe.remote(ids), timeout=OBSERVE_TIMEOUT)
            except RayActorError as exc:  # ActorUnavailableError too: judged below
                if isinstance(exc, ActorUnavailableError):
                    return self._silence(node, instance_id, _first_line(exc))
                self._lose_node(node, _first_line(exc))
                return self._ended[instance_id]
            except GetTimeoutError:
                return self._silence(
                    node, instance_id, f"the agent of node {node[:12]} did not answer within {OBSERVE_TIMEOUT:g}s"
                )
            self._silent.pop(node, None)
            snapshot = self._snapshots[node] = _Snapshot(
                time.monotonic(), {s["handle"]["instance_id"]: InstanceStatus.from_dict(s) for s in raw}
            )
        obs = self._observation(snapshot.statuses[instance_id])
        if obs.phase in (Phase.EXITED, Phase.LOST):
            self._end(instance_id, obs)
        return obs

    def _silence(self, node: str, instance_id: str, why: str) -> Observation:
        """A node's agent did not answer: lost at once when its raylet is gone or Ray reports it
        dead, else its instances read as unreachable (not asked again for SILENT_FOR seconds)."""
        if self._raylet_gone(node):
            self._lose_node(
                node, f"its raylet refuses connections and its agent did not answer ({why})", node_gone=True
            )
            return self._ended[instance_id]
        if not self._node_alive(node):
            self._lose_node(node, why)
            return self._ended[instance_id]
        self._silent[node] = (time.monotonic(), why)
        return Observation(Phase.UNREACHABLE, reason="AgentSlow", message=why)

    def _observation(self, status: InstanceStatus) -> Observation:
        """What the local backend makes of an agent's status (the same agent), plus the host and
        ports the attempt really got on its node."""
        host, ports = self._bound.get(status.handle.instance_id, ("", None))
        return replace(agent_observation(status), host=host, ports=ports)

    def _end(self, instance_id: str, obs: Observation) -> Observation:
        self._ended[instance_id] = obs
        node = self._where.get(instance_id)
        if node is not None:
            self._live.get(node, set()).discard(instance_id)
        return obs

    def stop(self, handles: list[dict[str, Any]], grace: float) -> None:
        """One ``stop`` call per node (TERM every tree, KILL after ``grace``), all nodes at once."""
        by_node: dict[str, list[str]] = {}
        for handle in handles:
            instance_id = handle["instance_id"]
            if instance_id in self._ended:
                continue
            if self._deferred.pop(instance_id, None) is not None:
                self._end(
                    instance_id,
                    Observation(Phase.EXITED, reason="Stopped", message="stopped before its bundle was placed"),
                )
                continue
            node = self._node_of(handle)
            if node is None:
                continue
            call = self._calls.get(instance_id)
            if call is not None:  # a stop must not overtake the start it follows
                if not ray.wait([call.ref], timeout=START_WAIT)[0]:
                    log.warning("the agent of node %s did not answer a start within %gs", node[:12], START_WAIT)
                    continue
                self._collect(call)
            if instance_id in self._refused:
                self.poll(handle)
            elif instance_id not in self._ended:
                by_node.setdefault(node, []).append(instance_id)
        calls = {
            node: agent.stop.remote(ids, grace)
            for node, ids in by_node.items()
            if (agent := self._agent_found(node)) is not None
        }
        for node, ref in calls.items():
            try:
                statuses = ray.get(ref, timeout=grace + STOP_SLACK)
            except RayActorError as exc:
                self._lose_node(node, _first_line(exc))
                continue
            except GetTimeoutError:
                log.warning("the agent of node %s did not finish a stop within %gs", node[:12], grace + STOP_SLACK)
                continue
            self._snapshots.pop(node, None)
            for raw in statuses:
                obs = self._observation(InstanceStatus.from_dict(raw))
                if obs.phase in (Phase.EXITED, Phase.LOST):
                    self._end(raw["handle"]["instance_id"], obs)

    def forget(self, handles: list[dict[str, Any]]) -> None:
        """The controller stored these exits: each node's agent may drop them from its journal.
        Sent without waiting for the answer (one call per node); an agent that died meanwhile
        has nothing left to drop."""
        by_node: dict[str, list[str]] = {}
        for handle in handles:
            node = self._where.get(handle["instance_id"]) or handle.get("node")
            if node is not None:
                by_node.setdefault(node, []).append(handle["instance_id"])
        for node, ids in by_node.items():
            agent = self._agents.get(node)
            if agent is not None:
                agent.forget.remote(ids)

    def handle_of(self, instance_id: str) -> dict[str, Any] | None:
        """The handle of an attempt started under ``instance_id`` whose handle was never saved (the
        controller died between the start and saving it), running or ended: every live node's
        agent is asked at once, and the one whose journal holds the attempt answers. An ended
        attempt's exit then reaches the restart policy; it is never taken for never started."""
        nodes = [node for node in self._alive_nodes() if self._agent_found(node) is not None]
        calls = {node: self._agents[node].observe.remote([instance_id]) for node in nodes}
        for node, ref in calls.items():
            try:
                status = InstanceStatus.from_dict(ray.get(ref, timeout=CALL_TIMEOUT)[0])
            except (RayActorError, ActorUnavailableError, GetTimeoutError) as exc:
                log.warning(
                    "handle_of %s: the agent of node %s did not answer (%s)", instance_id, node[:12], _first_line(exc)
                )
                continue
            if status.phase == InstancePhase.LOST:
                continue
            self._where[instance_id] = node
            self._live.setdefault(node, set()).add(instance_id)
            return {
                "backend": self.name,
                "instance_id": instance_id,
                "node": node,
                "agent": agent_name(node),
                "pid": status.handle.pid,
                "instance_dir": "",
                "gated": False,
                "host": self._node_ips.get(node, ""),
                "ports": [],
                "job_id": None,
                "bundle": None,
            }
        return None

    def adopt(self, handle: dict[str, Any]) -> bool:
        """An attempt is ours again when its node's agent is alive and still runs it."""
        alive = handle.get("backend") == self.name and self._poll(handle, fresh=True).phase in (
            Phase.STARTING,
            Phase.RUNNING,
        )
        if alive:  # its ports stay taken
            self._ports.hold(handle.get("ports", []))
        return alive

    def find(self, instance_dir: str) -> dict[str, Any] | None:
        """A live attempt started from ``instance_dir`` whose handle was never saved: its agent
        left a record there when it started it."""
        record = read_record(instance_dir)
        if record is None:
            return None
        handle = {
            "backend": self.name,
            "instance_id": record["instance_id"],
            "node": record["node"],
            "agent": record["agent"],
            "pid": record["pid"],
            "instance_dir": instance_dir,
            "gated": record["gated"],
            "host": record["host"],
            "ports": record["ports"],
            "job_id": None,
            "bundle": None,
        }
        if self._poll(handle, fresh=True).phase not in (Phase.STARTING, Phase.RUNNING):
            return None
        return handle

    def close(self) -> None:
        """Forget local bookkeeping; the cluster, its agents and their instances are left alone
        (a controller that stops does not stop the jobs it ran)."""
        self._calls.clear()
        self._snapshots.clear()


def _bundle(request: dict[str, Any]) -> dict[str, float]:
    bundle = {"CPU": max(float(request.get("cpu", 0) or 0), MIN_BUNDLE_CPU)}
    if request.get("gpu"):
        bundle["GPU"] = float(request["gpu"])
    if request.get("memory"):
        bundle["memory"] = float(request["memory"])
    return bundle


def _memory_bytes(value: Any) -> int:
    return parse_memory(value) if value else 0


def gang_pending_reason(
    bundles: list[dict[str, float]], waited: float, total: dict[str, float], free: dict[str, float]
) -> str:
    """Why a gang's placement group is not placed after ``waited`` seconds: while Ray may still
    be placing it (``GANG_SETTLE``), only that; then what the cluster lacks (``total`` and
    ``free`` resources), or that no single node fits its largest bundle."""
    if waited < GANG_SETTLE:
        return f"Ray is placing the placement group of {len(bundles)} instance bundle(s)"
    want: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            want[key] = want.get(key, 0.0) + value
    short = [
        f"{_show(key, amount)} (cluster has {_show(key, total.get(key, 0.0))}, {_show(key, free.get(key, 0.0))} free)"
        for key, amount in sorted(want.items())
        if amount > free.get(key, 0.0) + 1e-9
    ]
    largest = max(bundles, key=lambda b: b.get("CPU", 0.0))
    what = "; short of " + ", ".join(short) if short else "; no single node fits a bundle like " + str(largest)
    return f"Ray placement group for {len(bundles)} instance bundle(s) not placed after {waited:.0f}s{what}"


def _show(key: str, amount: float) -> str:
    if key == "memory":
        return f"{amount / 2**30:.1f} GiB memory"
    return f"{amount:g} {key}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
