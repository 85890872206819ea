"""Job verbs: validate, run (embedded controller)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the job verbs to the top-level app."""
