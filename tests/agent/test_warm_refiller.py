"""The warm slots' refiller (issue #38, the 64-replica start): between start batches it waits
until no batch came for ``QUIET`` seconds, asleep. A batch arriving during that wait must not
leave its wake-up set: a set event makes every later wait return at once, and the refiller then
spins, holding the interpreter lock the agent's spawning threads need, until the quiet time has
passed (found while measuring the agent's CPU per start: 120-140 ms instead of ~25)."""

from __future__ import annotations

import threading
import time

from trainmaster.agent import warm


class _Trees:
    """Just enough of CgroupTrees for the refiller: slots are made and removed, nothing more."""

    def make_slot(self, slot: str, tid: int) -> None: ...

    def remove_slot(self, slot: str) -> None: ...

    def send_home(self, tid: int) -> None: ...


class _CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_a_batch_during_the_quiet_wait_does_not_make_the_refiller_spin() -> None:
    """Warm slots: start batches every 20 ms for 0.3 s keep the refiller in its quiet wait; it
    wakes about once per batch, not thousands of times."""
    slots = warm.WarmSlots(_Trees(), limit=2, pause=threading.Lock())  # type: ignore[arg-type]
    wake, asleep = _CountingEvent(), slots._wake
    slots._wake = wake
    asleep.set()  # the refiller sleeps on the event it started with: hand it the counting one
    try:
        batches = 15
        for _ in range(batches):
            slots.take(8)
            slots.refill()
            time.sleep(0.02)
        time.sleep(warm.QUIET * 2)
        assert wake.waits <= 4 * batches, f"the refiller waited {wake.waits} times for {batches} batches: a spin"
    finally:
        slots.close()
