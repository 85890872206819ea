"""Several controller servers on one store: exactly one leads (a lease row renewed by the leader),
a standby takes over after the lease expires, and a fencing token makes a deposed leader's
reconcile commits fail instead of writing (controller.md: a controller that is killed and
restarted loses no job; here, across servers)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from trainmaster.controller.leader import LEASE, LeaderElector, LeaseLost, LeaseOptions
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import JobRow, LeaseRow

FAST = LeaseOptions(duration=1.0, renew=0.2)


def test_exactly_one_of_two_candidates_leads(store_url: str) -> None:
    sessions = session_factory(make_engine(store_url))
    a, b = LeaderElector(sessions, "a", FAST), LeaderElector(sessions, "b", FAST)
    assert a.try_lead() is True
    assert b.try_lead() is False and b.leader == "a"
    assert a.try_lead() is True  # renewal
    with sessions() as session:
        assert session.get(LeaseRow, LEASE).token == 1


def test_a_standby_takes_over_an_expired_lease_with_a_new_token(store_url: str) -> None:
    sessions = session_factory(make_engine(store_url))
    a, b = LeaderElector(sessions, "a", FAST), LeaderElector(sessions, "b", FAST)
    assert a.try_lead()
    time.sleep(FAST.duration + 0.1)  # a stops renewing (paused, partitioned, killed)
    assert b.try_lead() is True and b.token == 2
    assert a.try_lead() is False and a.token is None and a.leader == "b"  # a notices and steps down


def test_a_deposed_leader_cannot_commit(store_url: str) -> None:
    """The fencing token: a leader paused past its lease has its next reconcile commit refused,
    and what that transaction wrote is rolled back."""
    sessions = session_factory(make_engine(store_url))
    old, new = LeaderElector(sessions, "old", FAST), LeaderElector(sessions, "new", FAST)
    assert old.try_lead()
    session = sessions()
    old.fence(session)
    time.sleep(FAST.duration + 0.1)
    assert new.try_lead()
    session.add(JobRow(uid="stale", name="stale", spec={}, owner="service"))  # what a stale pass might write
    with pytest.raises(LeaseLost, match="superseded"):
        session.commit()
    session.rollback()
    session.close()
    with sessions() as check:
        assert check.scalars(select(JobRow)).all() == []
    assert old.token is None


def test_stop_hands_the_lease_over_at_once(store_url: str) -> None:
    sessions = session_factory(make_engine(store_url))
    a = LeaderElector(sessions, "a", LeaseOptions(duration=60, renew=0.2))
    a.start()
    assert a.elected.wait(10)
    a.stop()
    b = LeaderElector(sessions, "b", FAST)
    assert b.try_lead()  # no 60 s wait for expiry
