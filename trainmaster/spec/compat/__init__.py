"""Converters from Kubernetes-world job files (Kubeflow, Volcano) to our job description.

:func:`convert` recognises a document by its ``apiVersion`` group and hands it to the module
for that source (:mod:`.kubeflow`, :mod:`.volcano`). A converter only restructures: the result
is a plain ``trainmaster/v1 Job`` document (camelCase, as a user writes it) that goes through the
normal validation, so a wrong value is reported with its path in our job. Source fields with no
local meaning are listed in :attr:`Converted.ignored` with the reason, never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from trainmaster.spec.compat import kubeflow, trainer, volcano
from trainmaster.spec.compat.trainer import RuntimeDoc


@dataclass
class Converted:
    """A document rewritten as ``trainmaster/v1 Job`` and the source fields it could not use."""

    document: dict[str, Any]
    ignored: list[str] = field(default_factory=list)  # "source.path: reason"


def source_kind(raw: dict[str, Any]) -> str | None:
    """``"trainer"`` (Kubeflow Trainer v2), ``"kubeflow"``, ``"volcano"`` or None (ours, or
    something we do not know)."""
    group = str(raw.get("apiVersion") or "").partition("/")[0]
    if group == trainer.GROUP:
        return "trainer"
    if group == "kubeflow.org" or group.endswith(".kubeflow.org"):
        return "kubeflow"
    if group == "batch.volcano.sh":
        return "volcano"
    return None


def convert(raw: dict[str, Any], lenient: bool = False, runtimes: Iterable[RuntimeDoc] = ()) -> Converted | None:
    """Convert a foreign job document, or return None when it is not one we recognise.

    Raises :class:`~trainmaster.errors.UserError` for a kind of a known source that we cannot convert (a Kubeflow
    ``XGBoostJob``), or for a document whose structure is broken (a list where a mapping goes).
    ``runtimes``: the Trainer v2 runtimes a ``TrainJob`` may name (given files first, then installed).
    """
    if not isinstance(raw, dict):
        return None
    source = source_kind(raw)
    if source == "trainer":
        document, ignored = trainer.convert(raw, runtimes, lenient)
    elif source == "kubeflow":
        document, ignored = kubeflow.convert(raw, lenient)
    elif source == "volcano":
        document, ignored = volcano.convert(raw, lenient)
    else:
        return None
    return Converted(document=document, ignored=ignored)


__all__ = ["Converted", "RuntimeDoc", "convert", "source_kind"]
