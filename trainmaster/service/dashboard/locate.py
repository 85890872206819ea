"""Find where a field path (``spec.roles[1].replicas``) sits in the YAML text a user pasted, so
the submit page can show each validation error next to its line."""

from __future__ import annotations

import re

import yaml

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def split_path(path: str) -> list[str | int]:
    """``spec.roles[1].replicas`` -> ``["spec", "roles", 1, "replicas"]``."""
    return [int(index) if index else key for key, index in _PART.findall(path)]


def line_of(text: str, path: str) -> int | None:
    """The 1-based line of the deepest node of ``path`` that exists in ``text`` (a missing field
    points at its parent), or None when the text is not YAML or the path starts elsewhere."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    line: int | None = None
    for part in split_path(path):
        child = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == part:
                    child, line = value, key.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def split_error(detail: str) -> tuple[str, str]:
    """``"spec.roles[0].replicas: must be > 0"`` -> (path, message); ("", detail) without a path."""
    head, sep, rest = detail.partition(": ")
    if sep and " " not in head and head:
        return head, rest
    return "", detail
