"""Errors that are the user's to fix: shown as one clear message, never as a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave us (a file, a flag, a request).

    The CLI prints ``error: <message>`` and exits with ``exit_code`` (2 by default, the
    conventional code for bad usage). ``details`` lists every individual problem, so that one
    run reports all of them at once.
    """

    def __init__(self, message: str, details: list[str] | None = None, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.details = list(details or [])
        self.exit_code = exit_code

    def __str__(self) -> str:
        if not self.details:
            return self.message
        return self.message + "\n" + "\n".join(f"  - {d}" for d in self.details)


class JobConflict(UserError):
    """The job's state forbids the verb, e.g. deleting a job that still runs (HTTP 409)."""


class BackendError(Exception):
    """A backend could not carry out what the controller asked (a node agent that refused or
    cannot be reached). Not the user's mistake, but never a traceback either: a controller that
    gives up on it records it on the job, and the CLI prints it as one line (exit 1)."""
