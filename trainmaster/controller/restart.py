"""Restart policy: whether a finished instance runs again, and after how long."""

from __future__ import annotations

from dataclasses import dataclass

from trainmaster.spec.model import RestartPolicy, RestartPolicyKind

MAX_BACKOFF_SECONDS = 60.0


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    delay: float = 0.0
    exhausted: bool = False  # the policy wanted a restart but the limit is reached


def decide(policy: RestartPolicy, exit_code: int, restarts_so_far: int) -> RestartDecision:
    """Apply ``policy`` to an instance that exited with ``exit_code`` after ``restarts_so_far`` restarts.

    The backoff doubles per restart of the same instance: ``backoff * 2**restarts``, capped.
    """
    wants = (
        policy.policy == RestartPolicyKind.ALWAYS
        or (policy.policy == RestartPolicyKind.ON_FAILURE and exit_code != 0)
        or (policy.policy == RestartPolicyKind.EXIT_CODE and (exit_code >= 128 or exit_code < 0))
    )
    if wants and exit_code != 0 and policy.exit_codes is not None and exit_code not in policy.exit_codes:
        wants = False  # a failure with another code is not one this policy restarts
    if not wants:
        return RestartDecision(False)
    if restarts_so_far >= policy.max_restarts:
        return RestartDecision(False, exhausted=True)
    delay = min(policy.backoff_seconds * (2**restarts_so_far), MAX_BACKOFF_SECONDS)
    return RestartDecision(True, delay)
