"""The server's bound on instances held by jobs not ended (``--max-instances``), as a submit
checks it: a count read from the store at most once a second plus what was admitted since, read
again before any refusal (:class:`trainmaster.service.quotas.HeldInstances`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from trainmaster.service import quotas
from trainmaster.service.quotas import JobQuota, OverQuota, check_room
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import JobRow, RoleRow


def _job(session: Session, name: str, replicas: int, state: str = "pending") -> JobRow:
    row = JobRow(uid=name, name=name, spec={}, state=state)
    session.add(row)
    session.flush()
    session.add(RoleRow(job_id=row.id, name="w", replicas=replicas))
    session.commit()
    return row


def test_submits_are_counted_between_reads_and_a_refusal_reads_the_store(tmp_path: Path) -> None:
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'store.db'}"))
    quota = JobQuota(per_job=100, per_server=10)
    with sessions() as session:
        held = _job(session, "held", 8)
        check_room(session, 2, quota)  # 8 stored + 2: fits, and counted
        # counted 10: a third would not fit by the count, so the store is read (8 stored, the
        # 2 counted were never stored): 9 fits
        check_room(session, 1, quota)
        with pytest.raises(OverQuota) as refused:
            check_room(session, 3, quota)  # 8 stored + 3 > 10, by the store's own figures
        assert "hold 8 instances" in refused.value.message
        held.state = "succeeded"  # its instances are free once it has ended
        session.commit()
        check_room(session, 10, quota)


def test_a_count_older_than_its_refresh_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'store.db'}"))
    quota = JobQuota(per_job=100, per_server=100)
    monkeypatch.setattr(quotas, "HELD_READ_EVERY", 0.0)
    with sessions() as session:
        check_room(session, 1, quota)
        _job(session, "other-server", 50)  # stored by another server on the same store
        with pytest.raises(OverQuota):
            check_room(session, 51, quota)
