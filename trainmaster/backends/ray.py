"""The Ray backend: every instance attempt is a Ray actor that runs the instance runtime on its node.

Why actors: an actor is Ray's unit of placement with a lifetime, resources and a name, so the
cluster decides the node, holds the instance's CPUs/GPUs/memory while it runs, and a restarted
controller finds the attempt again by name. Inside the actor the process handling is exactly the
local backend's (own session, log file, exit record in the instance folder), run on the node
where Ray placed the actor; the actor only carries requests to it.

Gang scheduling maps to one Ray placement group per job holding one bundle per instance; the
job's actors are scheduled into it (``placement_group_bundle_index=-1``: any bundle with room),
so nothing starts until Ray has reserved every instance's resources at once.

Ray is an optional extra: this is the only module that imports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainmaster.backends.base import Backend, Capacity, LaunchRequest, Observation, Phase, Placement
from trainmaster.backends.legacy_local import LegacySubprocessBackend as LocalBackend
from trainmaster.runtime.environment import instance_environment
from trainmaster.runtime.files import InstanceFiles

NAMESPACE = "trainmaster"
MIN_BUNDLE_CPU = 0.01  # Ray rejects empty bundles; a role asking for no CPU still gets a token one
ATTEMPT_RECORD = "ray-attempt.json"  # the actor's process (pid, start time, node), for cleanup after a crash
CALL_TIMEOUT = 5.0  # a poll waits at most this long for an actor's answer
GANG_WAIT = 0.2  # each reconcile pass waits this long for a placement group, then reports pending


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
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                 _node_ip_address=node_ip, **quiet)


@ray.remote(max_restarts=0, max_task_retries=0)
class InstanceActor:
    """One attempt of one instance, on whichever node Ray placed it."""

    def __init__(self) -> None:
        self._local = LocalBackend()
        self._handle: dict[str, Any] | None = None
        self._node_ip = ray.util.get_node_ip_address()

    def start(self, request: LaunchRequest, name: str) -> dict[str, Any]:
        self._handle = self._local.start(bind_to_node(request, self._node_ip))
        record = {**self._handle, "actor": name, "node_ip": self._node_ip,
                  "node_id": ray.get_runtime_context().get_node_id()}
        _write_json(Path(request.instance_dir) / ATTEMPT_RECORD, record)
        return record

    def poll(self) -> Observation:
        assert self._handle is not None, "poll before start"
        return replace(self._local.poll(self._handle), host=self._node_ip, ports=self._handle["ports"])

    def stop(self, grace: float) -> Observation:
        assert self._handle is not None, "stop before start"
        self._local.stop([self._handle], grace)
        return self._local.poll(self._handle)


def bind_to_node(request: LaunchRequest, node_ip: str) -> LaunchRequest:
    """Move an attempt to the node Ray placed it on: the controller chose its host and ports
    before Ray chose the node, so keep each port that is free there and take a free one of the
    node's for any that is not (Ray's own workers hold ports of the node too), then put the
    node's address in the launch file and (without a wait step) recompute the environment."""
    if request.placement.host == node_ip:
        return request
    ports = _ports_on_node(node_ip, request.placement.ports)
    files = InstanceFiles(request.instance_dir)
    launch = files.read_launch()
    launch["context"]["host"], launch["context"]["ports"] = node_ip, ports
    env = instance_environment(launch, {}) if not request.gated else request.env
    if not request.gated:
        launch["env"] = env
    files.write_launch(launch)
    return replace(request, placement=Placement(node_ip, ports), env=env)


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


@dataclass
class _Gang:
    group: PlacementGroup
    bundles: list[dict[str, float]]
    since: float


