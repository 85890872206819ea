"""Where a party's data files are: one ``<data_id>.csv`` or ``<data_id>.parquet`` per data id."""

from __future__ import annotations

from pathlib import Path

from trainmaster.gateway.crypto.envelope import EnvelopeError

DATA_SUFFIXES = (".csv", ".parquet")


def resolve_data_file(data_dir: Path, data_id: str) -> Path:
    """The data id's file (``<data_id>.csv`` or ``.parquet``) inside ``data_dir``.

    Anything that would escape the directory is refused; two files for one data id are ambiguous
    and refused too, so a party never silently serves the wrong one.
    """
    root = data_dir.resolve()
    found = []
    for suffix in DATA_SUFFIXES:
        candidate = (root / f"{data_id}{suffix}").resolve()
        if candidate.parent == root and candidate.is_file():
            found.append(candidate)
    if not found:
        raise EnvelopeError(404, f"data id {data_id!r} is not held by this party")
    if len(found) > 1:
        raise EnvelopeError(
            409,
            f"data id {data_id!r} has both a CSV and a Parquet file at this party; "
            "the party operator must keep only one",
        )
    return found[0]
