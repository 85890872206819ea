"""``command``: every role is an arbitrary command; the controller adds only the TM_* variables."""

from __future__ import annotations

from trainmaster.frameworks.base import Framework


class CommandFramework(Framework):
    name = "command"
