"""Mechanisms: strict reading at the boundary: any TrainJob or runtime document, however
malformed (any value of any type at any place of a valid pair), is loaded or refused with a
UserError that lists its problems; never another exception (no traceback for a user's file)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmaster.errors import UserError
from trainmaster.loading import load_document
from trainmaster.spec.compat.trainer import runtime_doc
from trainmaster.spec.load import LoadOptions
from trainmaster.spec.model import RuntimeKind

RUNTIME: dict[str, Any] = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch"},
    "spec": {
        "mlPolicy": {
            "numNodes": 2,
            "torch": {"numProcPerNode": "auto", "elasticPolicy": {"minNodes": 1, "maxNodes": 3}},
        },
        "podGroupPolicy": {"coscheduling": {"scheduleTimeoutSeconds": 10}},
        "template": {
            "spec": {
                "successPolicy": {"operator": "All", "targetReplicatedJobs": ["node"]},
                "failurePolicy": {
                    "maxRestarts": 2,
                    "rules": [{"action": "RestartJob", "targetReplicatedJobs": ["node"]}],
                },
                "replicatedJobs": [
                    {
                        "name": "dataset-initializer",
                        "template": {
                            "spec": {
                                "template": {
                                    "spec": {"containers": [{"name": "dataset-initializer", "command": ["true"]}]}
                                }
                            }
                        },
                    },
                    {
                        "name": "node",
                        "dependsOn": [{"name": "dataset-initializer", "status": "Complete"}],
                        "template": {
                            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                            "spec": {
                                "template": {
                                    "spec": {
                                        "containers": [
                                            {
                                                "name": "node",
                                                "command": ["torchrun", "t.py"],
                                                "env": [{"name": "A", "value": "1"}],
                                            }
                                        ]
                                    }
                                }
                            },
                        },
                    },
                ],
            }
        },
    },
}
TRAINJOB: dict[str, Any] = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "TrainJob",
    "metadata": {"name": "fuzz"},
    "spec": {
        "runtimeRef": {"name": "torch"},
        "trainer": {
            "numNodes": 2,
            "command": ["torchrun", "t.py"],
            "env": [{"name": "B", "value": "2"}],
            "resourcesPerNode": {"requests": {"cpu": "1"}},
        },
        "initializer": {"dataset": {"storageUri": "hf://x"}},
        "runtimePatches": [
            {
                "manager": "m",
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [
                                {
                                    "name": "node",
                                    "template": {"spec": {"template": {"spec": {"nodeSelector": {"a": "b"}}}}},
                                }
                            ]
                        }
                    }
                },
            }
        ],
    },
}

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**40) | st.text(max_size=8) | st.floats(allow_nan=True),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def paths(node: Any, here: tuple = ()) -> list[tuple]:
    found = [here]
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*here, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += paths(value, (*here, i))
    return found


def replaced(document: dict[str, Any], path: tuple, value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(document)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.booleans(), pick=st.integers(0, 10_000), value=VALUES)
def test_any_malformed_value_is_loaded_or_refused_with_its_problems(which: bool, pick: int, value: Any) -> None:
    base = RUNTIME if which else TRAINJOB
    where = paths(base)[pick % len(paths(base))]
    document = replaced(base, where, value)
    runtime, trainjob = (document, TRAINJOB) if which else (RUNTIME, document)
    try:
        runtimes = (runtime_doc(runtime, "fuzz"),) if isinstance(runtime, dict) else ()
        if not isinstance(trainjob, dict):
            return  # not a mapping: the file reader refuses it before any converter sees it
        load_document(copy.deepcopy(trainjob), "fuzz", LoadOptions(runtime=RuntimeKind.HOST, runtimes=runtimes))
    except UserError as exc:
        assert exc.message
