"""Installed Kubeflow Trainer runtimes: add (replacing one of the same kind and name), list, remove."""

from __future__ import annotations

from typing import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.spec.compat.trainer import RuntimeDoc
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import TrainingRuntimeRow, utcnow


def install(session: Session, runtime: RuntimeDoc) -> bool:
    """Store ``runtime``; True when it replaced an installed one of the same kind and name."""
    row = session.scalar(
        select(TrainingRuntimeRow).where(
            TrainingRuntimeRow.kind == runtime.kind, TrainingRuntimeRow.name == runtime.name
        )
    )
    replaced = row is not None
    if row is None:
        row = TrainingRuntimeRow(kind=runtime.kind, name=runtime.name)
        session.add(row)
    row.document, row.source, row.installed_at = runtime.document, runtime.source, utcnow()
    return replaced


def installed(session: Session) -> list[RuntimeDoc]:
    """Every installed runtime, by kind then name."""
    rows = session.scalars(select(TrainingRuntimeRow).order_by(TrainingRuntimeRow.kind, TrainingRuntimeRow.name))
    return [
        RuntimeDoc(kind=r.kind, name=r.name, document=r.document, source=f"installed from {r.source}") for r in rows
    ]


def remove(session: Session, name: str, kind: str | None = None) -> int:
    """Delete the runtimes named ``name`` (of ``kind`` when given); how many there were."""
    query = select(TrainingRuntimeRow).where(TrainingRuntimeRow.name == name)
    if kind is not None:
        query = query.where(TrainingRuntimeRow.kind == kind)
    rows = list(session.scalars(query))
    for row in rows:
        session.delete(row)
    return len(rows)


def installed_reader(url: str | None) -> Callable[[], list[RuntimeDoc]]:
    """A reader of the runtimes installed in the store at ``url`` (default: the user's), for
    :class:`~trainmaster.spec.load.LoadOptions`: the store is opened only when a TrainJob names a
    runtime it was not given."""

    def read() -> list[RuntimeDoc]:
        return session_reader(session_factory(make_engine(url)))()

    return read


def session_reader(sessions: sessionmaker[Session]) -> Callable[[], list[RuntimeDoc]]:
    """The same over an open store's sessions (the service's)."""

    def read() -> list[RuntimeDoc]:
        with sessions() as session:
            return installed(session)

    return read
