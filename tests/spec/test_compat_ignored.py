"""Never silently dropped: every source field the converters do not use is reported."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainmaster.spec.compat import convert as _convert
from trainmaster.spec.load import read_document


def convert(raw: Any) -> Any:
    """The --lenient reading: every unknown field is listed (the strict reading refuses them)."""
    return _convert(raw, lenient=True)


ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["kubeflow-pytorchjob.yaml", "kubeflow-tfjob.yaml", "kubeflow-mpijob.yaml", "volcano-job.yaml"]
CONTAINER = {
    "name": "main",
    "command": ["python", "train.py"],
    "args": ["--x"],
    "env": [{"name": "A", "value": "1"}],
    "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}},
}
KITCHEN_SINKS = {
    "kubeflow": {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "k"},
        "spec": {
            "runPolicy": {"backoffLimit": 1, "schedulingPolicy": {"queue": "q"}},
            "pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {"containers": [CONTAINER]}}}},
        },
    },
    "volcano": {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "v"},
        "spec": {
            "minAvailable": 2,
            "policies": [{"event": "PodFailed", "action": "RestartJob"}],
            "tasks": [
                {"name": "a", "template": {"spec": {"containers": [CONTAINER]}}},
                {
                    "name": "b",
                    "dependsOn": {"name": ["a"]},
                    "policies": [{"event": "TaskCompleted", "action": "CompleteJob"}],
                    "template": {"spec": {"containers": [CONTAINER]}},
                },
            ],
        },
    },
}
# Free-form maps whose keys are carried over (labels, annotations) or name replica types.
CARRIED = ("labels", "annotations", "ReplicaSpecs")


def mappings(node: Any, path: str = "") -> Iterator[tuple[str, list[Any]]]:
    """Every mapping in ``node``: its source path and the key route to reach it."""

    def walk(value: Any, where: str, route: list[Any]) -> Iterator[tuple[str, list[Any]]]:
        if isinstance(value, dict):
            yield where, route
            for key, child in value.items():
                yield from walk(child, f"{where}.{key}" if where else str(key), route + [key])
        elif isinstance(value, list):
            for i, child in enumerate(value):
                yield from walk(child, f"{where}[{i}]", route + [i])

    yield from walk(node, path, [])


def reported(ignored: list[str], path: str) -> bool:
    """``path`` or one of its ancestors is listed as ignored."""
    for line in ignored:
        listed = line.split(": ", 1)[0]
        if path == listed or path.startswith(listed + ".") or path.startswith(listed + "["):
            return True
    return False


@pytest.mark.parametrize("name", EXAMPLES + sorted(KITCHEN_SINKS))
def test_an_unknown_field_anywhere_is_reported(name: str) -> None:
    """Mechanism: ignored-field reporting. A field added at any level of a real job file is
    either listed as ignored (itself or an enclosing field) -- never dropped without a word."""
    raw = KITCHEN_SINKS[name] if name in KITCHEN_SINKS else read_document(ROOT / "examples" / name)
    checked = 0
    for path, route in mappings(raw):
        if path.endswith(CARRIED):
            continue
        doc = copy.deepcopy(raw)
        node = doc
        for key in route:
            node = node[key]
        node["zzUnheardOf"] = {"x": 1}
        converted = convert(doc)
        assert converted is not None
        target = f"{path}.zzUnheardOf" if path else "zzUnheardOf"
        assert reported(converted.ignored, target), (target, converted.ignored)
        checked += 1
    assert checked >= 10
