"""Reading a job file: YAML or JSON, ours or Kubeflow/Volcano (converted), validated, defaulted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainmaster.errors import UserError
from trainmaster.spec.model import Job
from trainmaster.spec.validate import validate


@dataclass
class LoadedJob:
    """A validated, defaulted job and what conversion could not carry over."""

    job: Job
    source: str
    ignored: list[str] = field(default_factory=list)  # fields with no local meaning, by path


def read_document(path: str | Path) -> dict[str, Any]:
    """The single YAML/JSON mapping in ``path``, or a :class:`UserError` that says what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (expected a YAML or JSON job document)") from None
    return parse_document(text, str(path))


def parse_document(text: str, source: str) -> dict[str, Any]:
    """The single YAML/JSON mapping in ``text`` (a file's or a pasted document's)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: not valid YAML/JSON: {exc}") from None
    if len(docs) != 1:
        raise UserError(f"{source}: expected exactly one job document, found {len(docs)}")
    if not isinstance(docs[0], dict):
        raise UserError(f"{source}: expected a job document (a mapping with apiVersion, kind, metadata "
                        f"and spec), found a {type(docs[0]).__name__}")
    return docs[0]


def load_job(path: str | Path) -> LoadedJob:
    """Load, convert (Kubeflow/Volcano), validate and default a job file."""
    return load_document(read_document(path), source=str(path))


def load_document(raw: dict[str, Any], source: str = "job") -> LoadedJob:
    from trainmaster.frameworks import apply_defaults
    from trainmaster.spec.compat import convert

    ignored: list[str] = []
    converted = convert(raw)
    if converted is not None:
        raw, ignored = converted.document, converted.ignored
    elif raw.get("apiVersion") not in (None, "trainmaster/v1") or raw.get("kind") not in (None, "Job"):
        raise UserError(
            f"{source}: unsupported document apiVersion={raw.get('apiVersion')!r} kind={raw.get('kind')!r}",
            ["expected trainmaster/v1 Job, a Kubeflow PyTorchJob/TFJob/MPIJob (kubeflow.org/v1; MPIJob also v2beta1) "
             "or a Volcano Job (batch.volcano.sh/v1alpha1)"],
        )
    job = validate(raw, source)
    return LoadedJob(job=apply_defaults(job), source=source, ignored=ignored)


def dump_yaml(job: Job) -> str:
    return yaml.safe_dump(job.dump(), sort_keys=False)


def dump_json(job: Job) -> str:
    return json.dumps(job.dump(), indent=2)
