"""Process-tree ownership: which processes belong to one instance, and how to end them all.

Two ways, chosen once per agent:

- :class:`CgroupTrees` (root, cgroup v1 ``pids``/``memory``/``freezer`` mounted): one cgroup per
  instance in each hierarchy, under ``<the agent's own cgroup>/trainmaster/<node key>/``. A child
  enters its cgroups atomically (the spawning thread moves itself in, forks, moves back), so no
  descendant can escape by forking early, by ``setsid`` or by double-forking. Stopping freezes
  the group, signals every member and thaws it, so nothing forks between the listing and the
  signal. ``memory.max_usage_in_bytes`` is the tree's peak memory (RSS and page cache) and
  ``cpuacct.usage`` (where mounted) its CPU time.
- :class:`MarkerTrees` (no cgroups: not root, or not mounted): every process of an instance
  inherits ``TM_INSTANCE_ID``; the tree is whatever ``/proc/*/environ`` carries it. Weaker: a
  process that clears its environment escapes, and a fork between listing and killing is caught
  only by the next round.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUIRED = ("pids", "memory", "freezer")
OPTIONAL = ("cpuacct",)
INSTANCE_MARKER = "TM_INSTANCE_ID"
AGENT_MARKER = "TM_AGENT_KEY"
#: What a cgroup file answers once its cgroup is gone: ENOENT if it was removed before the file
#: was opened, ENODEV if it was removed between the open and the read or write (the reaper
#: removes an ended instance's cgroups while a stop may be signalling it). Either way the tree
#: has ended: there is nothing left to freeze, list or signal.
GONE = (errno.ENOENT, errno.ENODEV)


def _gone(error: OSError) -> bool:
    return error.errno in GONE


def cgroup_name(instance_id: str) -> str:
    """A directory name for an instance id (``<job uid>/<role>-<index>/<attempt>``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", instance_id.replace("/", "."))


class ProcessTrees(Protocol):
    """What the agent needs to own the process trees of its instances."""

    kind: str

    def create(self, instance_id: str, memory_limit: int) -> None: ...
    def enter(self, instance_id: str) -> None: ...
    def leave(self) -> None: ...
    def pids(self, instance_id: str) -> list[int]: ...
    def signal_all(self, instance_id: str, sig: int) -> int: ...
    def cpu_seconds(self, instance_id: str) -> float | None: ...
    def peak_rss(self, instance_id: str) -> int | None: ...
    def oom_killed(self, instance_id: str) -> bool: ...
    def remove(self, instance_id: str) -> bool: ...
    def leftovers(self) -> list[str]: ...
    def close(self) -> None: ...


def _own_cgroup(hierarchy: str) -> str | None:
    """The agent's own cgroup path in a v1 hierarchy, or None when that hierarchy is absent."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if hierarchy in controllers.split(","):
            return path
    return None


def cgroups_available() -> str:
    """Empty when cgroup v1 trees can be used here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for hierarchy in REQUIRED:
        own = _own_cgroup(hierarchy)
        if own is None or not (CGROUP_ROOT / hierarchy / "tasks").exists():
            return f"cgroup v1 hierarchy '{hierarchy}' is not mounted at {CGROUP_ROOT / hierarchy}"
    return ""


class CgroupTrees:
    kind = "cgroup"

    def __init__(self, node_key: str):
        self.hierarchies: dict[str, Path] = {}
        self._home: dict[str, Path] = {}  # where the spawning thread goes back to
        for hierarchy in (*REQUIRED, *OPTIONAL):
            own = _own_cgroup(hierarchy)
            if own is None or not (CGROUP_ROOT / hierarchy / "tasks").exists():
                continue
            base = CGROUP_ROOT / hierarchy / own.lstrip("/")
            self._home[hierarchy] = base
            self.hierarchies[hierarchy] = base / "trainmaster" / node_key
            self.hierarchies[hierarchy].mkdir(parents=True, exist_ok=True)
        self._parents = [str(path) for path in self.hierarchies.values()]

    def _dir(self, hierarchy: str, instance_id: str) -> Path:
        return self.hierarchies[hierarchy] / cgroup_name(instance_id)

    def create(self, instance_id: str, memory_limit: int) -> None:
        for hierarchy in self.hierarchies:
            self._dir(hierarchy, instance_id).mkdir(exist_ok=True)
        if memory_limit > 0:
            (self._dir("memory", instance_id) / "memory.limit_in_bytes").write_text(str(memory_limit))

    def enter(self, instance_id: str) -> None:
        """Move the calling thread into the instance's cgroups (v1 moves one thread by ``tasks``)."""
        tid = str(threading.get_native_id()).encode()
        for hierarchy in self.hierarchies:
            _write(self._dir(hierarchy, instance_id) / "tasks", tid)

    def leave(self) -> None:
        self.send_home(threading.get_native_id())

    def send_home(self, tid: int) -> None:
        """Move one of the agent's threads (any, by its native id) back into the agent's own cgroups."""
        data = str(tid).encode()
        for hierarchy in self.hierarchies:
            _write(self._home[hierarchy] / "tasks", data)

    def send_all_home(self) -> None:
        """Move every thread of the agent back into its own cgroups at once: one write of its pid
        to each hierarchy's ``cgroup.procs`` (v1 then moves the whole thread group), where
        :meth:`send_home` per thread takes the cgroups' migration lock once per thread and
        hierarchy, a lock every fork on the machine waits for meanwhile."""
        data = str(os.getpid()).encode()
        for hierarchy in self.hierarchies:
            _write(self._home[hierarchy] / "cgroup.procs", data)

    # ---- warm slots (trainmaster.agent.warm): empty cgroups made ahead, named at a start ----------
    def make_slot(self, slot: str, tid: int) -> None:
        """Create the empty cgroups ``slot`` (a name no instance id maps to) and move the agent's
        thread ``tid`` into them: that thread's next child is born there."""
        for hierarchy in self.hierarchies:
            (self.hierarchies[hierarchy] / slot).mkdir()
        data = str(tid).encode()
        for hierarchy in self.hierarchies:
            _write(self.hierarchies[hierarchy] / slot / "tasks", data)

    def name_slot(self, slot: str, instance_id: str, memory_limit: int) -> None:
        """Give a warm slot's cgroups the instance's name (``rename(2)`` within the parent, which
        cgroup v1 allows: far cheaper than creating them and moving a thread in); the thread in
        it is then inside the instance's cgroups. All or nothing: a failure renames back."""
        name = cgroup_name(instance_id)
        done: list[str] = []  # parents (plain strings: this runs once per instance of a start)
        try:
            for parent in self._parents:
                os.rename(f"{parent}/{slot}", f"{parent}/{name}")
                done.append(parent)
            if memory_limit > 0:
                (self._dir("memory", instance_id) / "memory.limit_in_bytes").write_text(str(memory_limit))
        except OSError:
            for parent in done:
                os.rename(f"{parent}/{name}", f"{parent}/{slot}")
            raise

    def remove_slot(self, slot: str) -> None:
        """Remove a warm slot's (empty) cgroups; its thread must have gone home first."""
        for hierarchy in self.hierarchies:
            try:
                (self.hierarchies[hierarchy] / slot).rmdir()
            except FileNotFoundError:
                pass

    def pids(self, instance_id: str) -> list[int]:
        try:
            text = (self._dir("pids", instance_id) / "cgroup.procs").read_text()
        except OSError as exc:
            if _gone(exc):  # the tree ended and its cgroup was removed: no member left
                return []
            raise
        me = os.getpid()  # the agent itself, while its spawning thread passes through
        return [int(p) for p in text.split() if int(p) != me]

    def _freeze(self, instance_id: str, state: str) -> None:
        path = self._dir("freezer", instance_id) / "freezer.state"
        try:
            path.write_text(state)
            if state == "FROZEN":  # FREEZING until every task stopped: wait, bounded
                deadline = time.monotonic() + 2.0
                delay = 0.001
                while path.read_text().strip() != "FROZEN" and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
        except OSError as exc:
            if _gone(exc):  # the tree ended and its cgroup was removed meanwhile: nothing to freeze
                return
            raise

    def signal_all(self, instance_id: str, sig: int) -> int:
        """Freeze, signal every member, thaw: nothing forks past the signal."""
        self._freeze(instance_id, "FROZEN")
        try:
            pids = self.pids(instance_id)
            for pid in pids:
                _kill(pid, sig)
        finally:
            self._freeze(instance_id, "THAWED")
        return len(pids)

    def _read_int(self, hierarchy: str, instance_id: str, name: str) -> int | None:
        if hierarchy not in self.hierarchies:
            return None
        try:
            return int((self._dir(hierarchy, instance_id) / name).read_text().split()[0])
        except (ValueError, IndexError):
            return None
        except OSError as exc:
            if _gone(exc):
                return None
            raise

    def cpu_seconds(self, instance_id: str) -> float | None:
        ns = self._read_int("cpuacct", instance_id, "cpuacct.usage")
        return None if ns is None else ns / 1e9

    def peak_rss(self, instance_id: str) -> int | None:
        return self._read_int("memory", instance_id, "memory.max_usage_in_bytes")

    def oom_killed(self, instance_id: str) -> bool:
        return bool(self._read_int("memory", instance_id, "memory.failcnt"))

    def remove(self, instance_id: str) -> bool:
        """Remove the instance's cgroups; False while one still holds an exiting (unreaped)
        member, so the caller tries again after the next reap."""
        removed = True
        for hierarchy in self.hierarchies:
            path = self._dir(hierarchy, instance_id)
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
        return removed

    def close(self) -> None:
        """Remove this agent's (empty) parent cgroups when it stops."""
        for path in self.hierarchies.values():
            try:
                path.rmdir()
            except OSError as exc:  # an instance cgroup still in it (logged when it failed)
                log.warning("kept cgroup %s: %s", path, exc)

    def leftovers(self) -> list[str]:
        """Instance cgroup names under this agent's parent (a crashed agent's)."""
        return sorted(p.name for p in self.hierarchies["pids"].iterdir() if p.is_dir())


class MarkerTrees:
    kind = "marker"

    def __init__(self, node_key: str):
        self.node_key = node_key

    def create(self, instance_id: str, memory_limit: int) -> None:
        pass

    def enter(self, instance_id: str) -> None:
        pass

    def leave(self) -> None:
        pass

    def _scan(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        agent = f"{AGENT_MARKER}={self.node_key}".encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if agent not in environ:
                continue
            for item in environ:
                if item.startswith(INSTANCE_MARKER.encode() + b"="):
                    found.setdefault(item.split(b"=", 1)[1].decode(), []).append(int(entry.name))
        return found

    def pids(self, instance_id: str) -> list[int]:
        return [p for p in self._scan().get(instance_id, []) if not _zombie(p)]

    def signal_all(self, instance_id: str, sig: int) -> int:
        pids = self.pids(instance_id)
        for pid in pids:
            _kill(pid, sig)
        return len(pids)

    def cpu_seconds(self, instance_id: str) -> float | None:
        return None

    def peak_rss(self, instance_id: str) -> int | None:
        return None

    def oom_killed(self, instance_id: str) -> bool:
        return False

    def remove(self, instance_id: str) -> bool:
        return True

    def leftovers(self) -> list[str]:
        return sorted(self._scan())

    def close(self) -> None:
        pass


def _write(path: Path, data: bytes) -> None:
    """One write(2) to a cgroup control file (no buffering, no text layer)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def make_trees(node_key: str, use_cgroups: bool = True) -> ProcessTrees:
    """Cgroup trees where the kernel offers them, else environment markers (logged once)."""
    why = cgroups_available() if use_cgroups else "disabled by the agent's options"
    if not why:
        return CgroupTrees(node_key)
    log.warning("process trees tracked by the %s marker, not cgroups: %s", INSTANCE_MARKER, why)
    return MarkerTrees(node_key)


def kill_tree(trees: ProcessTrees, instance_id: str, timeout: float = 10.0) -> bool:
    """SIGKILL every process of an instance's tree until none is left; False on timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        alive = [p for p in trees.pids(instance_id) if not _zombie(p)]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            log.error("instance %s: processes %s survived SIGKILL for %.0fs", instance_id, alive, timeout)
            return False
        trees.signal_all(instance_id, signal.SIGKILL)
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