class RayBackend(Backend):
    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, node_ip: str = "127.0.0.1"):
        """``node_ip``: the address of a private local cluster (ignored when joining ``address``).
        Instances' addresses are their nodes' IPs, known once Ray has placed them."""
        connect(address, num_cpus, node_ip)
        self._ports = LocalBackend(Capacity(0, 0))  # ports chosen here, checked on the node
        self._gangs: dict[int, _Gang] = {}
        self._actors: dict[str, Any] = {}  # actor name -> ActorHandle, for attempts we know
        self._starting: dict[str, ray.ObjectRef] = {}  # start calls not yet answered
        self._ended: dict[str, Observation] = {}  # final observations of attempts whose actor we let go

    # ---- resources ---------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        total = ray.cluster_resources()
        return Capacity(cpu=float(total.get("CPU", 0.0)), memory=int(total.get("memory", 0)),
                        gpu=int(total.get("GPU", 0)))

    def place(self, ports: int, resources: dict[str, Any]) -> Placement:
        return self._ports.place(ports, resources)

    def release(self, placement: Placement) -> None:
        self._ports.release(placement)

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
        want: dict[str, float] = {}
        for bundle in gang.bundles:
            for key, value in bundle.items():
                want[key] = want.get(key, 0.0) + value
        total, free = ray.cluster_resources(), ray.available_resources()
        short = [f"{_show(key, amount)} (cluster has {_show(key, total.get(key, 0.0))}, "
                 f"{_show(key, free.get(key, 0.0))} free)"
                 for key, amount in sorted(want.items()) if amount > free.get(key, 0.0) + 1e-9]
        largest = max(gang.bundles, key=lambda b: b.get("CPU", 0.0))
        what = "; short of " + ", ".join(short) if short else "; no single node fits a bundle like " + str(largest)
        return (f"Ray placement group for {len(gang.bundles)} instance bundle(s) not placed after "
                f"{time.monotonic() - gang.since:.0f}s{what}")

    def release_gang(self, job_id: int) -> None:
        gang = self._gangs.pop(job_id, None)
        if gang is not None:
            remove_placement_group(gang.group)

    # ---- instances ---------------------------------------------------------------------------
    def start(self, request: LaunchRequest) -> dict[str, Any]:
        """Create the attempt's actor and ask it to start; returns without waiting for Ray.

        Ray may need a while to place the actor and start its worker process; until then the
        instance is reported as starting, so one reconcile pass never blocks on the cluster.
        """
        name = _actor_name(request)
        options: dict[str, Any] = {"name": name, "namespace": NAMESPACE,
                                   "num_cpus": float(request.resources.get("cpu", 0) or 0)}
        if request.resources.get("gpu"):
            options["num_gpus"] = int(request.resources["gpu"])
        memory = _memory_bytes(request.resources.get("memory", 0))
        if memory:
            options["memory"] = memory
        gang = self._gangs.get(request.job_id)
        if gang is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=gang.group, placement_group_bundle_index=-1)
        actor = InstanceActor.options(**options).remote()  # type: ignore[attr-defined]
        self._actors[name] = actor
        self._starting[name] = actor.start.remote(request, name)
        return {"backend": self.name, "actor": name, "namespace": NAMESPACE, "pid": None,
                "instance_dir": request.instance_dir, "gated": request.gated,
                "host": request.placement.host, "ports": request.placement.ports}

    def poll(self, handle: dict[str, Any]) -> Observation:
        name = handle["actor"]
        if name in self._ended:
            return self._ended[name]
        actor = self._actor(handle)
        if actor is None:
            return self._gone(handle, "no Ray actor by that name is alive")
        started = self._starting.get(name)
        if started is not None:
            ready, _ = ray.wait([started], timeout=0)
            if not ready:
                return Observation(Phase.STARTING, reason="ActorPending",
                                   message="waiting for Ray to place the actor and start its worker")
            failed = self._failed_start(handle, started)
            if failed is not None:
                return failed
        try:
            obs = ray.get(actor.poll.remote(), timeout=CALL_TIMEOUT)
        except GetTimeoutError:
            return Observation(Phase.UNREACHABLE, reason="ActorSlow",
                               message=f"its Ray actor did not answer within {CALL_TIMEOUT:g}s")
        except RayActorError as exc:
            return self._gone(handle, _first_line(exc))
        if obs.phase in (Phase.EXITED, Phase.LOST):
            self._let_go(name, obs)
        return obs

    def _failed_start(self, handle: dict[str, Any], started: Any) -> Observation | None:
        """How a finished start call failed (its attempt then ended), or None if it succeeded."""
        name = handle["actor"]
        self._starting.pop(name, None)
        try:
            ray.get(started)
        except RayActorError as exc:
            return self._gone(handle, f"the actor died while starting: {_first_line(exc)}")
        except RayTaskError as exc:  # the node's OS refused the command (e.g. no workingDir)
            refused = Observation(Phase.EXITED, exit_code=127, reason="StartFailed",
                                  message=f"could not start: {_first_line(exc.cause or exc)}")
            self._let_go(name, refused)
            return refused
        return None

    def _actor(self, handle: dict[str, Any]) -> Any:
        name = handle["actor"]
        if name not in self._actors:
            try:
                self._actors[name] = ray.get_actor(name, namespace=handle.get("namespace", NAMESPACE))
            except ValueError:
                return None
        return self._actors[name]

    def _let_go(self, name: str, final: Observation) -> None:
        """The attempt ended: remember how, and end its actor so its resources return to Ray."""
        self._ended[name] = final
        self._starting.pop(name, None)
        actor = self._actors.pop(name, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def _gone(self, handle: dict[str, Any], why: str) -> Observation:
        """The actor is gone; the attempt's exit record (same filesystem on one machine) may
        still say how it ended, but only when the folder's record is this attempt's own."""
        files = InstanceFiles(handle["instance_dir"])
        record = _attempt_record(handle)
        code = files.read_exit_code() if record is not None else None
        if code is not None:
            reason, message = files.read_reason()
            obs = Observation(Phase.EXITED, exit_code=code, reason=reason, message=message)
        else:
            killed = _kill_leftovers(record) if record is not None else 0
            obs = Observation(Phase.LOST, reason="ActorLost", message=f"Ray actor {handle['actor']}: {why}"
                              + (f"; killed {killed} leftover process(es) of the attempt" if killed else ""))
        self._let_go(handle["actor"], obs)
        return obs

    def stop(self, handles: list[dict[str, Any]], grace: float) -> None:
        """Ask each attempt's actor to stop its process group (SIGTERM, SIGKILL after ``grace``)."""
        calls: dict[str, Any] = {}
        for handle in handles:
            name = handle["actor"]
            if name in self._ended:
                continue
            actor = self._actor(handle)
            if actor is None:
                self._gone(handle, "gone before it was stopped")
                continue
            started = self._starting.get(name)
            if started is not None and not ray.wait([started], timeout=grace)[0]:
                ray.kill(actor, no_restart=True)  # Ray never got it going: ending the actor is enough
                self._gone(handle, "stopped before Ray started it")
                continue
            if started is not None and self._failed_start(handle, started) is not None:
                continue  # it never ran: nothing to stop
            calls[name] = actor.stop.remote(grace)
        for handle in handles:
            call = calls.get(handle["actor"])
            if call is None:
                continue
            try:
                self._let_go(handle["actor"], ray.get(call, timeout=grace + 10))
            except (GetTimeoutError, RayActorError) as exc:
                self._gone(handle, _first_line(exc))

    def adopt(self, handle: dict[str, Any]) -> bool:
        """An attempt is ours again when its actor is alive under its name and its process runs."""
        alive = handle.get("backend") == self.name and super().adopt(handle)
        if alive:  # its ports stay taken (the local backend keeps no public way to say so)
            self._ports.reserve_ports(handle.get("ports", []))
        return alive

    def find(self, instance_dir: str) -> dict[str, Any] | None:
        """A live attempt started from ``instance_dir`` whose handle was never saved: its actor
        left its record there once its process started, and is still alive under that name."""
        try:
            record = json.loads((Path(instance_dir) / ATTEMPT_RECORD).read_text())
        except (FileNotFoundError, ValueError):
            return None
        handle = {"backend": self.name, "actor": record["actor"], "namespace": NAMESPACE, "pid": record["pid"],
                  "instance_dir": instance_dir, "gated": record["gated"], "host": record["host"],
                  "ports": record["ports"]}
        if self._actor(handle) is None or self.poll(handle).phase not in (Phase.STARTING, Phase.RUNNING):
            return None
        return handle

    def close(self) -> None:
        """Forget local bookkeeping; the cluster (and any still-running attempt) is left alone."""
        self._starting.clear()


def _attempt_record(handle: dict[str, Any]) -> dict[str, Any] | None:
    """What the attempt's actor wrote when it started its process, if this attempt got that far."""
    try:
        record = json.loads((Path(handle["instance_dir"]) / ATTEMPT_RECORD).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if record.get("actor") == handle["actor"] else None


def _kill_leftovers(record: dict[str, Any]) -> int:
    """Kill what is left of an attempt whose actor died without an exit record; returns how many.

    When an actor's worker dies (its owner, the controller, crashed; its node restarted), Ray
    kills the worker's direct child, the instance runtime, but the role's command may live on
    in the runtime's process group with nobody left to record its end. Such an attempt can never
    be observed again, and the controller is about to replace it, so it must not keep running:
    two copies of one instance would share its ports and outputs. Only processes of that group
    started no earlier than the runtime are touched, so a recycled group id is safe.
    """
    if record.get("node_ip") != ray.util.get_node_ip_address():
        return 0  # another machine's processes: not ours to see
    pgid, born = int(record["pid"]), float(record["create_time"])
    doomed = []
    for proc in psutil.process_iter(["create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["create_time"] >= born - 0.01:
                doomed.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    for proc in doomed:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(doomed, timeout=5)
    return len(doomed)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _actor_name(request: LaunchRequest) -> str:
    """``tm-<job>-<role>-<index>-<attempt>``, plus a digest of the instance folder so two
    controllers with separate stores (whose job ids both start at 1) never collide on a cluster."""
    digest = hashlib.sha1(request.instance_dir.encode()).hexdigest()[:8]
    return f"tm-{request.job_id}-{request.role}-{request.index}-{request.attempt}-{digest}"


def _bundle(request: dict[str, Any]) -> dict[str, float]:
    bundle = {"CPU": max(float(request.get("cpu", 0) or 0), MIN_BUNDLE_CPU)}
    if request.get("gpu"):
        bundle["GPU"] = float(request["gpu"])
    if request.get("memory"):
        bundle["memory"] = float(request["memory"])
    return bundle


def _memory_bytes(value: Any) -> int:
    from trainmaster.spec.model import parse_memory

    return parse_memory(value) if value else 0


def _show(key: str, amount: float) -> str:
    if key == "memory":
        return f"{amount / 2**30:.1f} GiB memory"
    return f"{amount:g} {key}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
