"""Hypothesis strategies for job documents: generated from the job model's JSON schema (the one
the API publishes), then mutated (a subtree replaced by arbitrary JSON: huge numbers, NULs,
long strings, wrong types), so that both almost-valid and broken documents reach the server."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from trainmaster.spec.model import Job

JsonValue = Any

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "a" * 5000, "../../etc", "/", "12345", "~", "{}", "Always", "pytorch"]),
)
#: Values of the wrong type for almost any field: what breaks code that trusts a document's shape.
WRONG_TYPES = st.sampled_from([[], {}, [[]], [{}], {"a": []}, "x", 10**30, -1, 0, None, True, 1.5, "\x00"])
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy[JsonValue]:
    """Values of a (pydantic-made) JSON schema: refs, anyOf, enums, objects, arrays, scalars.
    Past a small depth, free-form parts become scalars so that documents stay small."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth + 1))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(option, defs, depth) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        if not properties:
            values = SCALARS if depth > 3 else ANY_JSON
            return st.dictionaries(st.text(max_size=10), values, max_size=3)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, defs, depth + 1) for k, v in properties.items() if k in required},
            optional={k: from_schema(v, defs, depth + 1) for k, v in properties.items() if k not in required},
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= 63)
        return st.text(max_size=schema.get("maxLength", 30) if schema.get("maxLength", 30) < 30 else 30)
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum", -5), max_value=min(schema.get("maximum", 20), 20))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum", -5.0), max_value=min(schema.get("maximum", 20.0), 20.0))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def job_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    schema = Job.model_json_schema(by_alias=True)
    return schema, schema.pop("$defs", {})


def _paths(value: JsonValue, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += _paths(child, prefix + (i,))
    return found


def _field_names(schema: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(schema, dict):
        names |= set(schema.get("properties", {}))
        for value in schema.values():
            names |= _field_names(value)
    elif isinstance(schema, list):
        for value in schema:
            names |= _field_names(value)
    return names


@st.composite
def mutated(draw: st.DrawFn, documents: st.SearchStrategy[JsonValue], names: list[str]) -> JsonValue:
    """A document with one to five subtrees replaced by a wrong-typed or arbitrary value, or a
    field of the model (or a random key) set where it may or may not belong."""
    document = copy.deepcopy(draw(documents))  # never change a value hypothesis may hand out again
    values = st.one_of(WRONG_TYPES, ANY_JSON).map(copy.deepcopy)
    for _ in range(draw(st.integers(1, 5))):
        path = draw(st.sampled_from(_paths(document)))
        parent = document
        for part in path:
            target = parent
            parent = parent[part]
        if isinstance(parent, dict) and draw(st.booleans()):
            parent[draw(st.one_of(st.sampled_from(names), st.text(max_size=12)))] = draw(values)
        elif path:
            target[path[-1]] = draw(values)
    return document


def documents() -> st.SearchStrategy[JsonValue]:
    schema, defs = job_schema()
    generated = from_schema(schema, defs)
    names = sorted(_field_names([schema, defs]))
    return st.one_of(generated, mutated(generated, names), mutated(generated, names))
