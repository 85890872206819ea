"""Foreign job documents (Kubeflow PyTorchJob/TFJob/MPIJob, Volcano Job) for the API fuzz tests:
the project's own example and corpus files (and upstream's example files where the shared data
folder is present), and every way of putting an odd value into one of their fields: each field
they have, and each field the Kubernetes object at that place may have (a container's
``workingDir`` although no file here sets one), set to a long, NUL-bearing, huge or wrong-typed
value.

Field shapes are deduplicated per kind (``containers[0]`` of a Master and of a Worker are one
shape), so the sweep stays a few thousand requests while it reaches every field a converter
reads."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Iterator

import yaml

from trainmaster.spec.compat.kubeflow import RUN_POLICY_FIELDS, SCHEDULING_POLICY_FIELDS
from trainmaster.spec.compat.meta import OBJECT_META_FIELDS
from trainmaster.spec.compat.pod import CONTAINER_FIELDS, POD_SPEC_FIELDS
from trainmaster.spec.compat.volcano import SPEC_FIELDS as VOLCANO_SPEC_FIELDS
from trainmaster.spec.compat.volcano import TASK_FIELDS as VOLCANO_TASK_FIELDS

ROOT = Path(__file__).resolve().parents[2]
#: Values no field should turn into a 500: longer than any path, name or path component, a NUL,
#: a number past any integer field (and any float), and each wrong type.
ODD_VALUES: list[Any] = ["a" * 5000, "\x00", 10**400, None, [], {}]

Path_ = tuple[Any, ...]


def upstream_folder() -> Path | None:
    """Upstream's example job files: $TRAINMASTER_SHARED_DATA or ../shared/data next to the repo."""
    env = os.environ.get("TRAINMASTER_SHARED_DATA")
    base = Path(env) if env else ROOT.parent / "shared" / "data"
    folder = base / "upstream-job-examples"
    return folder if folder.is_dir() else None


def foreign_documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) of every Kubeflow/Volcano job file we have."""
    files = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "tests/compat/corpus").glob("*.yaml"))
    upstream = upstream_folder()
    if upstream is not None:
        files += sorted(upstream.glob("*/*.yaml"))
    found = []
    for path in files:
        try:
            document = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue
        if isinstance(document, dict) and str(document.get("apiVersion", "")).split("/")[0] in (
            "kubeflow.org",
            "batch.volcano.sh",
        ):
            found.append((path.name, document))
    return found


def known_fields(kind: str, path: Path_) -> set[str]:
    """The fields the Kubernetes object at ``path`` of a ``kind`` document may have (empty where
    we do not model it: free-form maps, lists of values)."""
    text = dotted(path)
    if re.search(r"containers\[\d+\]$", text):
        return set(CONTAINER_FIELDS)
    if text.endswith("template.spec"):
        return set(POD_SPEC_FIELDS)
    if text == "metadata" or text.endswith("template.metadata"):
        return set(OBJECT_META_FIELDS)
    if text == "spec.runPolicy":
        return set(RUN_POLICY_FIELDS)
    if text == "spec.runPolicy.schedulingPolicy":
        return set(SCHEDULING_POLICY_FIELDS)
    if kind == "Job" and text == "spec":
        return set(VOLCANO_SPEC_FIELDS)
    if kind == "Job" and re.fullmatch(r"spec\.tasks\[\d+\]", text):
        return set(VOLCANO_TASK_FIELDS)
    if re.fullmatch(r"spec\.\w+ReplicaSpecs\.\w+", text):
        return {"replicas", "template", "restartPolicy"}
    return set()


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shape(kind: str, path: Path_) -> tuple[Any, ...]:
    """A field's place with list indices and replica types folded (one shape per kind)."""
    folded = []
    for i, part in enumerate(path):
        if isinstance(part, int):
            folded.append("[]")
        elif i == 2 and str(path[1]).endswith("ReplicaSpecs"):
            folded.append("<type>")
        else:
            folded.append(part)
    return (kind, *folded)


def _mappings(value: Any, path: Path_ = ()) -> Iterator[tuple[Path_, dict[str, Any]]]:
    if isinstance(value, dict):
        yield path, value
        for key, child in value.items():
            yield from _mappings(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _mappings(child, (*path, i))


def odd_field_cases() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(file, field path, odd value, document with that field set to it), one field of each
    shape: every field present in a document and every known field of each object in it."""
    cases = []
    seen: set[tuple[Any, ...]] = set()
    for name, document in foreign_documents():
        kind = str(document.get("kind"))
        for where, mapping in list(_mappings(document)):
            for field in sorted(set(mapping) | known_fields(kind, where)):
                field_path = (*where, field)
                shape = _shape(kind, field_path)
                if shape in seen:
                    continue
                seen.add(shape)
                for odd in ODD_VALUES:
                    changed = copy.deepcopy(document)
                    target = changed
                    for part in where:
                        target = target[part]
                    target[field] = copy.deepcopy(odd)
                    cases.append((name, dotted(field_path), odd, changed))
    return cases
