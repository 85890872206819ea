"""The node agent: the only owner of instance processes on its node (``NodeAgentAPI`` in-process).

It spawns each role command itself (an instance with dependencies first runs the wait step,
``python -m trainmaster.runtime.launch``, which then *execs* the role command: one process, no
wrapper that could be killed on its own), puts every instance in its own process tree
(:mod:`trainmaster.agent.tree`; with cgroups, from warm slots made ahead where it has them:
:mod:`trainmaster.agent.warm`), makes itself a child subreaper so orphaned descendants come back
to it, reaps with ``os.wait4`` (exit status and rusage), and journals every exit with fsync before
reporting it (:mod:`trainmaster.agent.journal`).

An instance ends when its main process ends: what is left of its tree is killed then (as a
container runtime does when a container's first process exits), and only once the tree is empty
and the main process' status was reaped is it EXITED.

Agent death: a restarted agent does not re-adopt (it could never learn the exit status of a
process it did not spawn). Before it accepts any start it kills whatever is left of every
instance it had journaled as started and not ended, and journals each as EXITED with reason
``AgentRestarted`` (exit code 137); the controller then applies the restart policy. So nothing
ever runs twice and no exit is lost.

The agent reaps *every* child of its process (``wait4(-1)``): run it in a process of its own
(the daemon of :mod:`trainmaster.agent.server`, or a Ray actor), never inside a process that
spawns and waits for children of its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import trainmaster
from trainmaster.agent.containers import ContainerHooks, ContainerRecord, failure_reason
from trainmaster.contract import InstanceHandle, InstancePhase, InstanceStatus, LaunchSpec, StartResult
from trainmaster.agent.journal import ExitJournal, JournaledInstance
from trainmaster.agent.spawn import NOTIFY_FD, spawn
from trainmaster.containers.runtime import ContainerRuntimeMissing, container_name
from trainmaster.agent.tree import (
    AGENT_MARKER,
    INSTANCE_MARKER,
    CgroupTrees,
    MarkerTrees,
    ProcessTrees,
    cgroup_name,
    kill_tree,
    make_trees,
)
from trainmaster.agent.warm import WarmSlots, is_slot

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
AGENT_RESTART_EXIT = 137
START_FAILED_EXIT = 127
NOTIFY_FD_VARIABLE = "TM_AGENT_NOTIFY_FD"
SPAWNS_PER_THREAD = 4  # a batch smaller than this per thread is not worth handing to more threads
# a smaller batch is spawned cold by the calling thread: handing each spawn to a waiting thread
# costs a wakeup, which on a busy machine outweighs the cgroup work a warm slot saves
WARM_BATCH = 8
SPEC_FILE = "launch_spec.json"
_PACKAGE_ROOT = str(Path(trainmaster.__file__).resolve().parents[1])


@dataclass
class AgentOptions:
    """How one node agent runs."""

    state_dir: Path  # journal, socket, lock and log live here
    node: str = "local"
    use_cgroups: bool = True  # False: marker trees even where cgroups exist (tests of the fallback)
    kill_timeout: float = 10.0  # how long SIGKILLed trees may take to disappear before it is an error
    spawn_threads: int = 8  # a start batch is spawned by this many threads at once (beyond the warm slots)
    warm_slots: int = 64  # most spawning threads kept waiting in fresh cgroups (trainmaster.agent.warm)

    @cached_property
    def node_key(self) -> str:
        """Names this agent's cgroup parent: one per state dir, so agents never touch each other's
        (computed once: every spawn marks its child with it)."""
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:10]
        return f"{self.node}-{digest}"


@dataclass
class _Instance:
    """One attempt the agent holds a record of."""

    instance_id: str
    role: str
    gated: bool
    started_at: float
    pid: int | None = None
    popen: subprocess.Popen[bytes] | None = None
    notify_fd: int | None = None
    command_started_at: float | None = None
    wait_reason: str = ""  # what the wait step reported before it gave up
    wait_message: str = ""
    stopping: bool = False
    status: InstanceStatus | None = None  # final, journaled
    start_error: str = ""
    container: ContainerRecord | None = None  # set: the main process is its ``podman run``
    ports: list[int] = field(default_factory=list)  # its spec's, handed back in every handle

    def handle(self, node: str) -> InstanceHandle:
        return InstanceHandle(node, self.instance_id, self.pid, list(self.ports))


@dataclass(frozen=True)
class _Child:
    """A main process just spawned, not yet known to the reaper."""

    pid: int
    popen: subprocess.Popen[bytes] | None  # None: spawned by posix_spawn (trainmaster.agent.spawn)
    notify_fd: int | None


@dataclass(frozen=True)
class _Reaped:
    pid: int
    status: int
    rusage: Any


def become_subreaper() -> bool:
    """Orphaned descendants are reparented to us (and reaped by us), not to init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_code_of(wait_status: int) -> int:
    """A shell's convention: the exit status, or 128 + the signal that killed it."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status)


def start_error_message(spec: LaunchSpec, error: Exception) -> str:
    """Names the program and the OS's reason (what a user checks first)."""
    program = spec.argv[0] if spec.argv else "<empty command>"
    if not isinstance(error, OSError):
        return f"program '{program}' could not start: {error}"
    if spec.cwd and error.filename == spec.cwd:
        return f"program '{program}' not started: working directory '{spec.cwd}': {error.strerror or error}"
    if isinstance(error, FileNotFoundError):
        return f"program '{program}' not found ({error.strerror})"
    if isinstance(error, PermissionError):
        return f"program '{program}' cannot be executed ({error.strerror})"
    return f"program '{program}' could not start: {error.strerror or error}"


