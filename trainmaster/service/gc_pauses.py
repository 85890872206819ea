"""How long the garbage collector stops the API process, for ``/metrics``: a histogram of each
collection's pause by generation (``trainmaster_gc_pause_seconds``).

A collection holds the interpreter lock from its start to its end: no thread runs, and the event
loop reads no request, so a request that arrives meanwhile waits before the application sees it.
That wait is in what the client measures and not in the server's own time (``Server-Timing``,
:mod:`.request_metrics`). A full collection (generation 2) walks every object the process keeps
that start-up did not freeze (``gc.freeze`` in ``trainmaster server``), so full pauses that grow
over a run say the process keeps something per request or per job. Issue 31: the server
process's controller kept every submitted job's spec, and during the Kueue replay its full
collections grew to 360 ms, the list p99 at the client to 138-214 ms against 25-30 ms in the server.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

from trainmaster.controller.metrics import REGISTRY

GC_PAUSE_SECONDS = Histogram(
    "trainmaster_gc_pause_seconds",
    "Seconds each garbage collection of the API process stopped it, by generation (2: a full collection)",
    ["generation"],
    registry=REGISTRY,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
# made here, not in the callback: a child made there would take the family's lock, which the
# thread whose allocation set off the collection may hold (making a child allocates)
_PAUSES = [GC_PAUSE_SECONDS.labels(generation=str(generation)) for generation in range(3)]
_began = [0.0]  # when the collection in progress began (one at a time: the collector is not reentrant)


def time_collections() -> None:
    """Time every garbage collection of this process from now on; once per process."""
    if _observe not in gc.callbacks:
        gc.callbacks.append(_observe)


def _observe(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
    else:
        _PAUSES[info["generation"]].observe(time.perf_counter() - _began[0])
