"""The backend registry: a backend found by name.

``local`` (this machine's node agent, the default), ``ray`` (one agent per Ray node; the
optional ``ray`` extra), ``testbed`` (one agent per host of ``trainmaster testbed up``) and
``kubernetes`` (pods of a cluster; the optional ``kubernetes`` extra) and ``hollow`` (simulated
nodes that run no processes, for scale tests) are built in; a backend of someone else's is a package that names a factory in the entry-point
group ``trainmaster.backends`` (``name = "pkg.module:factory"``), as frameworks are registered.
A factory takes :class:`BackendOptions` and returns a :class:`~trainmaster.backends.base.Backend`.
Nothing is imported for a name that is none of these.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from trainmaster.backends.base import Backend, BackendOptions
from trainmaster.errors import UserError

ENTRY_POINT_GROUP = "trainmaster.backends"

BUILTIN: dict[str, str] = {
    "local": "trainmaster.backends.local:create",
    "ray": "trainmaster.backends.ray:create",
    "testbed": "trainmaster.backends.testbed:create",
    "kubernetes": "trainmaster.backends.kubernetes:create",
    "hollow": "trainmaster.backends.hollow:create",
}

#: the extra a built-in backend's dependencies come with (named when they are missing)
EXTRAS = {"ray": "ray", "kubernetes": "kubernetes"}


def installed_backends() -> list[str]:
    """Every backend name ``--backend`` accepts."""
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def make_backend(name: str, options: BackendOptions | None = None) -> Backend:
    """The backend named ``name``; a :class:`UserError` names the available ones, or the extra
    to install when the backend's dependencies are missing."""
    options = options or BackendOptions()
    try:
        factory = _factory(name)
    except ImportError as exc:
        extra = EXTRAS.get(name, name)
        raise UserError(
            f"--backend {name} needs the optional {extra} extra: pip install 'trainmaster[{extra}]' ({exc})"
        ) from None
    return factory(options)


def _factory(name: str) -> Callable[[BackendOptions], Backend]:
    target = BUILTIN.get(name)
    if target is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise UserError(f"--backend: unknown backend '{name}' (available: {', '.join(installed_backends())})")
        return found[0].load()  # type: ignore[no-any-return]
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "installed_backends", "make_backend"]
