"""Bookkeeping for a conversion: every source field we could not carry over, with the reason.

A Kubernetes job file is full of fields that mean something only on a cluster (images, volumes,
node selectors). The converters never drop such a field silently: each one goes through
:class:`Report`, and the user sees the list (``trainmaster convert`` prints it on stderr, and
``trainmaster run`` shows it before starting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainmaster.errors import UserError


@dataclass
class Report:
    """The ignored (or only approximated) source fields, as ``path: reason`` lines."""

    source: str  # e.g. "kubeflow.org/v1 PyTorchJob", used in error messages
    lines: list[str] = field(default_factory=list)

    def ignore(self, path: str, reason: str) -> None:
        self.lines.append(f"{path}: {reason}")

    def approximate(self, path: str, reason: str) -> None:
        """A field that was translated, but not exactly: the user must know the difference."""
        self.lines.append(f"{path}: approximated: {reason}")

    def rest(self, mapping: dict[str, Any], path: str, handled: set[str],
             reasons: dict[str, str], default_reason: str) -> None:
        """Report every key of ``mapping`` that the converter did not handle."""
        for key in mapping:
            if key not in handled:
                self.ignore(join(path, key), reasons.get(key, default_reason))

    def error(self, path: str, message: str) -> UserError:
        return UserError(f"cannot convert this {self.source}", [f"{path}: {message}"])

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        """``value`` as a mapping (None counts as empty); a structural error otherwise."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(path, f"must be a mapping, not {type(value).__name__}")
        return value

    def sequence(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(path, f"must be a list, not {type(value).__name__}")
        return value


def join(path: str, key: str | int) -> str:
    """``spec`` + ``tasks`` -> ``spec.tasks``; ``spec.tasks`` + 0 -> ``spec.tasks[0]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key
