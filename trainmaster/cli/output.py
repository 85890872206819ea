"""The CLI's rich consoles: laid out for the terminal they print on, and never wrapped or cut
when there is none.

Without a terminal (a pipe, a file, a CI log) rich assumes 80 columns and wraps or cuts
whatever is wider: a JSON result split over lines no longer parses, and a job's header line ends
in an ellipsis. There, lines are as long as their content (what ``print`` gives) and tables as
wide as they need, up to :data:`UNBOUNDED` columns.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

UNBOUNDED = 4096  # columns a table may take without a terminal (a line of text is never cut)


def console(stderr: bool = False, **options: Any) -> Console:
    """A console on stdout (or stderr) that wraps only where a terminal would."""
    out = Console(stderr=stderr, **options)
    if out.is_terminal:
        return out
    return Console(stderr=stderr, **{**options, "soft_wrap": True, "width": UNBOUNDED})
