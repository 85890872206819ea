"""How the node agent owns container instances: the hooks :mod:`trainmaster.agent.core` calls.

A container instance is, to the agent, a process like any other: ``podman run`` attached is its
main process (spawned in the instance's tree, its exit status the container's, its output the
instance log), so stop (TERM, proxied by podman to the container; KILL after the grace) and the
exit journal work unchanged. What a process does not need and a container does:

- before the spawn: the podman command line and the container's environment file;
- once the client ended: the container's state (``OOMKilled``; whether it was created at all),
  then ``rm -f`` before the exit is journaled (a KILLed client leaves its container running);
- on agent restart: ``rm -f`` of every container journaled as started and not ended, and of
  every container labelled with this agent's key (started before its journal record was
  written), so a container never outlives its owner and a new attempt never meets an old copy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmaster.contract import LaunchSpec
from trainmaster.agent.tree import CGROUP_ROOT, cgroup_name
from trainmaster.containers import runtime as podman
from trainmaster.containers.runtime import ContainerRuntime, ContainerRuntimeMissing

log = logging.getLogger(__name__)

# what the podman client itself needs of the agent's environment (never the container's)
CLIENT_VARIABLES = (
    "PATH",
    "HOME",
    "TMPDIR",
    "XDG_RUNTIME_DIR",
    "XDG_DATA_HOME",
    "XDG_CONFIG_HOME",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "CONTAINERS_REGISTRIES_CONF",
    "REGISTRY_AUTH_FILE",
)
CONTAINER_CGROUPS = "trainmaster-containers"
CLIENT_FAILED_CODES = (125, 126, 127)  # podman's own: could not create / start / find the command


@dataclass
class ContainerRecord:
    """What the agent keeps of one container instance."""

    name: str
    cid_file: str
    log_path: str
    cgroup: str | None = None  # the cgroup parent the agent made for it (v1, relative to each hierarchy)
    usage: tuple[float, int] | None = None  # CPU seconds / peak bytes of that cgroup
    oom_kills: int = 0
    created_at: float | None = None  # when its first process was seen (its id file without a cgroup parent)
    state: dict[str, Any] = field(default_factory=dict)  # podman's State once the client ended
    created: bool = True
    image: str = ""
    create_timeout: float = float("inf")  # seconds from its client's start to pull and create it
    overdue: bool = False  # its client was killed at the deadline


@dataclass
class ContainerHooks:
    """One per agent; podman is probed on first use only (an agent without container
    instances never pays for it)."""

    node_key: str
    _runtime: ContainerRuntime | None = None
    # container cgroup parents made and not yet removed: at 0 the agent's own parent folder goes
    # too (a Ray node's agent ends without a shutdown), never while a container is being made
    _cgroups_lock: threading.Lock = field(default_factory=threading.Lock)
    _live_cgroups: int = 0

    def runtime(self) -> ContainerRuntime:
        if self._runtime is None:
            self._runtime = podman.detect()
        return self._runtime

    def prepare(self, spec: LaunchSpec, use_cgroups: bool) -> tuple[LaunchSpec, dict[str, str], ContainerRecord]:
        """The spec whose ``argv`` is the ``podman run`` command, the client's environment, and
        the record. Without dependencies the container's environment file is written here;
        with them the wait step writes it once it resolved the environment.

        With ``use_cgroups`` (an agent with cgroup trees) the container's cgroup parent is one
        of the agent's, ``/trainmaster-containers/<agent key>/<instance>`` (the same path in
        every v1 hierarchy, as podman's cgroupfs manager makes it), holding the memory limit: its
        CPU, peak memory and OOM kills can then be read after podman removed the container's
        own cgroup (podman's own OOM report does not work on every kernel)."""
        assert spec.container is not None
        runtime = self.runtime()  # ContainerRuntimeMissing: a start failure that says what to do
        folder = Path(spec.instance_dir)
        folder.mkdir(parents=True, exist_ok=True)
        env_file, cid_file = folder / podman.ENV_FILE, folder / podman.CID_FILE
        cid_file.unlink(missing_ok=True)  # podman refuses to overwrite one
        name = podman.container_name(self.node_key, spec.instance_id)
        cgroup = None
        if use_cgroups:
            cgroup = f"/{CONTAINER_CGROUPS}/{self.node_key}/{cgroup_name(spec.instance_id)}"
            memory = CGROUP_ROOT / "memory" / cgroup.lstrip("/")
            with self._cgroups_lock:
                memory.mkdir(parents=True, exist_ok=True)
                self._live_cgroups += 1
            if spec.memory > 0:
                (memory / "memory.limit_in_bytes").write_text(str(spec.memory))
        argv = podman.run_argv(
            runtime,
            spec.container,
            name=name,
            node_key=self.node_key,
            instance_id=spec.instance_id,
            env_file=str(env_file),
            cid_file=str(cid_file),
            cpu=spec.cpu,
            memory=0 if cgroup else spec.memory,
            cgroup_parent=cgroup,
        )
        if not spec.depends:
            podman.write_env_file(env_file, spec.env)
        client_env = {k: v for k, v in os.environ.items() if k in CLIENT_VARIABLES}
        record = ContainerRecord(
            name,
            str(cid_file),
            spec.log_path,
            cgroup,
            image=spec.container.image,
            create_timeout=spec.container.create_timeout,
        )
        # conmon writes files (an 'oom' marker) into its working directory: the instance's folder
        return dataclasses.replace(spec, argv=argv, cwd=str(folder)), client_env, record

    def created(self, record: ContainerRecord) -> float | None:
        """When the container's process was first seen (in its cgroup below ours; without one,
        when podman wrote its id), or None while podman still pulls or creates it: until then
        the instance is not reported running."""
        if record.created_at is None:
            try:
                cid = Path(record.cid_file).read_text().strip()
            except OSError:
                return None
            if not cid:
                return None
            if record.cgroup is not None:
                procs = CGROUP_ROOT / "pids" / record.cgroup.lstrip("/") / f"libpod-{cid}" / "cgroup.procs"
                try:
                    if not procs.read_text().strip():
                        return None
                except OSError:
                    return None
            record.created_at = time.time()
        return record.created_at

    def overdue(self, record: ContainerRecord, pid: int | None, client_started: float) -> bool:
        """Whether the container is still not created ``create_timeout`` after its ``podman run``
        client started (after the wait step, if any); if so the client is killed, once (a pull or
        create stuck on a silent registry), and the exit says why."""
        late = time.time() >= client_started + record.create_timeout
        if record.overdue or record.created_at is not None or not late or not pid:
            return record.overdue
        record.overdue = True
        log.warning(
            "container %s of image %s not created by its deadline: killing its client", record.name, record.image
        )
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return True

    def observe(self, record: ContainerRecord) -> tuple[float, int] | None:
        if record.cgroup is not None:
            record.usage = podman.cgroup_usage(record.cgroup) or record.usage
        return record.usage

    def ended(self, records: list[ContainerRecord]) -> None:
        """The clients of these containers ended: read each container's state, then remove it."""
        if not records:
            return
        runtime = self.runtime()
        states = podman.inspect(runtime, [r.name for r in records])
        for record in records:
            record.state = states.get(record.name, {})
            record.created = record.name in states
        left = podman.remove(runtime, [r.name for r in records])
        if left:
            log.error("containers %s could not be removed", left)
        for record in records:  # the container's own cgroup is gone with it: read, then remove ours
            if record.cgroup is not None:
                self.observe(record)
                record.oom_kills = podman.oom_kills(record.cgroup)
                podman.remove_cgroup(f"{record.cgroup}/conmon")
                podman.remove_cgroup(record.cgroup)
        with self._cgroups_lock:
            self._live_cgroups -= sum(1 for r in records if r.cgroup is not None)
            if self._live_cgroups <= 0:
                self._live_cgroups = 0
                podman.remove_cgroup(f"/{CONTAINER_CGROUPS}/{self.node_key}")

    def remove_leftovers(self, journaled: list[str]) -> int:
        """After an agent restart: remove the containers of unended journal records and every
        container labelled with this agent's key. Returns how many were removed."""
        try:
            runtime = self.runtime()
        except ContainerRuntimeMissing as exc:
            if journaled:
                log.error("containers %s may still run: %s", journaled, exc)
            return 0
        names = sorted(set(journaled) | set(podman.labelled(runtime, self.node_key)))
        present = set(podman.inspect(runtime, names))
        left = podman.remove(runtime, names)
        if left:
            log.error("containers %s left by an earlier agent could not be removed", left)
        self.close()  # and the cgroup parents they left
        return len(present) - len(left)

    def close(self) -> None:
        """Remove this agent's (empty) container cgroup parents: on restart and at shutdown."""
        for hierarchy in CGROUP_ROOT.iterdir() if CGROUP_ROOT.is_dir() else []:
            ours = hierarchy / CONTAINER_CGROUPS / self.node_key
            if not ours.is_dir():
                continue
            for instance in ours.iterdir():
                for group in (instance / "conmon", instance):
                    try:
                        group.rmdir()
                    except OSError:
                        pass
            try:
                ours.rmdir()
            except OSError:
                pass


def failure_reason(record: ContainerRecord, code: int) -> tuple[str, str] | None:
    """Reason and message when the container itself explains the exit (OOM, never created)."""
    if record.state.get("OOMKilled") or (record.oom_kills and code == 137):
        return "OOMKilled", "killed by the kernel: the container's memory limit was reached"
    if record.overdue and not record.created:
        return "ErrImagePull", (
            f"image '{record.image}' was not pulled and its container not created within the "
            f"creation timeout; podman said: {_last_error_line(record.log_path)}"
        )
    if not record.created and code in CLIENT_FAILED_CODES:
        said = _last_error_line(record.log_path)
        if "image not known" in said or "no such image" in said.lower():
            return "ErrImageNeverPull", f"the image is not present and imagePullPolicy is Never: {said}"
        if _pulled(record.log_path) or "pull" in said.lower() or "manifest unknown" in said:
            return "ErrImagePull", said
        return "ContainerFailed", f"podman could not run the container (exit code {code}): {said}"
    return None


def _pulled(log_path: str) -> bool:
    """Whether podman tried to pull (its progress lines are in the instance log)."""
    try:
        with open(log_path, "rb") as f:
            return b"Trying to pull " in f.read(1 << 16)
    except OSError:
        return False


def _last_error_line(log_path: str) -> str:
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 8192))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "see the instance log"
    errors = [line for line in tail if line.startswith("Error")]
    return (errors or tail or ["see the instance log"])[-1].strip()
