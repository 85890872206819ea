"""Validation that reports every problem at once, each with its field path and a reason.

Two passes run on every document: pydantic's structural checks (types, ranges, unknown fields)
and the cross-field checks below (dependencies, cycles, gang size, framework), which walk the
raw document so they still run when some field failed its type check.
"""

from __future__ import annotations

import difflib
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from trainmaster.errors import UserError
from trainmaster.spec.model import MAX_ROLES, Job
from trainmaster.spec.paths import PathPolicy, path_errors
from trainmaster.spec.status import PRESETS


def field_path(loc: tuple[Any, ...]) -> str:
    """``('spec', 'roles', 1, 'replicas')`` -> ``spec.roles[1].replicas``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(
            ("function-", "literal[", "int", "str", "tagged-union", "constrained-", "lax-", "json-or-python")
        ) or part in ("RoleSelector", "InstanceCount", "constrained-int"):
            continue  # pydantic's union-branch markers are noise to a user
        else:
            out += ("." if out else "") + str(part)
    return out


def _message(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in ("greater_than", "greater_than_equal") and err["loc"][-1] in ("replicas", "minAvailable"):
        return "must be an integer > 0"
    if kind == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    if kind == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if kind == "less_than_equal":
        return f"must be <= {ctx.get('le')}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "must be an integer"
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]), known_fields(err["loc"][:-1]), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown field{hint}; check its spelling against the job reference in docs/controller.md"
    if kind == "missing":
        return "is required"
    if kind == "string_pattern_mismatch":
        return "must be lower-case letters, digits and '-', starting and ending with a letter or digit"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}"
    if kind == "too_short":
        return "must not be empty"
    return err["msg"].removeprefix("Value error, ")


def known_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names (as a user writes them) of the object at ``loc`` in a job document,
    found by walking the job model: what a did-you-mean picks from. Empty where ``loc`` leads to
    no model (a free-form map)."""
    model: Any = Job
    for part in loc:
        if isinstance(part, int) or model is None:
            continue  # a list item: the same model as its list
        fields = {info.alias or name: info for name, info in model.model_fields.items()}
        info = fields.get(str(part))
        model = None if info is None else _model_in(info.annotation)
    if model is None:
        return []
    return sorted(info.alias or name for name, info in model.model_fields.items())


def _model_in(annotation: Any) -> Any:
    """The pydantic model an annotation holds (through Optional, list, dict, Annotated), if one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def structural_errors(raw: dict[str, Any]) -> list[str]:
    """Pydantic's checks, one line per problem; a union reports once per field path."""
    try:
        Job.model_validate(raw)
    except ValidationError as exc:
        seen: dict[str, str] = {}
        for err in exc.errors():
            path = field_path(err["loc"])
            seen.setdefault(path, _message(dict(err)))
        return [f"{path}: {msg}" for path, msg in seen.items()]
    return []


def _mapping(value: Any) -> dict[str, Any]:
    """``value`` if it is a mapping, else empty: the cross-field checks read a document whose
    structure may be broken (the structural pass reports that), and must never fail on it."""
    return value if isinstance(value, dict) else {}


def _roles(raw: dict[str, Any]) -> list[dict[str, Any]]:
    roles = _mapping(raw.get("spec")).get("roles")
    if not isinstance(roles, list) or len(roles) > MAX_ROLES:
        return []  # the structural pass reports it; nothing to cross-check
    return [r if isinstance(r, dict) else {} for r in roles]


def _cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A dependency cycle as a list of role names, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt in graph and color.get(nxt, 0) == 0:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    for node in graph:
        if color.get(node, 0) == 0:
            found = visit(node)
            if found:
                return found
    return None


def semantic_errors(raw: dict[str, Any]) -> list[str]:
    """Cross-field checks that pydantic cannot express."""
    errors: list[str] = []
    spec = _mapping(raw.get("spec"))
    roles = _roles(raw)
    names = [r.get("name") if isinstance(r.get("name"), str) else None for r in roles]
    for i, name in enumerate(names):
        if name is not None and names.index(name) != i:
            errors.append(f"spec.roles[{i}].name: duplicate role name '{name}'")
    known = {n for n in names if isinstance(n, str)}
    graph: dict[str, list[str]] = {}
    for i, role in enumerate(roles):
        deps = role.get("dependsOn") or []
        if not isinstance(deps, list):
            continue
        for j, dep in enumerate(deps):
            target = dep.get("role") if isinstance(dep, dict) else None
            where = f"spec.roles[{i}].dependsOn[{j}].role"
            placed = isinstance(dep, dict) and dep.get("condition") == "Placed"
            if placed and isinstance(target, str) and target in known:
                continue  # placement never waits for anything: no cycle, itself included
            if target == role.get("name"):
                errors.append(f"{where}: a role cannot depend on itself")
            elif isinstance(target, str) and target not in known:
                errors.append(f"{where}: unknown role '{target}' (roles: {', '.join(sorted(known))})")
            elif isinstance(target, str) and isinstance(role.get("name"), str) and target in known:
                graph.setdefault(role["name"], []).append(target)
    cycle = _cycle(graph)
    if cycle:
        errors.append(f"spec.roles: dependency cycle {' -> '.join(cycle)}")
    errors += _gang_errors(spec, roles)
    errors += _policy_errors(spec, roles, known)
    for i, role in enumerate(roles):
        errors += _process_errors(f"spec.roles[{i}]", role)
    return errors


