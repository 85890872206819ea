"""Warm spawning slots: a start batch spawns each child from a thread that already sits in a
fresh, empty set of cgroups, so the only cgroup work between the start request and the child's
``exec`` is renaming those cgroups to the instance's name.

Why: on cgroup v1 a child is born inside its instance's cgroups only if the thread that forks it
is in them already. Creating an instance's cgroups (one directory in each of the four
hierarchies) and moving the spawning thread into them cost about 0.5 ms per instance on the
2-core machine we measure on (about 17 ms and 20 ms for 64 instances), all of it on the way from
a submit to the commands running. Renaming a slot's cgroups (``rename(2)`` within their parent,
which cgroup v1 allows) costs about 0.07 ms for the four. The slots are made again by a
background thread once no batch came for ``QUIET`` seconds (the batch's commands, and the
controller recording them, have the cores first), where nobody waits for them.

A slot is one thread plus cgroups named ``warm-<agent pid>-<n>`` (no ``.`` in it, so no
instance id maps to such a name: see :func:`trainmaster.agent.tree.cgroup_name`). What holds:

- A thread is inside an instance's cgroups only from naming its slot until every spawn of its
  batch returned; all go home (:meth:`WarmSlots.home`) before the batch's ``start`` returns,
  under the agent's spawn lock, so the agent never freezes or signals a group that holds one
  of its own threads (the rule the cold spawning threads follow too).
- A slot's cgroups are fresh, never reused after an instance: an instance's CPU and peak
  memory counters start at zero, and its memory limit is written when the slot is named.
- An agent killed while it holds slots leaves empty ``warm-*`` cgroups (their threads died with
  it); the next agent removes them with the other leftovers before it accepts a start. A slot
  never held a process, so nothing can escape through one.

How many: as many as the largest start batch seen so far, at most ``limit``. Only batches of
``WARM_BATCH`` or more use slots (:meth:`NodeAgent._spawn_batch`; handing a spawn to another
thread costs a wakeup), so an agent that starts a few instances at a time keeps none. A batch
larger than the slots made so far spawns the rest the cold way (create, enter, spawn).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

from trainmaster.agent.tree import CgroupTrees

log = logging.getLogger(__name__)

SLOT_PREFIX = "warm-"
IDLE_WAIT = 60.0  # seconds an idle thread or the refiller sleeps before it looks again (it is woken anyway)
QUIET = 0.1  # seconds without a start batch before slots are made again (the batch's commands start meanwhile)
CLOSE_WAIT = 5.0  # seconds close waits for the refiller to finish the slot it is making

T = TypeVar("T")


def is_slot(cgroup: str) -> bool:
    """Whether a cgroup name under an agent's parent is a warm slot's (not an instance's)."""
    return cgroup.startswith(SLOT_PREFIX)


class Slot:
    """A thread of the agent that runs one spawn at a time, from wherever it was moved."""

    def __init__(self) -> None:
        self.cgroup: str | None = None  # the slot cgroups it waits in, None while at home
        self.used: str | None = None  # the slot it spawned from, until it is sent home
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._started = threading.Event()
        self.tid = 0
        self._thread = threading.Thread(target=self._serve, name="warm-spawn", daemon=True)
        self._thread.start()
        if not self._started.wait(IDLE_WAIT):
            raise RuntimeError("a warm spawning thread did not start")

    def _serve(self) -> None:
        self.tid = threading.get_native_id()
        self._started.set()
        while True:
            try:
                job = self._work.get(timeout=IDLE_WAIT)  # a spawn, or None: end
            except queue.Empty:
                continue
            if job is None:
                return
            job()

    def run(self, job: Callable[[], None]) -> None:
        self._work.put(job)

    def end(self) -> None:
        self._work.put(None)


class WarmSlots:
    """The agent's warm slots (only where its process trees are cgroups)."""

    def __init__(self, trees: CgroupTrees, limit: int, pause: threading.Lock):
        """``pause``: held by the agent during a whole start batch; the refiller takes it for each
        slot it makes, so it never competes with a batch for the cgroup locks."""
        self._trees = trees
        self._limit = limit
        self._pause = pause
        self._lock = threading.Lock()
        self._warm: list[Slot] = []  # waiting in slot cgroups
        self._idle: list[Slot] = []  # at home, to be moved into new slot cgroups
        self._wanted = 0
        self._last_batch = 0.0  # time.monotonic() of the last take
        self._named: set[str] = set()  # slots named after an instance, not yet sent home
        self._names = itertools.count()
        self._wake = threading.Event()
        self._closed = False
        self._refiller = threading.Thread(target=self._refill_forever, name="warm-slots", daemon=True)
        self._refiller.start()

    def take(self, count: int) -> list[Slot]:
        """Up to ``count`` warm slots for a batch of ``count`` spawns (each used once)."""
        with self._lock:
            self._wanted = min(self._limit, max(self._wanted, count))
            self._last_batch = time.monotonic()
            taken, self._warm = self._warm[:count], self._warm[count:]
        return taken

    def spawn(self, slot: Slot, spawn: Callable[[], T]) -> Future[T]:
        """Run ``spawn()`` on the slot's thread, the slot named after its instance first
        (:meth:`name`, by the batch's thread). The thread stays where it is (in the instance's
        cgroups) until :meth:`home`."""
        future: Future[T] = Future()
        name = slot.cgroup
        assert name is not None, "a slot is spawned from only once"
        slot.cgroup, slot.used = None, name

        def job() -> None:
            try:
                result = spawn()
            except BaseException as exc:  # handed to the batch's thread, which raises it
                future.set_exception(exc)
                return
            future.set_result(result)

        slot.run(job)
        return future

    def name(self, slot: str, instance_id: str, memory_limit: int) -> None:
        """Make a slot's cgroups the instance's, just before its thread is handed the spawn. The
        batch's thread names its slots one after another: renames made by many threads at once
        contend for the kernel's cgroup locks and cost several times the CPU each."""
        self._trees.name_slot(slot, instance_id, memory_limit)
        with self._lock:
            self._named.add(slot)

    def home(self, slots: list[Slot]) -> None:
        """Move the threads of a batch's slots back into the agent's own cgroups, once every
        one's spawn is done, and remove the cgroups of slots that were not named (a spawn
        refused before it was placed). Before the batch's start returns: then no agent thread
        is left in an instance's cgroups. All at the end, not each after its own spawn: moving
        a thread between cgroups holds a lock every fork on the machine takes too, so moves
        interleaved with the batch's spawns slow them (and the new commands' own forks)."""
        with self._lock:
            together = bool(slots) and not self._warm  # no thread waits in a slot: all may go home
        if together:
            try:
                self._trees.send_all_home()
            except OSError:
                log.exception("the agent's threads could not go home together; moving them one by one")
                together = False
        for slot in slots:
            name, slot.used = slot.used, None
            try:
                if not together:
                    self._trees.send_home(slot.tid)
                with self._lock:
                    named = name in self._named
                    self._named.discard(name)
                if name is not None and not named:
                    self._trees.remove_slot(name)
            except OSError:
                log.exception("a warm spawning thread could not go home; it is not used again")
                continue
            with self._lock:
                if self._closed:
                    slot.end()
                else:
                    self._idle.append(slot)

    def refill(self) -> None:
        """Make slots again, up to the largest batch seen, once no batch came for ``QUIET``
        seconds: the cgroups of a batch's slots are made on the same cores that the batch's
        new commands, and the controller recording them, need right after it."""
        self._wake.set()

    def _refill_forever(self) -> None:
        while not self._closed:
            if not self._wake.wait(IDLE_WAIT):  # woken after each batch
                continue
            self._wake.clear()
            while not self._closed:  # until QUIET seconds passed since the last batch
                quiet_for = time.monotonic() - self._last_batch
                if quiet_for >= QUIET:
                    break
                if self._wake.wait(QUIET - quiet_for):  # another batch (or close): wait on
                    self._wake.clear()  # (left set, every later wait would return at once: a spin)
            while not self._closed and self._make_one():
                pass

    def _make_one(self) -> bool:
        """Make one slot; False once there are enough (or making one failed)."""
        with self._lock:
            if len(self._warm) >= self._wanted:
                return False
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            slot = Slot()
        name = f"{SLOT_PREFIX}{os.getpid()}-{next(self._names)}"
        with self._pause:
            if self._closed:
                slot.end()
                return False
            try:
                self._trees.make_slot(name, slot.tid)
            except OSError as exc:
                log.warning("could not make a warm spawning slot (%s); the next batch spawns cold", exc)
                try:
                    self._trees.send_home(slot.tid)
                    self._trees.remove_slot(name)
                except OSError:
                    log.exception("could not undo a half-made warm slot %s", name)
                slot.end()
                return False
            slot.cgroup = name
            with self._lock:
                self._warm.append(slot)
        return True

    def close(self) -> None:
        """End every slot thread and remove the slots' cgroups (before the agent's parent cgroups)."""
        self._closed = True
        self._wake.set()
        self._refiller.join(CLOSE_WAIT)
        with self._pause, self._lock:
            slots, self._warm, self._idle = self._warm + self._idle, [], []
            for slot in slots:
                if slot.cgroup is not None:
                    try:
                        self._trees.send_home(slot.tid)
                        self._trees.remove_slot(slot.cgroup)
                    except OSError as exc:
                        log.warning("kept warm slot %s: %s", slot.cgroup, exc)
                slot.end()
