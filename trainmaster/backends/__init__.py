"""Backends: where instances run. ``local`` (subprocesses, the default) and ``ray`` (a Ray cluster)."""

from __future__ import annotations

from typing import Any

from trainmaster.errors import UserError


def ray_backend_or_error(address: str | None = None) -> Any:
    """The Ray backend, or a clear error when the optional ``ray`` extra is missing."""
    try:
        from trainmaster.backends.ray import RayBackend
    except ImportError as exc:
        raise UserError(f"--backend ray needs the optional Ray extra: pip install 'trainmaster[ray]' ({exc})") from None
    return RayBackend(address=address)
