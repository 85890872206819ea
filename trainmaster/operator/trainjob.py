"""Kubeflow Trainer v2 on the operator: a ``TrainJob`` applied with kubectl runs, its runtime is
read from the cluster, and its status is written as the Trainer's controller writes it.

- **Runtime lookup**, as upstream: ``spec.runtimeRef`` names a ``ClusterTrainingRuntime``
  (the default kind; cluster-scoped) or a ``TrainingRuntime`` of the TrainJob's own namespace.
  It is read through the API when the TrainJob is taken up (:func:`cluster_runtimes`), then
  resolved and read strictly by the same reader as ``trainmaster job run trainjob.yaml
  runtime.yaml`` (:mod:`trainmaster.spec.compat.trainer`). A runtime that is not there leaves the
  TrainJob Failed with ``spec.runtimeRef.name`` named; a malformed one, Failed with its own fields
  named. The runtime is read once: a later change of it does not change a running TrainJob
  (upstream builds the JobSet once too).
- **Status** (:func:`trainjob_status`): ``conditions`` of ``metav1.Condition`` shape (type,
  status, reason, message, lastTransitionTime): ``Suspended`` (True, reason ``Suspended``, while
  ``spec.suspend``; False, ``Resumed`` after), ``Created`` (True, ``JobsCreationSucceeded``, once
  its pods are made), ``Complete`` (``AllJobsCompleted``) or ``Failed`` (``FailedJobs``, with our
  reason and message); and ``jobsStatus``: per replicated job, ``active``, ``ready``,
  ``succeeded``, ``failed``, ``suspended``. Upstream counts child Jobs (``replicas`` of a
  replicated job, each of ``parallelism`` pods); here a role's instances are counted, which is
  the same wherever ``parallelism`` is 1 (every runtime the Trainer ships).
- **Pods** carry JobSet's labels (``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``,
  ``job-index``), so upstream's ``kubectl logs -l jobset.sigs.k8s.io/jobset-name=<trainjob>``
  works.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Any, Callable

from trainmaster.backends.kubernetes import api_client, default_kubeconfig
from trainmaster.operator.kinds import RUNTIME_KINDS
from trainmaster.spec.compat.trainer import RuntimeDoc

KUBECTL_ANNOTATION = "kubectl.kubernetes.io/last-applied-configuration"
JOBSET_LABELS = (
    "jobset.sigs.k8s.io/jobset-name",
    "jobset.sigs.k8s.io/replicatedjob-name",
    "jobset.sigs.k8s.io/job-index",
)
ENDED = ("succeeded", "failed", "cancelled")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def runtime_ref(obj: dict[str, Any]) -> tuple[str, str] | None:
    """The ``(kind, name)`` a TrainJob resource names, read leniently (the reader judges it)."""
    spec = obj.get("spec")
    ref = spec.get("runtimeRef") if isinstance(spec, dict) else None
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
        return None
    kind = ref.get("kind", "ClusterTrainingRuntime")
    return (kind, ref["name"]) if isinstance(kind, str) else None


def runtime_document(obj: dict[str, Any]) -> dict[str, Any]:
    """A runtime object as its user wrote it (what the API adds is left out)."""
    meta = obj.get("metadata") or {}
    metadata: dict[str, Any] = {"name": meta.get("name")}
    if meta.get("labels"):
        metadata["labels"] = meta["labels"]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != KUBECTL_ANNOTATION}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": metadata, "spec": obj.get("spec")}


def cluster_runtimes(custom: Any, namespace: str, obj: dict[str, Any]) -> tuple[RuntimeDoc, ...]:
    """The runtime the TrainJob ``obj`` names, read from the cluster: a ``ClusterTrainingRuntime``,
    or a ``TrainingRuntime`` of ``namespace``; () when there is none (the reader then says that
    ``spec.runtimeRef.name`` names nothing). ``custom``: a ``CustomObjectsApi``."""
    from kubernetes.client.exceptions import ApiException

    ref = runtime_ref(obj)
    kinds = {k.kind: k for k in RUNTIME_KINDS}
    if ref is None or ref[0] not in kinds:
        return ()
    kind = kinds[ref[0]]
    try:
        if kind.scope == "Cluster":
            answer = custom.get_cluster_custom_object(
                kind.group, kind.storage_version, kind.plural, ref[1], _preload_content=False
            )
            where = f"the cluster's {kind.kind}/{ref[1]}"
        else:
            answer = custom.get_namespaced_custom_object(
                kind.group, kind.storage_version, namespace, kind.plural, ref[1], _preload_content=False
            )
            where = f"the {kind.kind} {namespace}/{ref[1]}"
    except ApiException as exc:
        if exc.status == 404:
            return ()
        raise
    found = json.loads(answer.data)
    return (RuntimeDoc(kind=kind.kind, name=ref[1], document=runtime_document(found), source=where),)


def pod_labels(trainjob: str, role: str, index: int) -> dict[str, str]:
    """JobSet's labels on a TrainJob's pod (one child Job per instance here: its index is the job's)."""
    return dict(zip(JOBSET_LABELS, (trainjob, role, str(index))))


def _condition(old: dict[str, Any] | None, type_: str, holds: bool, reason: str, message: str) -> dict[str, Any]:
    """A ``metav1.Condition`` that keeps its ``lastTransitionTime`` while its status stays."""
    status = "True" if holds else "False"
    before: dict[str, Any] = next((c for c in (old or {}).get("conditions") or [] if c.get("type") == type_), {})
    changed = before.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": _now() if changed else before.get("lastTransitionTime", _now()),
    }


