"""Queues with quota in the store: create, replace, read and delete (:class:`QueueRow`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from trainmaster.errors import JobConflict, UserError
from trainmaster.spec.queue import QueueSpec
from trainmaster.spec.states import JOB_TERMINAL
from trainmaster.store.models import JobRow, QueueRow, utcnow


class QueueNotFound(UserError):
    """No queue of that name (HTTP 404)."""


class QueueExists(JobConflict):
    """A queue of that name exists already (HTTP 409)."""


def save_queue(session: Session, spec: QueueSpec, replace: bool = False) -> QueueRow:
    """Store a queue; one of that name is an error unless ``replace``."""
    row = session.get(QueueRow, spec.name)
    if row is not None and not replace:
        raise QueueExists(
            f"queue '{spec.name}' exists already; change it with `trainmaster queue create --replace` "
            f"(PUT /api/v1/queues/{spec.name})"
        )
    if row is None:
        row = QueueRow(name=spec.name, created_at=utcnow())
        session.add(row)
    row.cohort, row.weight, row.quota, row.updated_at = spec.cohort, spec.weight, spec.amounts(), utcnow()
    return row


def get_queue(session: Session, name: str) -> QueueRow:
    row = session.get(QueueRow, name)
    if row is None:
        known = list_queue_names(session)
        hint = f"queues with quota: {', '.join(known[:20])}" if known else "no queue has quota yet"
        raise QueueNotFound(f"no queue '{name}' with quota ({hint}); create one with `trainmaster queue create`")
    return row


def list_queues(session: Session) -> list[QueueRow]:
    return list(session.scalars(select(QueueRow).order_by(QueueRow.cohort, QueueRow.name)))


def list_queue_names(session: Session) -> list[str]:
    return list(session.scalars(select(QueueRow.name).order_by(QueueRow.name)))


def delete_queue(session: Session, name: str) -> None:
    """Delete a queue's quota; refused while a job not ended is in it (its quota would vanish
    under admitted jobs)."""
    row = get_queue(session, name)
    active = session.scalar(
        select(func.count(JobRow.id)).where(JobRow.queue == name, JobRow.state.not_in([s.value for s in JOB_TERMINAL]))
    )
    if active:
        raise QueueExists(f"queue '{name}' still has {active} job(s) not ended; cancel them or wait for them to end")
    session.delete(row)


def queue_document(row: QueueRow) -> dict[str, Any]:
    """A queue as the API shows it (memory in bytes)."""
    return {
        "name": row.name,
        "cohort": row.cohort,
        "weight": row.weight,
        "quota": row.quota,
        "createdAt": row.created_at.isoformat() if row.created_at else None,
        "updatedAt": row.updated_at.isoformat() if row.updated_at else None,
    }