class NodeAgent:
    """Implements :class:`trainmaster.contract.NodeAgentAPI` in the agent's own process."""

    def __init__(self, options: AgentOptions):
        self.options = options
        self.node = options.node
        options.state_dir.mkdir(parents=True, exist_ok=True)
        self.subreaper = become_subreaper()
        self.trees: ProcessTrees = make_trees(options.node_key, options.use_cgroups)
        self.journal = ExitJournal(options.state_dir / "journal.jsonl")
        self._lock = threading.RLock()  # the records
        self._changed = threading.Condition(self._lock)  # an instance ended
        self._spawn_lock = threading.Lock()  # one spawn at a time (the spawning thread moves cgroups)
        self._journal_lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._exits = 0  # instance ends so far (journaled), for wait_exit
        self._by_pid: dict[int, _Instance] = {}
        self._unclaimed: dict[int, tuple[_Reaped, float]] = {}  # reaped before its spawn was recorded
        self._child_started = threading.Event()
        self._closed = False
        self._unremoved: set[str] = set()  # ended instances whose cgroups still hold an unreaped member
        self.containers = ContainerHooks(options.node_key)
        log.info(
            "node agent %s (pid %d, parent %d, argv %s): process trees by %s, subreaper %s, state in %s",
            self.node,
            os.getpid(),
            os.getppid(),
            sys.argv,
            self.trees.kind,
            self.subreaper,
            options.state_dir,
        )
        self._recover()
        self._spawner = ThreadPoolExecutor(max(1, options.spawn_threads), thread_name_prefix="spawn")
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="prepare")
        self._starts = 0  # start batches under way: a preparation gives way to them
        self._warm = (
            WarmSlots(self.trees, options.warm_slots, self._spawn_lock)
            if isinstance(self.trees, CgroupTrees) and options.warm_slots > 0
            else None
        )
        self._reaper = threading.Thread(target=self._reap_forever, name="reaper", daemon=True)
        self._reaper.start()

    # ---- restart: kill what a previous agent left, journal it, before any start -------------
    def _recover(self) -> None:
        records = self.journal.replay()
        restarted_at = time.time()
        markers = MarkerTrees(self.options.node_key)  # every process we start carries them
        containers = [r.started["container"] for r in records.values() if r.exit is None and r.started.get("container")]
        for record in records.values():
            if record.exit is not None:
                self._instances[record.instance_id] = self._from_journal(record)
                continue
            instance_id = record.instance_id
            left = self.trees.pids(instance_id) + markers.pids(instance_id)
            kill_tree(self.trees, instance_id, self.options.kill_timeout)
            kill_tree(markers, instance_id, self.options.kill_timeout)  # started by an agent without cgroups
            self.trees.remove(instance_id)
            handle = InstanceHandle(
                self.node, instance_id, record.started.get("pid"), list(record.started.get("ports") or [])
            )
            status = InstanceStatus(
                handle,
                InstancePhase.EXITED,
                exit_code=AGENT_RESTART_EXIT,
                reason="AgentRestarted",
                message=(
                    f"the node agent restarted while this instance ran; its {len(left)} remaining "
                    "process(es) were killed so that it never runs twice"
                ),
                started_at=record.started.get("at"),
                ended_at=restarted_at,
            )
            self.journal.exited([status])
            record.exit = status
            self._instances[instance_id] = self._from_journal(record)
            log.warning(
                "instance %s: journaled as started, not ended; killed %d process(es) (AgentRestarted)",
                instance_id,
                len(left),
            )
        if containers:  # after their clients: nothing is left to start them again
            removed = self.containers.remove_leftovers(containers)
            log.warning("removed %d container(s) of instances journaled as started, not ended", removed)
        known = {record.instance_id for record in records.values()}
        known |= {cgroup_name(i) for i in known}
        for name in self.trees.leftovers():  # trees an earlier agent could not remove, or never journaled
            kill_tree(self.trees, name, self.options.kill_timeout)
            self._remove_trees([name])
            if name not in known and not is_slot(name):  # a warm slot never held a process
                log.warning("removed an unjournaled process tree %s left by an earlier agent", name)
        self.journal.compact(records)

    def _from_journal(self, record: JournaledInstance) -> _Instance:
        assert record.exit is not None
        inst = _Instance(
            record.instance_id,
            record.started.get("role", ""),
            bool(record.started.get("gated")),
            record.started.get("at", 0.0),
            pid=record.exit.handle.pid,
            ports=list(record.started.get("ports") or []),
        )
        inst.status = record.exit
        return inst

    # ---- start ---------------------------------------------------------------------------------
    def prepare(self, log_paths: list[str]) -> None:
        """Create the log files of instances a controller is about to start, on a thread of
        their own, and return at once. A controller asks while its pass still commits the start
        intents, when a core of the machine is idle; creating a file is a large part of a spawn
        (a new inode: on ext4 without a journal, a search past every inode freed in the last
        minute). Nothing runs and nothing is journaled: a file made for a start that never
        comes stays empty, and the start opens (or creates) each log itself anyway, writing the
        attempt's header then. A start batch that begins meanwhile has the agent to itself: the
        preparation stops, and the spawns create what it had not."""
        if self._closed or not log_paths:
            return
        try:
            self._preparer.submit(self._create_logs, log_paths)
        except RuntimeError:  # shut down meanwhile
            pass

    def _create_logs(self, log_paths: list[str]) -> None:
        for path in log_paths:
            if self._starts or self._closed:
                return
            try:
                os.close(_create_log(path))
            except OSError:  # the start says so, naming the instance
                continue

    def start(self, specs: list[LaunchSpec]) -> list[StartResult]:
        if self._closed:
            raise RuntimeError("the node agent is shutting down")
        with self._lock:
            self._starts += 1
        try:
            return self._start(specs)
        finally:
            with self._lock:
                self._starts -= 1

    def _start(self, specs: list[LaunchSpec]) -> list[StartResult]:
        with self._lock:
            fresh = [s for s in specs if s.instance_id not in self._instances]
            now = time.time()
            for spec in fresh:
                self._instances[spec.instance_id] = _Instance(
                    spec.instance_id, spec.role, bool(spec.depends), now, ports=list(spec.ports)
                )
        if fresh:
            with self._journal_lock:
                self.journal.started(
                    [
                        {
                            "id": s.instance_id,
                            "role": s.role,
                            "gated": bool(s.depends),
                            "at": now,
                            "ports": list(s.ports),
                            **(
                                {"container": container_name(self.options.node_key, s.instance_id)}
                                if s.container is not None
                                else {}
                            ),
                        }
                        for s in fresh
                    ]
                )
        fresh_ids = {s.instance_id for s in fresh}
        todo = [s for s in specs if s.instance_id in fresh_ids]
        with self._spawn_lock:
            spawned = self._spawn_batch(todo)
            # recorded only now: until then no reaper acts on a tree a spawning thread may still
            # be in (each goes from one instance's cgroups straight into the next one's)
            self._record(spawned)
        if self._warm is not None and todo:
            self._warm.refill()  # after the batch, where nobody waits for it
        return [self._start_result(spec.instance_id) for spec in specs]

    def _spawn_batch(self, specs: list[LaunchSpec]) -> list[tuple[_Instance, _Child]]:
        """Spawn a batch: as many as there are warm slots from those (each on its own thread,
        already in fresh cgroups: :mod:`trainmaster.agent.warm`), the rest cold (cgroups
        created and entered per spawn) on up to ``spawn_threads`` threads; a batch of fewer
        than ``WARM_BATCH`` all cold."""
        warm = self._warm
        if warm is None or len(specs) < WARM_BATCH:
            return self._spawn_cold(specs)
        slots = warm.take(len(specs))
        futures = []
        for slot, spec in zip(slots, specs):
            # the slot is named here, one rename after another: renames made by the batch's
            # threads at once contend for the cgroup locks (about six times the CPU each);
            # the slot's thread meanwhile spawns the instance named before
            named = self._name(slot.cgroup, spec)
            futures.append(warm.spawn(slot, partial(self._spawn, spec, named)))
        try:
            spawned = self._spawn_cold(specs[len(slots) :])
        finally:
            wait(futures)  # every slot's spawn returned (its child exec'd, or it was refused)
            warm.home(slots)  # then no agent thread is left in an instance's cgroups
        for spec, future in zip(specs, futures):
            child = future.result()
            if child is not None:
                spawned.append((self._instances[spec.instance_id], child))
        return spawned

    def _spawn_cold(self, specs: list[LaunchSpec]) -> list[tuple[_Instance, _Child]]:
        """Spawn on up to ``spawn_threads`` threads at once: each spawn waits for its child's
        ``exec`` (and, on a busy machine, for the child to be scheduled at all), and
        ``subprocess`` lets other threads run meanwhile."""
        if not specs:
            return []
        threads = max(1, min(self.options.spawn_threads, len(specs) // SPAWNS_PER_THREAD))
        if threads == 1:
            return self._spawn_share(specs)
        shares = [specs[n::threads] for n in range(threads)]
        spawned: list[tuple[_Instance, _Child]] = []
        for part in self._spawner.map(self._spawn_share, shares):
            spawned += part
        return spawned

    def _spawn_share(self, specs: list[LaunchSpec]) -> list[tuple[_Instance, _Child]]:
        """One thread's part of a batch; the thread ends it back in the agent's own cgroups."""
        spawned = []
        try:
            for spec in specs:
                child = self._spawn(spec)
                if child is not None:
                    spawned.append((self._instances[spec.instance_id], child))
        finally:
            self.trees.leave()
        return spawned

    def _start_result(self, instance_id: str) -> StartResult:
        with self._lock:
            inst = self._instances[instance_id]
            if inst.start_error:
                return StartResult(instance_id, None, inst.start_error)
            return StartResult(instance_id, inst.handle(self.node))

    def _spawn(self, spec: LaunchSpec, placed: bool = False) -> _Child | None:
        """Spawn one instance's first process inside its cgroups; the calling thread stays in
        them until its next spawn moves it or its share of the batch ends. ``placed``: the
        calling thread waits in a warm slot already named after the instance (its cgroups);
        else it creates them and moves in."""
        inst = self._instances[spec.instance_id]
        markers = {INSTANCE_MARKER: spec.instance_id, AGENT_MARKER: self.options.node_key}
        notify_read = notify_write = None
        process_env = spec.env
        if spec.container is not None:  # the main process is ``podman run``, in the host's environment
            image = spec.container.image
            try:
                spec, process_env, inst.container = self.containers.prepare(spec, self.trees.kind == "cgroup")
            except (ContainerRuntimeMissing, OSError, ValueError) as error:
                if placed:
                    self.trees.leave()  # out of the named slot, so that its cgroups go
                self._start_failed(inst, spec, f"image '{image}' not started: {error}")
                return None
        if spec.depends:
            Path(spec.instance_dir).mkdir(parents=True, exist_ok=True)
            _atomic_write(Path(spec.instance_dir) / SPEC_FILE, json.dumps(spec.to_dict()))
            notify_read, notify_write = os.pipe()
            os.set_blocking(notify_read, False)
            argv = [sys.executable, "-S", "-m", "trainmaster.runtime.launch", str(Path(spec.instance_dir) / SPEC_FILE)]
            python_path = os.pathsep.join(p for p in (_PACKAGE_ROOT, spec.env.get("PYTHONPATH")) if p)
            notify_at = NOTIFY_FD if spawn is not None else notify_write  # posix_spawn moves it to 3
            env = {**process_env, **markers, "PYTHONPATH": python_path, NOTIFY_FD_VARIABLE: str(notify_at)}
        else:
            argv, env = list(spec.argv), {**process_env, **markers}
        if not argv:  # validation refuses `command: []`; a spec that still has none fails to start, clearly
            if placed:
                self.trees.leave()  # out of the named slot, so that its cgroups go
            self._start_failed(inst, spec, f"{spec.role}-{spec.index} has no command to run")
            return None
        out = None
        try:
            out = _open_log(spec)
            # the child is born in the instance's cgroups (the thread is in them before it spawns)
            if not placed:
                self._place(spec)
            pid, popen = _start_process(argv, env, spec.cwd or None, out, notify_write)
        except (OSError, ValueError, TypeError) as error:  # ValueError: a NUL that slipped past validation
            self.trees.leave()  # out of a group that is about to be removed
            self._start_failed(inst, spec, error)
            return None
        finally:
            if out is not None:
                os.close(out)
            if notify_write is not None:
                os.close(notify_write)
        return _Child(pid, popen, notify_read)

    def _name(self, slot: str | None, spec: LaunchSpec) -> bool:
        """Give a warm slot's cgroups the instance's name (the thread waiting in them is then in
        the instance's cgroups); False where that failed, and the slot's thread places the
        instance the cold way (:meth:`_place`)."""
        if slot is None or self._warm is None:
            return False
        try:
            self._warm.name(slot, spec.instance_id, 0 if spec.container else spec.memory)
            return True
        except OSError as exc:  # e.g. a tree of that name not removed yet: the cold way
            log.info("instance %s: warm slot not usable (%s); creating its cgroups", spec.instance_id, exc)
            return False

    def _place(self, spec: LaunchSpec) -> None:
        """Put the calling thread into the instance's cgroups: create them and move it in."""
        self.trees.create(spec.instance_id, 0 if spec.container else spec.memory)
        self.trees.enter(spec.instance_id)

    def _record(self, spawned: list[tuple[_Instance, _Child]]) -> None:
        """Note each spawned main process, so the reaper knows it; one that has already ended
        (reaped before it was recorded) has its exit handled now."""
        if not spawned:
            return
        early = []
        with self._lock:
            for inst, child in spawned:
                inst.pid, inst.popen, inst.notify_fd = child.pid, child.popen, child.notify_fd
                if not inst.gated:
                    inst.command_started_at = inst.started_at
                self._by_pid[child.pid] = inst
                reaped = self._unclaimed.pop(child.pid, None)
                if reaped is not None:
                    early.append((inst, reaped[0]))
        self._child_started.set()
        if early:  # they ended before we recorded them
            self._main_exited(early)

    def _start_failed(self, inst: _Instance, spec: LaunchSpec, error: Exception | str) -> None:
        message = error if isinstance(error, str) else start_error_message(spec, error)
        log.info("instance %s: %s", spec.instance_id, message)
        self.trees.remove(spec.instance_id)
        status = InstanceStatus(
            InstanceHandle(self.node, spec.instance_id, None, list(spec.ports)),
            InstancePhase.EXITED,
            exit_code=START_FAILED_EXIT,
            reason="StartFailed",
            message=message,
            started_at=inst.started_at,
            ended_at=time.time(),
        )
        with self._journal_lock:
            self.journal.exited([status])
        with self._lock:
            inst.start_error, inst.status = message, status
            self._exits += 1
            self._changed.notify_all()

    # ---- reaping -------------------------------------------------------------------------------
    def _reap_forever(self) -> None:
        while not self._closed:
            try:
                pid, status, rusage = os.wait4(-1, 0)
            except ChildProcessError:
                self._child_started.wait(1.0)  # no child at all: sleep until one is spawned
                self._child_started.clear()
                continue
            except InterruptedError:
                continue
            batch = [_Reaped(pid, status, rusage)]
            while True:  # every exit already there, so one fsync covers them all
                try:
                    pid, status, rusage = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                batch.append(_Reaped(pid, status, rusage))
            mains = []
            with self._lock:
                now = time.monotonic()
                for reaped in batch:
                    inst = self._by_pid.pop(reaped.pid, None)
                    if inst is None:  # an orphaned descendant, or a child whose spawn is not recorded yet
                        self._unclaimed[reaped.pid] = (reaped, now)
                    else:
                        mains.append((inst, reaped))
                for pid, (_, when) in list(self._unclaimed.items()):
                    if now - when > 60:
                        del self._unclaimed[pid]
            if mains:
                try:
                    self._main_exited(mains)
                except Exception:
                    log.exception("recording the exit of %s failed", [i.instance_id for i, _ in mains])
            elif self._unremoved:
                self._remove_trees([])

    def _main_exited(self, mains: list[tuple[_Instance, _Reaped]]) -> None:
        """Kill what is left of each tree, then journal the exits (one fsync) and report them."""
        self.containers.ended([inst.container for inst, _ in mains if inst.container is not None])
        finals = []
        for inst, reaped in mains:
            if inst.popen is not None:
                inst.popen.returncode = reaped.status  # so subprocess never waits for it again
            self._read_notes(inst)
            if self.trees.pids(inst.instance_id):
                kill_tree(self.trees, inst.instance_id, self.options.kill_timeout)
            finals.append(self._final_status(inst, reaped))
        with self._journal_lock:
            self.journal.exited(finals)
        self._remove_trees([inst.instance_id for inst, _ in mains])  # before anyone hears of the exit
        with self._lock:
            for (inst, _), status in zip(mains, finals):
                inst.status = status
                if inst.notify_fd is not None:
                    os.close(inst.notify_fd)
                    inst.notify_fd = None
                inst.popen = None
            self._exits += len(mains)
            self._changed.notify_all()

    def _remove_trees(self, instance_ids: list[str]) -> None:
        """Remove ended instances' cgroups; one whose orphans are not reaped yet is retried
        after the next reap (and at shutdown)."""
        with self._lock:
            pending = self._unremoved | set(instance_ids)
            self._unremoved = {i for i in pending if not self.trees.remove(i)}

    def _final_status(self, inst: _Instance, reaped: _Reaped) -> InstanceStatus:
        code = exit_code_of(reaped.status)
        cpu = self.trees.cpu_seconds(inst.instance_id)
        if cpu is None:
            cpu = reaped.rusage.ru_utime + reaped.rusage.ru_stime
        peak = self.trees.peak_rss(inst.instance_id) or reaped.rusage.ru_maxrss * 1024
        explained = None if inst.container is None else failure_reason(inst.container, code)
        if inst.container is not None and inst.container.usage is not None:
            cpu, peak = inst.container.usage  # the container's cgroup, not its podman client's
        if inst.wait_reason:
            reason, message = inst.wait_reason, inst.wait_message
        elif explained is not None:
            reason, message = explained
        elif (
            os.WIFSIGNALED(reaped.status)
            and os.WTERMSIG(reaped.status) == signal.SIGKILL
            and self.trees.oom_killed(inst.instance_id)
        ):
            reason, message = "OOMKilled", "killed by the kernel: the instance's memory limit was reached"
        elif inst.stopping:
            reason, message = "Stopped", f"stopped by the agent (exit code {code})"
        elif os.WIFSIGNALED(reaped.status):
            sig = signal.Signals(os.WTERMSIG(reaped.status)).name
            reason, message = "Killed", f"killed by {sig}"
        else:
            reason, message = ("Completed", "") if code == 0 else ("Error", f"exited with code {code}")
        return InstanceStatus(
            inst.handle(self.node),
            InstancePhase.EXITED,
            exit_code=code,
            reason=reason,
            message=message,
            started_at=inst.started_at,
            command_started_at=inst.command_started_at,
            ended_at=time.time(),
            cpu_seconds=round(cpu, 3),
            peak_rss=int(peak),
        )

    def _read_notes(self, inst: _Instance) -> None:
        """What the wait step told us through its notify pipe: ``exec <time>`` just before it
        became the role command, or ``reason <Reason> <message>`` before it gave up."""
        if inst.notify_fd is None:
            return
        chunks = []
        while True:
            try:
                chunk = os.read(inst.notify_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        for line in b"".join(chunks).decode(errors="replace").splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "exec":
                inst.command_started_at = float(rest)
            elif kind == "reason":
                inst.wait_reason, _, inst.wait_message = rest.partition(" ")

    # ---- observe ---------------------------------------------------------------------------------
    def _status(self, instance_id: str) -> InstanceStatus:
        inst = self._instances.get(instance_id)
        if inst is None:
            return InstanceStatus(
                InstanceHandle(self.node, instance_id),
                InstancePhase.LOST,
                reason="Unknown",
                message=f"the node agent of {self.node} holds no record of {instance_id}",
            )
        if inst.status is not None:
            return inst.status
        if inst.gated and inst.command_started_at is None:
            self._read_notes(inst)
        phase = InstancePhase.RUNNING if inst.command_started_at is not None else InstancePhase.STARTING
        reason, command_started_at = "WaitingForDependencies", inst.command_started_at
        cpu, peak = self.trees.cpu_seconds(instance_id) or 0.0, self.trees.peak_rss(instance_id) or 0
        if inst.container is not None and phase == InstancePhase.RUNNING:
            command_started_at = self.containers.created(inst.container)  # podman may still pull or create
            if command_started_at is None:
                phase, reason = InstancePhase.STARTING, "ContainerCreating"
                self.containers.overdue(inst.container, inst.pid, inst.command_started_at or 0.0)  # stuck pull
            cpu, peak = self.containers.observe(inst.container) or (cpu, peak)
        return InstanceStatus(
            inst.handle(self.node),
            phase,
            reason="" if phase == InstancePhase.RUNNING else reason,
            started_at=inst.started_at,
            command_started_at=command_started_at,
            cpu_seconds=round(cpu, 3),
            peak_rss=peak,
        )

    def observe(self, instance_ids: list[str]) -> list[InstanceStatus]:
        with self._lock:
            return [self._status(i) for i in instance_ids]

    def live_count(self) -> int:
        with self._lock:
            return sum(1 for inst in self._instances.values() if inst.status is None)

    # ---- stop ------------------------------------------------------------------------------------
    def stop(self, instance_ids: list[str], grace: float) -> list[InstanceStatus]:
        with self._lock:
            live = [
                self._instances[i] for i in instance_ids if i in self._instances and self._instances[i].status is None
            ]
            for inst in live:
                inst.stopping = True
        with self._spawn_lock:  # never freeze a group while the spawning thread is in it
            for inst in live:
                self.trees.signal_all(inst.instance_id, signal.SIGTERM)
        if not self._wait_ended(live, grace):
            with self._spawn_lock:
                for inst in live:
                    if inst.status is None:
                        self.trees.signal_all(inst.instance_id, signal.SIGKILL)
            if not self._wait_ended(live, self.options.kill_timeout):
                log.error(
                    "instances %s did not end %.0fs after SIGKILL",
                    [i.instance_id for i in live if i.status is None],
                    self.options.kill_timeout,
                )
        return self.observe(instance_ids)

    def _wait_ended(self, instances: list[_Instance], timeout: float) -> bool:
        """Wait (on the reaper's notifications) until every instance has its journaled exit."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while any(inst.status is None for inst in instances):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def wait_exit(self, after: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds until more than ``after`` instances have ended since the
        agent started; returns how many have (a controller's watcher wakes its loop on a change)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._exits <= after and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._exits

    def forget(self, instance_ids: list[str]) -> None:
        with self._lock:
            gone = [i for i in instance_ids if i in self._instances and self._instances[i].status is not None]
            for instance_id in gone:
                del self._instances[instance_id]
        if gone:
            with self._journal_lock:
                self.journal.forgotten(gone)
                if self.journal.needs_compaction():
                    with self._lock:
                        records = {
                            i: JournaledInstance(
                                i,
                                {
                                    "id": i,
                                    "t": "start",
                                    "role": inst.role,
                                    "gated": inst.gated,
                                    "at": inst.started_at,
                                    "ports": inst.ports,
                                },
                                inst.status,
                            )
                            for i, inst in self._instances.items()
                        }
                    self.journal.compact(records)

    def shutdown(self, grace: float) -> None:
        """Stop every live instance (a node drained), then stop reaping."""
        with self._lock:
            live = [i for i, inst in self._instances.items() if inst.status is None]
        if live:
            log.info("shutting down: stopping %d live instance(s)", len(live))
            self.stop(live, grace)
        with self._lock:
            self._closed = True
            self._changed.notify_all()  # watchers waiting in wait_exit return
        self._spawner.shutdown(wait=False)
        self._preparer.shutdown(wait=False)
        if self._warm is not None:
            self._warm.close()
        self._child_started.set()
        self.journal.close()
        self._remove_trees([])
        for instance_id in self._unremoved:
            log.warning("the cgroups of %s still hold a member at shutdown; the next agent removes them", instance_id)
        self.trees.close()
        self.containers.close()

    def list(self) -> list[InstanceStatus]:
        with self._lock:
            return [self._status(i) for i in self._instances]


def _start_process(
    argv: list[str], env: dict[str, str], cwd: str | None, log_fd: int, notify_fd: int | None
) -> tuple[int, subprocess.Popen[bytes] | None]:
    """Start an instance's main process in its own session, its output to ``log_fd``: with
    ``posix_spawn`` (the interpreter lock released, nothing of the agent copied:
    :mod:`trainmaster.agent.spawn`), or with ``Popen`` where libc lacks it."""
    if spawn is not None:
        return spawn(argv, env, cwd, log_fd, notify_fd), None
    popen = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
        pass_fds=(notify_fd,) if notify_fd else (),
    )
    return popen.pid, popen


def _create_log(path: str) -> int:
    """An instance's log file, opened for appending (created, with its folder, where missing)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:  # the first instance of its job here: the folder too
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, 0o644)


def _open_log(spec: LaunchSpec) -> int:
    """The instance's log (appended to across attempts), opened with the attempt's header line."""
    fd = _create_log(spec.log_path)
    try:
        os.write(
            fd,
            f"--- attempt {spec.attempt} of {spec.role}-{spec.index} "
            f"at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode(),
        )
    except OSError:
        os.close(fd)
        raise
    return fd


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once, readable by its owner only (a launch spec holds the
    instance's channel token)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)
