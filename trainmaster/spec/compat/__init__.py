"""Converters from Kubernetes-world job files (Kubeflow, Volcano) to our job description."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Converted:
    """A document rewritten as ``trainmaster/v1 Job`` and the source fields it could not use."""

    document: dict[str, Any]
    ignored: list[str] = field(default_factory=list)


def convert(raw: dict[str, Any]) -> Converted | None:
    """Convert a foreign job document, or return None when it is not one we recognise."""
    return None
