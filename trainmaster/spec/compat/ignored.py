"""Bookkeeping for a conversion: what was honoured, noted, or refused, by source path.

Reading is strict, as ``kubectl`` is by default: a field the source kind does not have is an
error with its path in the user's file and a did-you-mean; a field that the kind has but that
would make the job run differently here (an elastic policy, an exit-code policy) is refused with
its own message. Fields that only mean something on a cluster (images, volumes, node selectors)
are listed as notes (``trainmaster convert`` prints them on stderr, ``run`` before starting).
``lenient`` (``--lenient``) turns unknown fields back into notes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Iterable

from trainmaster.errors import UserError


@dataclass
class Report:
    """The notes (``path: reason``) and the problems found while converting one document."""

    source: str  # e.g. "kubeflow.org/v1 PyTorchJob", used in error messages
    lenient: bool = False
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def ignore(self, path: str, reason: str) -> None:
        self.lines.append(f"{path}: {reason}")

    def approximate(self, path: str, reason: str) -> None:
        """A field that was translated, but not exactly: the user must know the difference."""
        self.lines.append(f"{path}: approximated: {reason}")

    def unknown(self, path: str, key: str, known: Iterable[str]) -> None:
        """A field the source kind does not have (a typo, usually)."""
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        if self.lenient:
            self.ignore(join(path, key), f"unknown field, ignored{hint}")
        else:
            self.errors.append(
                f"{join(path, key)}: unknown field{hint}; fix it, or pass --lenient to ignore unknown fields"
            )

    def unsupported(self, path: str, reason: str) -> None:
        """A known field that would change what the job does, and that is not supported here."""
        self.errors.append(f"{path}: not supported: {reason}")

    def invalid(self, path: str, reason: str) -> None:
        """A value the source project itself refuses (Volcano's and Kubeflow's own checks)."""
        self.errors.append(f"{path}: {reason}")

    def count(self, value: Any, path: str) -> bool:
        """Whether ``value`` is a count (an integer >= 0, as Kubernetes' int32 fields); invalid
        at ``path`` otherwise, so a field copied into another of ours is refused by its own
        path, not by the one it became."""
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**31 - 1:
            return True
        self.invalid(path, f"{str(value)[:40]!r} must be an integer from 0 to {2**31 - 1}")
        return False

    def rest(
        self,
        mapping: dict[str, Any],
        path: str,
        handled: Iterable[str],
        reasons: dict[str, str],
        known: Iterable[str] = (),
        known_reason: str = "",
    ) -> None:
        """Every key of ``mapping`` the converter did not handle: a note with its reason when the
        kind has it (``reasons``, or ``known`` with ``known_reason``), an unknown field otherwise."""
        handled, known = set(handled), set(known)
        for key in mapping:
            if key in handled:
                continue
            if key in reasons:
                self.ignore(join(path, key), reasons[key])
            elif key in known:
                self.ignore(join(path, key), known_reason)
            else:
                self.unknown(path, str(key), handled | known | set(reasons))

    def error(self, path: str, message: str) -> UserError:
        """A structural error that stops the conversion (with the problems found so far)."""
        return UserError(f"cannot convert this {self.source}", self.errors + [f"{path}: {message}"])

    def finish(self) -> None:
        """Raise every problem found, at once."""
        if self.errors:
            raise UserError(f"cannot convert this {self.source} ({len(self.errors)} problem(s))", self.errors)

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
