"""Mechanism: Kubeflow Trainer v2 in operator mode without a cluster (issue 34): the TrainJob's
status in the Trainer controller's shape (metav1 conditions ``Suspended``, ``Created``,
``Complete``/``Failed``; ``jobsStatus`` per replicated job), its CRDs and those of the runtimes it
names (``ClusterTrainingRuntime`` cluster-scoped), the RBAC that reads runtimes and writes
nothing of them, a missing runtime's message that says how to fix it on a cluster, and the
runtime read from a fake API (upstream's lookup: cluster-wide, or the TrainJob's namespace)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from trainmaster.errors import UserError
from trainmaster.loading import load_document
from trainmaster.operator import status as statuses
from trainmaster.operator import trainjob
from trainmaster.operator.kinds import CRD_KINDS, RUNTIME_KINDS, crd_manifest, kind_of
from trainmaster.operator.manifests import rbac_rules
from trainmaster.operator.operator import source_path, to_document
from trainmaster.spec.load import LoadOptions

TRAINJOB = kind_of("trainer.kubeflow.org/v1alpha1", "TrainJob")
METAV1 = {"type", "status", "reason", "message", "lastTransitionTime"}


def doc(state: str, counts: dict[str, int], reason: str = "", message: str = "") -> dict[str, Any]:
    return {
        "name": "tj",
        "state": state,
        "reason": reason,
        "message": message,
        "startedAt": None if state == "pending" else "2026-01-01T00:00:00+00:00",
        "roles": [{"name": "node", "replicas": 2, "state": state, "counts": counts}],
        "instances": [],
    }


def test_trainjob_conditions_and_jobs_status_are_the_trainers() -> None:
    suspended = trainjob.trainjob_status(doc("pending", {"pending": 2}, reason="Suspended"), None)
    assert [(c["type"], c["status"], c["reason"]) for c in suspended["conditions"]] == [
        ("Suspended", "True", "Suspended")
    ]
    assert suspended["jobsStatus"][0]["suspended"] == 2
    running = trainjob.trainjob_status(doc("running", {"running": 1, "starting": 1}), suspended)
    assert [(c["type"], c["status"], c["reason"]) for c in running["conditions"]] == [
        ("Suspended", "False", "Resumed"),
        ("Created", "True", "JobsCreationSucceeded"),
    ]
    assert running["jobsStatus"] == [
        {"name": "node", "active": 2, "ready": 1, "succeeded": 0, "failed": 0, "suspended": 0}
    ]
    done = trainjob.trainjob_status(doc("succeeded", {"succeeded": 2}), running)
    assert [c["type"] for c in done["conditions"]] == ["Suspended", "Created", "Complete"]
    complete = done["conditions"][-1]
    assert (complete["status"], complete["reason"]) == ("True", "AllJobsCompleted")
    assert all(set(c) == METAV1 for c in done["conditions"])
    created = [c for c in running["conditions"] if c["type"] == "Created"][0]
    assert done["conditions"][1]["lastTransitionTime"] == created["lastTransitionTime"]  # kept while it holds
    failed = trainjob.trainjob_status(
        doc("failed", {"failed": 1, "succeeded": 1}, "InstanceFailed", "node-1 exited 1"), None
    )
    last = failed["conditions"][-1]
    assert (last["type"], last["reason"]) == ("Failed", "FailedJobs") and "node-1 exited 1" in last["message"]
    assert TRAINJOB is not None and statuses.is_final(TRAINJOB, done) and statuses.is_final(TRAINJOB, failed)
    assert not statuses.is_final(TRAINJOB, running)


def test_jobs_status_names_the_runtimes_replicated_jobs() -> None:
    """Under the MPI policy the runtime's ``node`` job is the mpi framework's ``worker`` role."""
    status = doc("running", {"running": 2})
    status["roles"].append({"name": "launcher", "replicas": 1, "state": "running", "counts": {"running": 1}})
    status["roles"][0]["name"] = "worker"
    out = trainjob.trainjob_status(status, None, {"worker": "node"})
    assert [j["name"] for j in out["jobsStatus"]] == ["node", "launcher"]


def test_an_invalid_trainjob_fails_with_a_metav1_condition() -> None:
    assert TRAINJOB is not None
    status = statuses.invalid_status(TRAINJOB, "TrainJob default/x is not valid", ["spec.runtimeRef.name: no"], None)
    [failed] = status["conditions"]
    assert set(failed) == METAV1 and (failed["type"], failed["reason"]) == ("Failed", "InvalidSpec")


def test_the_trainer_crds_and_rbac() -> None:
    crds = {k.kind: crd_manifest(k) for k in CRD_KINDS}
    assert crds["TrainJob"]["spec"]["scope"] == "Namespaced"
    assert crds["TrainingRuntime"]["spec"]["scope"] == "Namespaced"
    assert crds["ClusterTrainingRuntime"]["spec"]["scope"] == "Cluster"
    for kind in ("TrainJob", "TrainingRuntime", "ClusterTrainingRuntime"):
        [version] = crds[kind]["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
        assert crds[kind]["spec"]["group"] == "trainer.kubeflow.org"
    verbs = {(g, r): set(rule["verbs"]) for rule in rbac_rules() for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs[("trainer.kubeflow.org", "trainjobs")] == {"get", "list", "watch"}
    assert verbs[("trainer.kubeflow.org", "trainjobs/status")] == {"get", "patch"}
    for kind in RUNTIME_KINDS:
        assert verbs[("trainer.kubeflow.org", kind.plural)] == {"get", "list"}
        assert ("trainer.kubeflow.org", f"{kind.plural}/status") not in verbs


RUNTIME = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "TrainingRuntime",
    "metadata": {
        "name": "tiny",
        "namespace": "team-a",
        "uid": "abc",
        "resourceVersion": "7",
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "managedFields": [{"manager": "kubectl"}],
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
    },
    "spec": {
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        "template": {
                            "spec": {
                                "template": {
                                    "spec": {"containers": [{"name": "node", "image": "x", "command": ["true"]}]}
                                }
                            }
                        },
                    }
                ]
            }
        }
    },
}


class FakeCustomObjects:
    """The two reads :func:`trainjob.cluster_runtimes` makes, over a dict of objects."""

    def __init__(self, objects: dict[tuple[str, str, str], dict[str, Any]]):
        self.objects = objects
        self.asked: list[tuple[str, str, str]] = []

    def _answer(self, key: tuple[str, str, str]) -> Any:
        from kubernetes.client.exceptions import ApiException

        self.asked.append(key)
        if key not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(data=json.dumps(self.objects[key]).encode())

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_: Any) -> Any:
        return self._answer((namespace, plural, name))

    def get_cluster_custom_object(self, group, version, plural, name, **_: Any) -> Any:
        return self._answer(("", plural, name))


def resource(runtime: str, kind: str | None = None) -> dict[str, Any]:
    ref = {"name": runtime, **({"kind": kind} if kind else {})}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "tj", "namespace": "team-a", "uid": "u1", "resourceVersion": "9"},
        "spec": {"runtimeRef": ref, "trainer": {"numNodes": 2}},
    }


def test_the_runtime_is_read_from_the_cluster_as_upstream_looks_it_up() -> None:
    pytest.importorskip("kubernetes")
    assert TRAINJOB is not None
    api = FakeCustomObjects({("team-a", "trainingruntimes", "tiny"): RUNTIME})
    obj = resource("tiny", "TrainingRuntime")
    runtimes = trainjob.cluster_runtimes(api, "team-a", obj)
    assert api.asked == [("team-a", "trainingruntimes", "tiny")]  # the TrainJob's namespace only
    [found] = runtimes
    assert found.document["metadata"] == {"name": "tiny"}  # what the API added is left out
    loaded = load_document(to_document(TRAINJOB, obj), "TrainJob team-a/tj", LoadOptions(runtimes=runtimes))
    assert [(r.name, r.replicas) for r in loaded.job.spec.roles] == [("node", 2)]
    # the default kind is cluster-wide: a namespaced runtime of that name is not it
    missing = resource("tiny")
    assert trainjob.cluster_runtimes(api, "team-a", missing) == ()
    assert api.asked[-1] == ("", "clustertrainingruntimes", "tiny")
    with pytest.raises(UserError) as refused:
        load_document(to_document(TRAINJOB, missing), "TrainJob team-a/tj", LoadOptions(runtimes=()))
    [problem] = [d for d in refused.value.details if d.startswith("spec.runtimeRef")]
    said = source_path(TRAINJOB, missing, problem)
    assert said.startswith("spec.runtimeRef.name: no ClusterTrainingRuntime named 'tiny' exists in the cluster")
    assert "kubectl apply -f runtime.yaml" in said
