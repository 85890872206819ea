"""The gateway package's folders show its architecture: imports only run downhill (the layer map in
``trainmaster/gateway/__init__.py``), sibling sub-packages of one layer do not import each other,
and nothing in it imports the controller."""

from __future__ import annotations

import ast
from pathlib import Path

import trainmaster.gateway as gateway

ROOT = Path(gateway.__file__).parent
LAYERS = {
    "models": 0,
    "config": 1,
    "store": 1,
    "crypto": 2,
    "rules": 2,
    "audit": 3,
    "executors": 3,
    "net": 3,
    "party": 4,
    "relay": 4,
    "initiator": 4,
    "localdeploy": 5,
    "storm": 6,
}
OUTSIDE_ALLOWED = ("trainmaster.errors", "trainmaster.store.db", "trainmaster.spec.boundedyaml")
"""The only modules of the rest of the package the gateway uses (all below every capability): the
bounded YAML reader is how every YAML file is read (its expanded size bounded, issue 39)."""


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [m for m in found if m.startswith("trainmaster")]


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["trainmaster", "gateway"] else None


def test_gateway_imports_run_downhill_and_never_reach_the_controller() -> None:
    """Gateway layering: every module's imports go to its own sub-package or a lower layer."""
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        unit = rel.parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        assert unit in LAYERS, f"{rel}: a new sub-package needs its place in LAYERS and the package docstring"
        for module in _imports(path):
            target = _unit(module)
            if target is None:
                if module in ("trainmaster.gateway", "trainmaster") or module.startswith(OUTSIDE_ALLOWED):
                    continue
                problems.append(f"{rel} imports {module} (outside the gateway)")
            elif target in LAYERS and target != unit and LAYERS[target] >= LAYERS[unit]:
                problems.append(f"{rel} (layer {LAYERS[unit]}) imports {module} (layer {LAYERS[target]})")
    assert not problems, "\n".join(problems)
