"""Frameworks: named sets of roles and the code each role runs (placeholder until the core lands)."""

from __future__ import annotations

from typing import Any


def framework_errors(spec: dict[str, Any], raw_roles: list[dict[str, Any]]) -> list[str]:
    return []


def apply_defaults(job: Any) -> Any:
    return job
