"""States of jobs, roles and instances, and the transitions each may take, as data.

Every state change in the controller goes through :func:`check_transition`, so an illegal
move (say, a succeeded job becoming running) is a bug caught in one place. Terminal states are
final. What a node reports of an attempt (:class:`~trainmaster.contract.InstancePhase`, the
one vocabulary of agents and backends) means an instance state through :func:`observed_state`,
the one place the two meet.
"""

from __future__ import annotations

from enum import Enum

from trainmaster.contract import InstancePhase


class InstanceState(str, Enum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TERMINATING = "terminating"
    UNKNOWN = "unknown"  # its host cannot be reached (a backend that lost contact)
    STOPPED = "stopped"  # stopped by the controller (surplus, job end, cancel)


class JobState(str, Enum):
    """States of a job and of each of its roles."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


RoleState = JobState

#: The instance state each phase a node reports means; an exit is split by its code.
PHASE_STATES: dict[InstancePhase, InstanceState] = {
    InstancePhase.STARTING: InstanceState.STARTING,
    InstancePhase.RUNNING: InstanceState.RUNNING,
    InstancePhase.UNREACHABLE: InstanceState.UNKNOWN,
    InstancePhase.LOST: InstanceState.FAILED,
}


def observed_state(phase: InstancePhase, exit_code: int | None = None) -> InstanceState:
    """The instance state a node's report means: an exit succeeded only with code 0; a lost
    attempt failed (its restart policy then decides, as for any failure)."""
    if phase == InstancePhase.EXITED:
        return InstanceState.SUCCEEDED if exit_code == 0 else InstanceState.FAILED
    return PHASE_STATES[phase]


INSTANCE_TERMINAL = frozenset({InstanceState.SUCCEEDED, InstanceState.FAILED, InstanceState.STOPPED})
JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_I = InstanceState
INSTANCE_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    _I.PENDING: frozenset({_I.STARTING, _I.STOPPED, _I.FAILED}),
    _I.STARTING: frozenset({_I.RUNNING, _I.SUCCEEDED, _I.FAILED, _I.TERMINATING, _I.UNKNOWN, _I.PENDING}),
    _I.RUNNING: frozenset({_I.SUCCEEDED, _I.FAILED, _I.TERMINATING, _I.UNKNOWN, _I.PENDING}),
    _I.UNKNOWN: frozenset({_I.STARTING, _I.RUNNING, _I.SUCCEEDED, _I.FAILED, _I.TERMINATING, _I.PENDING}),
    _I.TERMINATING: frozenset({_I.STOPPED, _I.SUCCEEDED, _I.FAILED}),
    _I.SUCCEEDED: frozenset({_I.PENDING}),  # only by a restart policy of Always
    _I.FAILED: frozenset({_I.PENDING}),  # only by a restart policy that allows it
    _I.STOPPED: frozenset(),
}

_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _J.PENDING: frozenset({_J.STARTING, _J.RUNNING, _J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    _J.STARTING: frozenset({_J.PENDING, _J.RUNNING, _J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    _J.RUNNING: frozenset({_J.STARTING, _J.PENDING, _J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    _J.SUCCEEDED: frozenset(),
    _J.FAILED: frozenset(),
    _J.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the state machine does not allow (a controller bug, not a user error)."""


def check_transition(kind: str, current: str, new: str) -> None:
    """Raise :class:`IllegalTransition` unless ``current -> new`` is allowed for ``kind``."""
    if current == new:
        return
    if kind == "instance":
        ok = InstanceState(new) in INSTANCE_TRANSITIONS[InstanceState(current)]
    else:
        ok = JobState(new) in JOB_TRANSITIONS[JobState(current)]
    if not ok:
        raise IllegalTransition(f"{kind} cannot go from {current} to {new}")
