"""Queue and priority of a foreign job: Kueue's labels, Volcano's queue and Kubernetes priority classes.

A Kueue-managed job names its LocalQueue with the label ``kueue.x-k8s.io/queue-name`` and may
name a WorkloadPriorityClass with ``kueue.x-k8s.io/priority-class``; without it, Kueue takes the
pods' ``priorityClassName``. Volcano names its queue in ``spec.queue`` and its priority in
``spec.priorityClassName``; Kubeflow in ``runPolicy.schedulingPolicy``. All of them become our
``scheduling.queue`` and ``scheduling.priorityClass`` (the queue's quota, if it has one, then
applies: :mod:`trainmaster.controller.quota`).

Kubernetes priority classes are cluster objects with any name; ours are four (``low``,
``normal``, ``high``, ``critical``). A name that is one of ours is taken as is; the built-in
``system-*-critical`` classes are ``critical``; a name with exactly one of our words in it
(``high-priority``, ``batch-low``) is taken as that class, with a note; any other is refused
with the accepted names, rather than guessed.
"""

from __future__ import annotations

from typing import Any

from trainmaster.spec.compat.ignored import Report
from trainmaster.spec.model import PRIORITY_CLASSES

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
SYSTEM_CLASSES = {"system-cluster-critical": "critical", "system-node-critical": "critical"}
WORDS = {
    "low": "low",
    "normal": "normal",
    "default": "normal",
    "medium": "normal",
    "high": "high",
    "critical": "critical",
}


def priority_class(name: Any, path: str, report: Report) -> str | None:
    """A Kubernetes priority class name as one of ours (None, with the problem reported, when none fits)."""
    if not isinstance(name, str) or not name:
        report.invalid(path, f"{str(name)[:40]!r} must be a priority class name")
        return None
    if name in PRIORITY_CLASSES:
        return name
    if name in SYSTEM_CLASSES:
        report.approximate(path, f"Kubernetes' {name} is our '{SYSTEM_CLASSES[name]}' priority class")
        return SYSTEM_CLASSES[name]
    found = {WORDS[w] for w in name.lower().replace("_", "-").split("-") if w in WORDS}
    if len(found) == 1:
        (ours,) = found
        report.approximate(path, f"priority class '{name}' is taken as our '{ours}' ({PRIORITY_CLASSES[ours]})")
        return ours
    report.invalid(
        path,
        f"priority class '{name[:63]}' has no counterpart here: use one of {', '.join(PRIORITY_CLASSES)} "
        "(or a name containing one of those words, such as high-priority)",
    )
    return None


def apply(
    raw_metadata: Any,
    scheduling: dict[str, Any],
    priority_path: str,
    pod_priorities: list[tuple[str, Any]],
    report: Report,
) -> None:
    """Fill ``scheduling`` (queue, priorityClass) from Kueue's labels and the pods' priority
    classes where the job's own fields leave them unset; map priority class names to ours.

    ``priority_path``: where the job's own priority class is written (for messages);
    ``pod_priorities``: (path, priorityClassName) of each pod template that names one; Kueue
    takes the highest of them as the workload's priority."""
    labels = raw_metadata.get("labels") if isinstance(raw_metadata, dict) else None
    labels = labels if isinstance(labels, dict) else {}
    queue = labels.get(QUEUE_LABEL)
    if queue is not None:
        where = f"metadata.labels.{QUEUE_LABEL}"
        if "queue" not in scheduling:
            scheduling["queue"] = queue if isinstance(queue, str) else str(queue)
        elif scheduling["queue"] != queue:
            report.ignore(where, f"the job's own queue '{scheduling['queue']}' applies")
    if "priorityClass" in scheduling:
        mapped = priority_class(scheduling["priorityClass"], priority_path, report)
        if mapped is not None:
            scheduling["priorityClass"] = mapped
        return
    if PRIORITY_LABEL in labels:
        mapped = priority_class(labels[PRIORITY_LABEL], f"metadata.labels.{PRIORITY_LABEL}", report)
        if mapped is not None:
            scheduling["priorityClass"] = mapped
        return
    mapped_pods = [m for path, name in pod_priorities if (m := priority_class(name, path, report)) is not None]
    if mapped_pods:
        scheduling["priorityClass"] = max(mapped_pods, key=lambda c: PRIORITY_CLASSES[c])
