"""Reading a job document: YAML or JSON, bounded, ours or Kubeflow/Volcano (converted).

The spec's part of loading a job; the whole chain (then validation with the framework's checks,
where each role runs, the framework's defaults) is :mod:`trainmaster.loading`, one floor up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from trainmaster.errors import UserError
from trainmaster.spec import boundedyaml
from trainmaster.spec.compat import RuntimeDoc, convert
from trainmaster.spec.model import Job, RuntimeKind
from trainmaster.spec.paths import PathPolicy

#: A job document is a few KB and a few levels deep; anything much deeper is not a job, and
#: would reach recursion limits in the layers below (JSON encoding, the store).
MAX_DOCUMENT_DEPTH = 32
MAX_DOCUMENT_BYTES = 1024 * 1024  # also the server's request body limit


@dataclass(frozen=True)
class LoadOptions:
    """How a job document is read: the operator's path rule, and whether unknown fields of a
    Kubeflow/Volcano file are errors (the default, as ``kubectl`` does) or listed and ignored.

    ``paths`` None leaves ``workingDir``/``output.path`` unchecked: for trusted library callers
    (tests, a controller embedded in a program). Every entry that reads jobs from someone else
    (the server, the CLI) passes its policy explicitly."""

    paths: PathPolicy | None = None
    lenient: bool = False
    # the operator's choice for roles with ``runtime: auto`` (``--runtime``); None: podman's presence
    runtime: RuntimeKind | None = None
    # the backend the job will run on (``--backend``, the server's); None: the job's own
    # ``spec.scheduling.backend``, else local. Where each role runs is settled for it.
    backend: str | None = None
    # Kubeflow Trainer v2 runtimes a TrainJob may name: those given with it (files, documents),
    # then, when none of those has the name, the installed ones (the store's, read on demand)
    runtimes: tuple[RuntimeDoc, ...] = ()
    installed_runtimes: Callable[[], list[RuntimeDoc]] | None = None


@dataclass
class LoadedJob:
    """A validated, defaulted job and what conversion could not carry over."""

    job: Job
    source: str
    ignored: list[str] = field(default_factory=list)  # fields with no local meaning, by path


def read_document(path: str | Path) -> dict[str, Any]:
    """The single YAML/JSON mapping in ``path``, or a :class:`UserError` that says what is wrong."""
    return _single(read_documents(path), str(path))


def read_documents(path: str | Path) -> list[dict[str, Any]]:
    """Every YAML/JSON mapping in ``path`` (a TrainJob and its runtimes may share a file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.stat().st_size > MAX_DOCUMENT_BYTES:
        raise UserError(f"{path}: {path.stat().st_size} bytes; a job document is at most {MAX_DOCUMENT_BYTES} bytes")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (expected a YAML or JSON job document)") from None
    return parse_documents(text, str(path))


def parse_document(text: str, source: str) -> dict[str, Any]:
    """The single YAML/JSON mapping in ``text`` (a file's or a pasted document's)."""
    return _single(parse_documents(text, source), source)


def _single(docs: list[dict[str, Any]], source: str) -> dict[str, Any]:
    if len(docs) != 1:
        raise UserError(f"{source}: expected exactly one job document, found {len(docs)}")
    return docs[0]


def parse_documents(text: str, source: str) -> list[dict[str, Any]]:
    """Every YAML/JSON mapping in ``text``, in order; a :class:`UserError` for anything else."""
    try:
        docs = [d for d in boundedyaml.load_all(text, source) if d is not None]
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: not valid YAML/JSON: {exc}") from None
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to be a job document") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise UserError(
                f"{source}: expected a job document (a mapping with apiVersion, kind, metadata "
                f"and spec), found a {type(doc).__name__}"
            )
    return docs


def document_depth(value: Any) -> int:
    """How deeply mappings and lists nest in ``value`` (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DOCUMENT_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


def unencodable_text(value: Any, path: str = "") -> list[str]:
    """Paths of strings (keys or values) that are not valid Unicode text: lone surrogates, which
    JSON can carry (``"\\ud800"``) but no file name, argument or environment variable can."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                found.append(where or "(document)")
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                stack.append((key, child_path))
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return sorted(set(found))


def plain_document(
    raw: dict[str, Any], source: str = "job", lenient: bool = False, runtimes: Any = ()
) -> tuple[dict[str, Any], list[str]]:
    """``raw`` as a ``trainmaster/v1 Job`` document (a Kubeflow/Volcano one converted) and the
    source fields conversion could not carry over; a :class:`UserError` for a document too deep,
    holding text no program can be given, or of a kind we do not read."""
    if document_depth(raw) > MAX_DOCUMENT_DEPTH:
        raise UserError(
            f"{source}: nested more than {MAX_DOCUMENT_DEPTH} levels deep; a job "
            "document is a few levels of mappings and lists"
        )
    bad_text = unencodable_text(raw)
    if bad_text:
        raise UserError(
            f"{source} is not a valid job ({len(bad_text)} problem(s))",
            [
                f"{where.encode('utf-8', 'backslashreplace').decode()}: contains a lone "
                "surrogate (e.g. \\ud800), which is not text a program can be given"
                for where in bad_text[:20]
            ],
        )
    converted = convert(raw, lenient=lenient, runtimes=runtimes)
    if converted is not None:
        return converted.document, converted.ignored
    if raw.get("apiVersion") not in (None, "trainmaster/v1") or raw.get("kind") not in (None, "Job"):
        raise UserError(
            f"{source}: unsupported document apiVersion={raw.get('apiVersion')!r} kind={raw.get('kind')!r}",
            [
                "expected trainmaster/v1 Job, a Kubeflow PyTorchJob/TFJob/MPIJob (kubeflow.org/v1; MPIJob also v2beta1) "
                "a Volcano Job (batch.volcano.sh/v1alpha1) or a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1)"
            ],
        )
    return raw, []


def dump_yaml(job: Job) -> str:
    return yaml.safe_dump(job.dump(), sort_keys=False)


def dump_json(job: Job) -> str:
    return json.dumps(job.dump(), indent=2)