def replicated_job_names(job: Any) -> dict[str, str]:
    """The roles of a converted TrainJob named otherwise than its replicated jobs: under the MPI
    policy the ``node`` job is the mpi framework's ``worker`` role (its rank hosts)."""
    roles = {r.name for r in job.spec.roles}
    return {"worker": "node"} if job.spec.framework == "mpi" and "worker" in roles and "node" not in roles else {}


def _jobs_status(status: dict[str, Any], names: dict[str, str]) -> list[dict[str, int | str]]:
    ended = status["state"] in ENDED
    suspended = status.get("reason") == "Suspended"
    out: list[dict[str, int | str]] = []
    for role in status.get("roles", []):
        counts = {k: int(v) for k, v in (role.get("counts") or {}).items()}
        running = counts.get("running", 0)
        out.append(
            {
                "name": names.get(role["name"], role["name"]),
                "active": 0 if ended else running + counts.get("starting", 0),
                "ready": 0 if ended else running,
                "succeeded": counts.get("succeeded", 0),
                "failed": counts.get("failed", 0),
                "suspended": int(role.get("replicas") or 0) if suspended else 0,
            }
        )
    return out


def trainjob_status(
    status: dict[str, Any], old: dict[str, Any] | None, names: dict[str, str] | None = None
) -> dict[str, Any]:
    """The TrainJob's ``.status`` from the controller's status document of its job (suspended:
    pending for ``spec.suspend``, which the reader carries as ``runPolicy.suspend``); ``names``:
    :func:`replicated_job_names`."""
    state = status["state"]
    suspend = state == "pending" and status.get("reason") == "Suspended"
    conditions: list[dict[str, Any]] = []
    was_suspended = any(
        c.get("type") == "Suspended" and c.get("status") == "True" for c in (old or {}).get("conditions") or []
    )
    if suspend:
        conditions.append(_condition(old, "Suspended", True, "Suspended", "TrainJob is suspended"))
    elif was_suspended or any(c.get("type") == "Suspended" for c in (old or {}).get("conditions") or []):
        conditions.append(_condition(old, "Suspended", False, "Resumed", "TrainJob is resumed"))
    created = status.get("startedAt") is not None or state in ("running", *ENDED)
    if created:
        conditions.append(_condition(old, "Created", True, "JobsCreationSucceeded", "Succeeded to create Jobs"))
    if state == "succeeded":
        conditions.append(_condition(old, "Complete", True, "AllJobsCompleted", "jobset completed successfully"))
    elif state in ("failed", "cancelled"):
        reason = status.get("reason") or "Failed"
        message = status.get("message") or reason
        conditions.append(_condition(old, "Failed", True, "FailedJobs", f"{reason}: {message}"))
    return {"conditions": conditions, "jobsStatus": _jobs_status(status, names or {})}


def problem_text(obj: dict[str, Any], problem: str) -> str:
    """A problem of a TrainJob resource as its user can act on it in a cluster: a runtime that
    is not there is applied with kubectl, not given as a file or installed in a store."""
    if not problem.startswith("spec.runtimeRef.name: no "):
        return problem
    ref = runtime_ref(obj)
    namespace = (obj.get("metadata") or {}).get("namespace") or "default"
    head = problem.partition(" was given or is installed")[0]
    if ref is None:
        return problem
    where = "in the cluster" if ref[0] == "ClusterTrainingRuntime" else f"in the namespace {namespace}"
    return (
        f"{head} exists {where}; apply it (`kubectl apply -f runtime.yaml`"
        + (f" -n {namespace}" if ref[0] == "TrainingRuntime" else "")
        + ") or name one that exists (`kubectl get clustertrainingruntimes,trainingruntimes -A`)"
    )


def cluster_reader(namespace: str | None = None) -> Callable[[], list[RuntimeDoc]]:
    """A reader of the runtimes of the cluster ``--backend kubernetes`` uses (its kubeconfig, as
    :func:`~trainmaster.backends.kubernetes.default_kubeconfig` finds it): every
    ClusterTrainingRuntime and the TrainingRuntimes of ``namespace`` (default
    ``$TRAINMASTER_K8S_NAMESPACE``, else ``default``), for ``job run --backend kubernetes
    trainjob.yaml``. Read only when a TrainJob names a runtime it was not given; a cluster
    without the runtimes' CRDs has none."""

    def read() -> list[RuntimeDoc]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        custom: Any = client.CustomObjectsApi(api_client(default_kubeconfig()))
        ns = namespace or os.environ.get("TRAINMASTER_K8S_NAMESPACE") or "default"
        found: list[RuntimeDoc] = []
        for kind in RUNTIME_KINDS:
            try:
                if kind.scope == "Cluster":
                    answer = custom.list_cluster_custom_object(
                        kind.group, kind.storage_version, kind.plural, _preload_content=False
                    )
                else:
                    answer = custom.list_namespaced_custom_object(
                        kind.group, kind.storage_version, ns, kind.plural, _preload_content=False
                    )
            except ApiException as exc:
                if exc.status == 404:  # the CRD is not installed: no runtime of that kind
                    continue
                raise
            for item in json.loads(answer.data).get("items") or []:
                name = str((item.get("metadata") or {}).get("name") or "")
                where = (
                    f"the cluster's {kind.kind}/{name}" if kind.scope == "Cluster" else f"the {kind.kind} {ns}/{name}"
                )
                found.append(RuntimeDoc(kind=kind.kind, name=name, document=runtime_document(item), source=where))
        return found

    return read