def _process_errors(where: str, role: dict[str, Any]) -> list[str]:
    """What the OS cannot take in argv, environment or working directory: a NUL byte anywhere
    (execve would refuse it on the node, long after submit), ``=`` in or an empty env name."""
    errors = []
    for key in ("command", "args"):
        items = role.get(key)
        for j, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, str) and "\0" in item:
                errors.append(f"{where}.{key}[{j}]: contains a NUL byte, which no program argument can hold")
    env = role.get("env")
    for name, value in env.items() if isinstance(env, dict) else []:
        if not isinstance(name, str):
            errors.append(f"{where}.env: variable name {name!r} is not a string")
        elif name == "":
            errors.append(f"{where}.env: an empty variable name")
        elif "=" in name or "\0" in name:
            bad = "'='" if "=" in name else "a NUL byte"
            errors.append(f"{where}.env.{name!r}: a variable name cannot contain {bad}")
        if isinstance(value, str) and "\0" in value:
            errors.append(f"{where}.env.{name}: the value contains a NUL byte, which no environment can hold")
    working_dir = role.get("workingDir")
    if isinstance(working_dir, str) and "\0" in working_dir:
        errors.append(f"{where}.workingDir: contains a NUL byte, which no path can hold")
    return errors


def _gang_errors(spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
    """``minAvailable`` within the job's replicas; checked even when some role's ``replicas``
    is invalid (counted then at its default, 1, and said so), so both problems show at once."""
    replicas = [r.get("replicas", 1) for r in roles]
    valid = [isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in replicas]
    total = sum(n if ok else 1 for n, ok in zip(replicas, valid))
    min_available = _mapping(spec.get("scheduling")).get("minAvailable")
    if isinstance(min_available, int) and not isinstance(min_available, bool) and min_available > total:
        assumed = "" if all(valid) else " (counting each invalid replicas value as 1)"
        return [
            f"spec.scheduling.minAvailable: {min_available} is larger than the job's {total} replicas in total{assumed}"
        ]
    return []


def _policy_errors(spec: dict[str, Any], roles: list[dict[str, Any]], known: set[str]) -> list[str]:
    errors = []
    policies = [("spec.statusPolicy", spec.get("statusPolicy"))]
    policies += [(f"spec.roles[{i}].statusPolicy", r.get("statusPolicy")) for i, r in enumerate(roles)]
    for where, policy in policies:
        if not isinstance(policy, dict):
            continue
        preset = policy.get("preset")
        if isinstance(preset, str) and preset not in PRESETS:
            errors.append(f"{where}.preset: unknown preset '{preset}' (known: {', '.join(PRESETS)})")
        for key in ("failed", "succeeded"):
            cond = policy.get(key)
            if isinstance(cond, dict) and "roles" in cond:
                if where != "spec.statusPolicy":
                    errors.append(f"{where}.{key}.roles: only a job's status policy can name roles")
                named = cond.get("roles")
                for name in named if isinstance(named, list) else []:
                    if isinstance(name, str) and name not in known:
                        errors.append(f"{where}.{key}.roles: unknown role '{name}'")
    return errors


def validate(raw: dict[str, Any], source: str = "job", paths: PathPolicy | None = None) -> Job:
    """Parse ``raw`` into a :class:`Job`, or raise :class:`UserError` listing every problem.

    ``paths``: the operator's rule for ``workingDir``/``output.path`` (None: not checked, for a
    job that was checked when it was submitted)."""
    from trainmaster.frameworks import framework_errors

    errors = structural_errors(raw) + semantic_errors(raw)
    spec = _mapping(raw.get("spec"))
    errors += framework_errors(spec, raw_roles=_roles(raw))
    if paths is not None:
        errors += path_errors(raw, paths)
    if errors:
        raise UserError(f"{source} is not a valid job ({len(errors)} problem(s))", errors)
    return Job.model_validate(raw)
