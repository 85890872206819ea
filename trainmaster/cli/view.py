"""Rendering a job's status: a rich table for terminals, plain event lines otherwise."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"succeeded": "green", "running": "cyan", "starting": "yellow", "pending": "dim",
               "failed": "bold red", "cancelled": "magenta", "stopped": "dim", "terminating": "yellow",
               "unknown": "red"}


def _state(value: str) -> Text:
    return Text(value, style=STATE_STYLE.get(value, ""))


def render_status(status: dict[str, Any], events: int = 8) -> Group:
    head = Text.assemble(("job ", "bold"), (f"{status['name']} (id {status['id']}) ", "bold"),
                         _state(status["state"]), f"  {status['reason']}: {status['message']}")
    roles = Table("role", "state", "replicas", "pending", "starting", "running", "succeeded", "failed",
                  "restarts", title=None, expand=False)
    restarts: dict[str, int] = {}
    for inst in status["instances"]:
        restarts[inst["role"]] = restarts.get(inst["role"], 0) + inst["restarts"]
    for role in status["roles"]:
        c = role["counts"]
        roles.add_row(role["name"], _state(role["state"]), str(role["replicas"]),
                      *(str(c.get(k, 0)) for k in ("pending", "starting", "running", "succeeded", "failed")),
                      str(restarts.get(role["name"], 0)))
    instances = Table("instance", "state", "attempt", "address", "exit", "reason")
    for inst in status["instances"][:24]:
        instances.add_row(f"{inst['role']}-{inst['index']}", _state(inst["state"]), str(inst["attempt"]),
                          inst["address"] or "", "" if inst["exitCode"] is None else str(inst["exitCode"]),
                          inst["reason"])
    if len(status["instances"]) > 24:
        instances.add_row(f"... {len(status['instances']) - 24} more", "", "", "", "", "")
    log = Table("time", "object", "reason", "message", show_header=True)
    for ev in status["events"][-events:]:
        log.add_row(ev["time"][11:19], ev["object"], Text(ev["reason"], style="red" if ev["type"] == "Warning"
                                                          else ""), ev["message"])
    return Group(head, roles, instances, log)


def event_line(ev: dict[str, Any]) -> str:
    return f"{ev['time'][11:19]} {ev['object']:<22} {ev['reason']:<20} {ev['message']}"
