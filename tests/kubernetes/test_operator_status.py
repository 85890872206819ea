"""Mechanism: operator mode's status write-back, in the shape of each upstream operator (controller
spec, 'Our product decisions': an operator mode whose status is written back), and the CRDs and
RBAC it ships. Pure functions: no cluster."""

from __future__ import annotations

from trainmaster.operator import status as statuses
from trainmaster.operator.kinds import CRD_KINDS, crd_manifest, kind_of
from trainmaster.operator.manifests import ManifestOptions, operator_manifests, rbac_rules
from trainmaster.operator.operator import replica_types, source_path, to_document

PYTORCH = kind_of("kubeflow.org/v1", "PyTorchJob")


def doc(state: str, roles: dict[str, dict[str, int]], restarts: int = 0, **extra) -> dict:
    return {
        "name": "job",
        "state": state,
        "reason": extra.get("reason", ""),
        "message": extra.get("message", ""),
        "startedAt": "2026-01-01T00:00:00+00:00",
        "runningAt": "2026-01-01T00:00:01+00:00" if state in ("running", "succeeded", "failed") else None,
        "completedAt": "2026-01-01T00:01:00+00:00" if state in ("succeeded", "failed") else None,
        "roles": [{"name": n, "replicas": sum(c.values()), "state": state, "counts": c} for n, c in roles.items()],
        "instances": [{"state": "pending", "restarts": restarts}] if restarts else [],
    }


def test_kubeflow_conditions_follow_the_job_and_keep_their_transition_times() -> None:
    assert PYTORCH is not None
    running = statuses.kubeflow_status(
        PYTORCH, "job", doc("running", {"master": {"running": 1}, "worker": {"running": 2}}), ["Master", "Worker"], None
    )
    assert [(c["type"], c["status"]) for c in running["conditions"]] == [("Created", "True"), ("Running", "True")]
    assert running["replicaStatuses"]["Worker"] == {"active": 2, "succeeded": 0, "failed": 0}
    assert running["conditions"][1]["reason"] == "PyTorchJobRunning"
    again = statuses.kubeflow_status(
        PYTORCH,
        "job",
        doc("running", {"master": {"running": 1}, "worker": {"running": 2}}),
        ["Master", "Worker"],
        running,
    )
    assert again == running  # unchanged: nothing to write
    done = statuses.kubeflow_status(
        PYTORCH,
        "job",
        doc("succeeded", {"master": {"succeeded": 1}, "worker": {"succeeded": 2}}),
        ["Master", "Worker"],
        running,
    )
    assert [(c["type"], c["status"]) for c in done["conditions"]] == [
        ("Created", "True"),
        ("Running", "False"),
        ("Succeeded", "True"),
    ]
    assert done["conditions"][0]["lastTransitionTime"] == running["conditions"][0]["lastTransitionTime"]
    assert done["completionTime"] == "2026-01-01T00:01:00Z"
    restarting = statuses.kubeflow_status(
        PYTORCH, "job", doc("running", {"master": {"running": 1}}, restarts=1), ["Master"], None
    )
    assert "Restarting" in [c["type"] for c in restarting["conditions"]]
    failed = statuses.kubeflow_status(
        PYTORCH,
        "job",
        doc("failed", {"master": {"failed": 1}}, reason="BackoffLimitExceeded", message="m"),
        ["Master"],
        None,
    )
    assert (
        failed["conditions"][-1]["type"] == "Failed"
        and failed["conditions"][-1]["reason"] == "PyTorchJobBackoffLimitExceeded"
    )
    assert (
        statuses.is_final(PYTORCH, done)
        and statuses.is_final(PYTORCH, failed)
        and not statuses.is_final(PYTORCH, running)
    )


def test_volcano_phase_and_counts() -> None:
    volcano = kind_of("batch.volcano.sh/v1alpha1", "Job")
    assert volcano is not None
    status = statuses.volcano_status(
        doc("running", {"server": {"running": 1}, "client": {"running": 1, "pending": 1}}), 3, None
    )
    assert status["state"]["phase"] == "Running" and (status["running"], status["pending"]) == (2, 1)
    assert status["minAvailable"] == 3 and status["taskStatusCount"]["client"]["phase"] == {"Running": 1, "Pending": 1}
    done = statuses.volcano_status(doc("succeeded", {"server": {"succeeded": 1}}), 3, status)
    assert done["state"]["phase"] == "Completed" and statuses.is_final(volcano, done)
    assert statuses.volcano_status(doc("cancelled", {}), 1, None)["state"]["phase"] == "Aborted"


