"""Reading a job file: YAML or JSON, ours or Kubeflow/Volcano (converted), validated, defaulted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainmaster.errors import UserError
from trainmaster.spec.model import Job, RuntimeKind
from trainmaster.spec.paths import PathPolicy, anchored
from trainmaster.spec.validate import validate

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
    if path.stat().st_size > MAX_DOCUMENT_BYTES:
        raise UserError(f"{path}: {path.stat().st_size} bytes; a job document is at most {MAX_DOCUMENT_BYTES} bytes")
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
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to be a job document") from None
    if len(docs) != 1:
        raise UserError(f"{source}: expected exactly one job document, found {len(docs)}")
    if not isinstance(docs[0], dict):
        raise UserError(
            f"{source}: expected a job document (a mapping with apiVersion, kind, metadata "
            f"and spec), found a {type(docs[0]).__name__}"
        )
    return docs[0]


def load_job(path: str | Path, options: LoadOptions | None = None) -> LoadedJob:
    """Load, convert (Kubeflow/Volcano), validate and default a job file."""
    return load_document(read_document(path), source=str(path), options=options)


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


def load_document(raw: dict[str, Any], source: str = "job", options: LoadOptions | None = None) -> LoadedJob:
    """Convert (Kubeflow/Volcano), validate and default one job document."""
    from trainmaster.containers.policy import host_file_reads, pin_auto_roles
    from trainmaster.frameworks import apply_defaults
    from trainmaster.spec.compat import convert

    options = options or LoadOptions()
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
    ignored: list[str] = []
    converted = convert(raw, lenient=options.lenient)
    if converted is not None:
        raw, ignored = converted.document, converted.ignored
    elif raw.get("apiVersion") not in (None, "trainmaster/v1") or raw.get("kind") not in (None, "Job"):
        raise UserError(
            f"{source}: unsupported document apiVersion={raw.get('apiVersion')!r} kind={raw.get('kind')!r}",
            [
                "expected trainmaster/v1 Job, a Kubeflow PyTorchJob/TFJob/MPIJob (kubeflow.org/v1; MPIJob also v2beta1) "
                "or a Volcano Job (batch.volcano.sh/v1alpha1)"
            ],
        )
    job = validate(raw, source, paths=options.paths)
    job = pin_auto_roles(job, options.runtime)
    host_files = host_file_reads(job)  # a container's fixed files, read on the host
    if host_files and not options.lenient:
        raise UserError(
            f"{source}: a command reads files that exist only in its container; run it in one (--runtime "
            "container), read $VC_HOSTS_DIR instead, or pass --lenient to run it as it is",
            host_files,
        )
    ignored += [f"{line} (--lenient: run as it is)" for line in host_files]
    job = apply_defaults(job)
    if options.paths is not None:
        job = anchored(job, options.paths)
    return LoadedJob(job=job, source=source, ignored=ignored)


def dump_yaml(job: Job) -> str:
    return yaml.safe_dump(job.dump(), sort_keys=False)


def dump_json(job: Job) -> str:
    return json.dumps(job.dump(), indent=2)
