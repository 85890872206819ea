"""Kubernetes object metadata as our job metadata: name, labels and annotations carry over."""

from __future__ import annotations

from typing import Any

from trainmaster.spec.compat.ignored import Report

#: Every field of Kubernetes ObjectMeta.
OBJECT_META_FIELDS = {
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "ownerReferences",
    "finalizers",
    "managedFields",
    "selfLink",
}

#: The annotation naming the document a job was converted from.
SOURCE_ANNOTATION = "trainmaster.io/converted-from"


def metadata(value: Any, source: str, report: Report) -> dict[str, Any]:
    """Kubernetes object metadata: name, labels and annotations carry over."""
    meta = report.mapping(value, "metadata")
    report.rest(
        meta,
        "metadata",
        {"name", "labels", "annotations"},
        {
            "namespace": "there are no namespaces locally; job names are global",
            "generateName": "give the job a metadata.name",
        },
        OBJECT_META_FIELDS,
        "set by Kubernetes, no meaning locally",
    )
    out: dict[str, Any] = {"name": meta.get("name")}
    if meta.get("labels"):
        out["labels"] = meta["labels"]
    annotations = dict(report.mapping(meta.get("annotations"), "metadata.annotations"))
    annotations[SOURCE_ANNOTATION] = source
    out["annotations"] = annotations
    return out