def test_an_invalid_resource_fails_with_every_field_path() -> None:
    assert PYTORCH is not None
    status = statuses.invalid_status(
        PYTORCH,
        "PyTorchJob default/x is not a valid job",
        ["spec.pytorchReplicaSpecs.Worker.replicas: must be an integer"],
        None,
    )
    [failed] = status["conditions"]
    assert (failed["type"], failed["status"], failed["reason"]) == ("Failed", "True", "InvalidSpec")
    assert "spec.pytorchReplicaSpecs.Worker.replicas" in failed["message"]


def test_a_resource_becomes_the_job_document_its_user_wrote() -> None:
    ours = kind_of("trainmaster.io/v1", "TrainingJob")
    assert ours is not None
    obj = {
        "apiVersion": "trainmaster.io/v1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "j",
            "namespace": "team",
            "uid": "u",
            "resourceVersion": "7",
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "mine": "x"},
        },
        "spec": {"roles": []},
        "status": {"state": "running"},
    }
    assert to_document(ours, obj) == {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "j", "annotations": {"mine": "x"}},
        "spec": {"roles": []},
    }
    assert replica_types({"spec": {"mpiReplicaSpecs": {"Launcher": {}, "Worker": {}}}}) == ["Launcher", "Worker"]


def test_crds_are_structural_with_the_status_subresource() -> None:
    for kind in CRD_KINDS:
        crd = crd_manifest(kind)
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        versions = crd["spec"]["versions"]
        assert [v["storage"] for v in versions].count(True) == 1
        for version in versions:
            assert version["subresources"] == {"status": {}}
            schema = version["schema"]["openAPIV3Schema"]
            assert schema["type"] == "object" and schema["properties"]["spec"]["x-kubernetes-preserve-unknown-fields"]


def test_the_operators_rbac_is_least_privilege() -> None:
    """It reads its resources and patches their status only; pods are all it creates and
    deletes; services it creates; nodes it reads; no secret, no CRD, nothing cluster-wide else
    (in its own namespace: its Lease and the one Secret it keeps, the instance channel's key)."""
    rules = rbac_rules()
    verbs = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs[("kubeflow.org", "pytorchjobs")] == {"get", "list", "watch"}
    assert verbs[("kubeflow.org", "pytorchjobs/status")] == {"get", "patch"}
    assert verbs[("", "pods")] == {"get", "list", "watch", "create", "delete"}
    assert verbs[("", "services")] == {"get", "create"}
    assert verbs[("", "nodes")] == {"get", "list", "watch"}
    assert not any(r in ("secrets", "customresourcedefinitions", "*") for _, r in verbs)
    assert not any("*" in v for v in verbs.values())
    manifests = operator_manifests(ManifestOptions(api_address="172.16.0.1:6443"))
    kinds = [m["kind"] for m in manifests]
    assert kinds.count("CustomResourceDefinition") == len(CRD_KINDS)
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--no-install-crds" in container["command"]
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "172.16.0.1"} in container["env"]
    lease_role = next(m for m in manifests if m["kind"] == "Role")
    # in its own namespace only: its Lease, and the Secret of the instance channel's key
    assert lease_role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    ]


def test_a_problem_is_named_by_the_field_the_user_wrote() -> None:
    assert PYTORCH is not None
    obj = {"spec": {"pytorchReplicaSpecs": {"Master": {}, "Worker": {}}}}
    assert source_path(PYTORCH, obj, "spec.roles[1].replicas: must be an integer") == (
        "spec.pytorchReplicaSpecs.Worker.replicas: must be an integer (spec.roles[1].replicas once converted)"
    )
    volcano = kind_of("batch.volcano.sh/v1alpha1", "Job")
    assert volcano is not None
    assert source_path(volcano, {"spec": {"tasks": [{}, {}]}}, "spec.roles[0].replicas: must be > 0").startswith(
        "spec.tasks[0].replicas: must be > 0"
    )
    assert source_path(PYTORCH, obj, "spec.scheduling.minAvailable: too big") == "spec.scheduling.minAvailable: too big"
