"""``trainmaster info``: where Trainmaster keeps its state and what this machine offers it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from typing import Annotated, Any

import typer

OPTIONAL = {
    "torch": "torch",
    "sklearn": "torch",
    "pymetis": "partition",
    "kahip": "partition",
    "onnx": "partition",
    "pyarrow": "gateway",
    "ray": "ray",
    "psycopg": "postgres",
    "kubernetes": "kubernetes",
}
TOOLS = {
    "bwrap": "gateway executor sandbox",
    "podman": "container roles",
    "mpirun": "MPIJob",
    "chromium": "dashboard browser tests",
    "ip": "testbed",
    "tc": "testbed link caps",
    "containerd": "trainmaster cluster (make k8s-deps)",
    "kubectl": "operator mode (kubectl apply)",
}


def facts() -> dict[str, Any]:
    from trainmaster import __version__
    from trainmaster.store.db import default_url, home

    state = home()
    return {
        "version": __version__,
        "python": sys.executable,
        "home": str(state),
        "store": default_url(),
        "runs": str(state / "runs"),
        "agent": str(state / "agent"),
        "optional_packages": {name: bool(importlib.util.find_spec(name)) for name in OPTIONAL},
        "tools": {name: shutil.which(name) for name in TOOLS},
    }


def info(json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show Trainmaster's version, where its state lives (TRAINMASTER_HOME or --home: store, runs,
    agent) and which optional packages and system tools this machine has.

    Examples:

      trainmaster info

      trainmaster --home ./.trainmaster info --json
    """
    data = facts()
    if json_out:
        print(json.dumps(data, indent=2))
        return
    for key in ("version", "python", "home", "store", "runs", "agent"):
        print(f"{key:<10} {data[key]}")
    missing = sorted({OPTIONAL[n] for n, ok in data["optional_packages"].items() if not ok})
    print(
        f"{'extras':<10} "
        + ("all installed" if not missing else "missing: " + ", ".join(f"trainmaster[{m}]" for m in missing))
    )
    for name, path in data["tools"].items():
        print(f"{name:<10} {path or 'not found'}  ({TOOLS[name]})")


def register(app: typer.Typer) -> None:
    app.command()(info)
