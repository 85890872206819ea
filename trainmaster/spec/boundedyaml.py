"""YAML read with its expanded size bounded: the one YAML loader of every entry point that reads a
document from someone else (the CLI's job files, the dashboard's pasted jobs, gateway task files).

A YAML alias (``*a``) repeats a whole anchored subtree without repeating its text, so a few
hundred bytes of nested anchors ("billion laughs") expand into millions of values once anything
walks the result: validation, JSON encoding, the store, a page showing the spec. The byte limit
on the text cannot see that. This loader composes the node graph first (aliases stay shared
references, so composing is linear in the text), counts what the document expands to, counting
each alias as the full subtree it repeats, and refuses it before anything is constructed when
the count passes :data:`MAX_EXPANDED_NODES` nodes or :data:`MAX_EXPANDED_BYTES` bytes of scalars,
or when an alias refers to a node that contains it (a cycle, an infinite document).

Legitimate anchors (one ``env`` block shared by two roles) expand to a few hundred nodes and load
as before.
"""

from __future__ import annotations

from typing import Any

import yaml

from trainmaster.errors import UserError

MAX_EXPANDED_NODES = 100_000  # a large job document has a few thousand
MAX_EXPANDED_BYTES = 4 * 1024 * 1024  # scalar text after expansion; the document itself is at most 1 MiB


class _Bounded(yaml.SafeLoader):
    """SafeLoader that measures each composed document before constructing it."""

    source = "document"

    def construct_document(self, node: yaml.Node) -> Any:
        check_expansion(node, self.source)
        return super().construct_document(node)


def check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse ``root`` when its expansion is cyclic or over the limits (see the module doc).

    Sizes are memoised per node, so a DAG of shared aliases costs one visit per distinct node."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, scalar bytes) of its expansion
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            nodes, size = 1, 0
            for child in _children(node):
                child_nodes, child_bytes = sizes[id(child)]
                nodes += child_nodes
                size += child_bytes
            if nodes > MAX_EXPANDED_NODES or size > MAX_EXPANDED_BYTES:
                raise UserError(
                    f"{source}: its aliases (*name) expand to over {MAX_EXPANDED_NODES:,} values or "
                    f"{MAX_EXPANDED_BYTES // (1024 * 1024)} MiB of text; a job document is far smaller "
                    "(write the repeated part out, or repeat it less)"
                )
            sizes[key] = (nodes, size)
            continue
        if key in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[key] = (1, len(node.value.encode("utf-8", "surrogatepass")))
            continue
        if key in on_path:
            raise UserError(f"{source}: an alias (*name) refers to a node that contains it; the document never ends")
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise UserError(
                    f"{source}: an alias (*name) refers to a node that contains it; the document never ends"
                )
            if id(child) not in sizes:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_all(text: str, source: str) -> list[Any]:
    """Every document in ``text``, each bounded as the module doc says; a :class:`UserError`
    (naming ``source``) for an expansion over the limits, :class:`yaml.YAMLError` for bad YAML."""
    loader = _Bounded(text)
    loader.source = source
    try:
        documents = []
        while loader.check_data():
            documents.append(loader.get_data())
        return documents
    finally:
        loader.dispose()


def load_one(text: str, source: str) -> Any:
    """The single document in ``text`` (None when empty), bounded as :func:`load_all`."""
    documents = load_all(text, source)
    if len(documents) > 1:
        raise UserError(f"{source}: expected one YAML document, found {len(documents)}")
    return documents[0] if documents else None
