"""Mechanisms: queue and priority of foreign files: Volcano's ``spec.queue`` and
``priorityClassName``, Kueue's ``kueue.x-k8s.io/queue-name`` and ``kueue.x-k8s.io/priority-class``
labels, and the pods' ``priorityClassName`` (as Kueue reads it) become our scheduling queue and
priority class; Kubernetes priority class names map onto ours or are refused with the names
accepted."""

from __future__ import annotations

from typing import Any

import pytest

from trainmaster.errors import UserError
from trainmaster.loading import load_document


def pytorchjob(
    labels: dict[str, str] | None = None, pod_priority: str | None = None, policy: dict[str, Any] | None = None
) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [{"name": "pytorch", "image": "python:3.11", "command": ["true"]}]}
    if pod_priority:
        pod["priorityClassName"] = pod_priority
    spec: dict[str, Any] = {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": pod}}}}
    if policy:
        spec["runPolicy"] = {"schedulingPolicy": policy}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "pt", "labels": labels or {}},
        "spec": spec,
    }


def vcjob(labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    task = {
        "name": "w",
        "replicas": 1,
        "template": {"spec": {"containers": [{"name": "w", "image": "busybox", "command": ["true"]}]}},
    }
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "vc", "labels": labels or {}},
        "spec": {"tasks": [task], **spec},
    }


def scheduling(doc: dict[str, Any]) -> tuple[str, str, list[str]]:
    loaded = load_document(doc)
    return loaded.job.spec.scheduling.queue, loaded.job.spec.scheduling.priority_class, loaded.ignored


def test_volcano_queue_and_priority_class_name_carry_over() -> None:
    """Volcano's spec.queue is our queue; its priorityClassName our priority class."""
    queue, priority, _ = scheduling(vcjob(queue="research", priorityClassName="high"))
    assert (queue, priority) == ("research", "high")


def test_kueue_queue_name_label_names_the_queue() -> None:
    """Kueue's kueue.x-k8s.io/queue-name label names the queue of a Kubeflow or Volcano job
    that does not name one itself; the job's own field wins, with a note."""
    assert scheduling(pytorchjob({"kueue.x-k8s.io/queue-name": "team-a"}))[0] == "team-a"
    assert scheduling(vcjob({"kueue.x-k8s.io/queue-name": "team-a"}))[0] == "team-a"
    queue, _, notes = scheduling(vcjob({"kueue.x-k8s.io/queue-name": "team-a"}, queue="research"))
    assert queue == "research"
    assert any("kueue.x-k8s.io/queue-name: the job's own queue 'research' applies" in n for n in notes)


def test_pod_priority_class_and_kueue_priority_label_give_the_priority() -> None:
    """Priority as Kueue reads it: the kueue.x-k8s.io/priority-class label, else the highest of
    the pods' priorityClassName; the job's own priority class first."""
    assert scheduling(pytorchjob(pod_priority="high"))[1] == "high"
    labelled = pytorchjob({"kueue.x-k8s.io/priority-class": "critical"}, pod_priority="low")
    assert scheduling(labelled)[1] == "critical"
    own = pytorchjob({"kueue.x-k8s.io/priority-class": "critical"}, pod_priority="low", policy={"priorityClass": "low"})
    assert scheduling(own)[1] == "low"


def test_kubernetes_priority_class_names_map_onto_ours() -> None:
    """Priority class names: ours as they are, system-*-critical as critical, a name with one of
    our words (high-priority) as that class with a note; any other refused with its path."""
    _, priority, notes = scheduling(vcjob(priorityClassName="high-priority"))
    assert priority == "high" and any("'high-priority' is taken as our 'high'" in n for n in notes)
    assert scheduling(vcjob(priorityClassName="system-cluster-critical"))[1] == "critical"
    with pytest.raises(UserError) as refused:
        scheduling(vcjob(priorityClassName="gold"))
    assert any(
        "spec.priorityClassName: priority class 'gold' has no counterpart here" in d for d in refused.value.details
    )
    with pytest.raises(UserError) as ambiguous:
        scheduling(pytorchjob(pod_priority="low-high"))
    assert any("pytorchReplicaSpecs.Master.template.spec.priorityClassName" in d for d in ambiguous.value.details)
