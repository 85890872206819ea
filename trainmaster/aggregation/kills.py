"""Process faults: kill (or stop) one process of the tier at a chosen moment.

Part of fault injection, beside the per-packet faults of ``FaultPlan``: the victim signals
*itself* when it has handled ``after_packets`` packets (a node: packets received; a worker:
packets sent), so the moment is chosen by progress, not by wall-clock time, and a run with the
same seed kills at the same point of the protocol. The signal is real (``SIGKILL`` cannot be
caught: nothing of the victim runs afterwards, exactly as with ``kill -9`` from outside;
``SIGSTOP`` freezes it, as a stalled host would).

What each case must end in (tests/aggregation/test_aggregation_kills.py):
- a forwarding node: its workers notice that their heartbeats go unacknowledged, fall back to
  the parameter node directly, and the job finishes with exact sums;
- a worker (killed or stopped): the parameter node names it in the job's abort;
- the parameter node: every worker ends with an error naming the parameter node.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass(frozen=True)
class KillPlan:
    """``target``: ``ps``, ``switch`` (the top forwarding node), ``switch:I`` (I-th node in
    ``Fabric.switches``) or ``worker:R`` (rank R of every job)."""

    target: str
    after_packets: int = 50
    signal: str = "KILL"

    def __post_init__(self) -> None:
        role, _, index = self.target.partition(":")
        if (
            role not in ("ps", "switch", "worker")
            or (index and not index.isdigit())
            or (role == "ps" and index)
            or (role == "worker" and not index)
        ):
            raise ValueError(f"kill target must be ps, switch, switch:I or worker:R, got {self.target!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"kill signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if self.after_packets < 0:
            raise ValueError("after_packets must be >= 0")

    def aims_at(self, role: str, index: int = 0) -> bool:
        """Whether this plan's victim is the process ``role`` number ``index``."""
        want, _, at = self.target.partition(":")
        return want == role and int(at or 0) == index


class Trigger:
    """The armed plan inside its victim: ``tick(count)`` signals this process once ``count``
    reaches the plan's moment. A process without a plan holds ``Trigger(None)``: one
    comparison per packet."""

    __slots__ = ("at", "signum")

    def __init__(self, plan: KillPlan | None):
        self.at = plan.after_packets if plan is not None else -1
        self.signum = SIGNALS[plan.signal] if plan is not None else 0

    def tick(self, count: int) -> None:
        if 0 <= self.at <= count:
            self.at = -1  # once (a stopped process continued with SIGCONT goes on)
            os.kill(os.getpid(), self.signum)
