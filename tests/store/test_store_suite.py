"""The store suite, on SQLite and on a real PostgreSQL (controller.md, "State lives in a real
database through SQLAlchemy: SQLite by default, PostgreSQL by URL")."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, select

from controller_harness import Harness, job, py
from trainmaster.store import repository as repo
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import InstanceRow, JobRow, MetricRow

pytestmark = pytest.mark.timeout(180)


def test_a_fresh_store_has_every_table(store_url: str) -> None:
    engine = make_engine(store_url)
    assert {"jobs", "roles", "instances", "events", "registry", "metrics", "leases"} <= set(
        inspect(engine).get_table_names()
    )


def test_jobs_are_found_by_id_uid_and_name_newest_first(store_url: str, tmp_path: Path) -> None:
    h = Harness(tmp_path, url=store_url)
    first = h.submit(job("twin", [{"name": "a", "replicas": 1, "command": ["true"]}]))
    second = h.submit(job("twin", [{"name": "a", "replicas": 1, "command": ["true"]}]))
    with h.sessions() as session:
        assert repo.find_job(session, "twin").id == second
        assert repo.find_job(session, str(first)).id == first
        uid = repo.load_job(session, first).uid
        assert repo.find_job(session, uid).id == first
        assert repo.active_job_ids(session, "service") == [first, second]  # same priority: oldest first
        assert repo.state_counts(session) == {"pending": 2}


def test_only_one_resume_wins_a_take_over(store_url: str, tmp_path: Path) -> None:
    h = Harness(tmp_path, url=store_url)
    job_id = h.submit(job("orphan", [{"name": "a", "replicas": 1, "command": ["true"]}]))
    with h.sessions() as one, h.sessions() as two:
        assert repo.take_over(one, job_id, "service", "run-1-1.00")
        one.commit()
        assert not repo.take_over(two, job_id, "service", "run-2-2.00")
        two.commit()


def test_registry_address_is_unique_per_instance(store_url: str, tmp_path: Path) -> None:
    h = Harness(tmp_path, url=store_url)
    job_id = h.submit(job("reg", [{"name": "a", "replicas": 1, "command": ["true"]}]))
    with h.sessions() as session:
        row = repo.load_job(session, job_id)
        repo.register_address(row, "a", 0, "10.0.0.1:1")
        repo.register_address(row, "a", 0, "10.0.0.1:2")  # a restart moves it: one row, new address
        session.commit()
        assert [(r.role, r.index, r.address) for r in repo.load_job(session, job_id).addresses] == [
            ("a", 0, "10.0.0.1:2")
        ]
        repo.unregister_address(row, "a", 0)
        session.commit()
        assert repo.load_job(session, job_id).addresses == []


def test_a_job_with_a_dependency_runs_to_success(store_url: str, tmp_path: Path) -> None:
    """The whole loop on this store: queue, admission, registry, the wait step reading it, status."""
    h = Harness(tmp_path, url=store_url)
    state, status = h.run(
        job(
            "deps",
            [
                {"name": "server", "replicas": 1, "command": py("import time; time.sleep(1.5)")},
                {
                    "name": "client",
                    "replicas": 2,
                    "dependsOn": [{"role": "server"}],
                    "command": py("import os; assert os.environ['TM_SERVICE_SERVER'].count(':') == 1"),
                },
            ],
        )
    )
    assert state == "succeeded", status["events"]
    assert all(i["state"] == "succeeded" for i in status["instances"])


def test_deleting_a_job_deletes_everything_it_owns(store_url: str, tmp_path: Path) -> None:
    h = Harness(tmp_path, url=store_url)
    state, _ = h.run(
        job(
            "gone",
            [
                {
                    "name": "a",
                    "replicas": 2,
                    "command": py("import trainmaster; assert trainmaster.report(step=1, loss=0.5)"),
                }
            ],
        )
    )
    assert state == "succeeded"
    with h.sessions() as session:
        row = repo.find_job(session, "gone")
        assert session.scalars(select(MetricRow).where(MetricRow.job_id == row.id)).all()
        session.delete(repo.load_job(session, row.id))
        session.commit()
        for table in (MetricRow, InstanceRow):
            assert not session.scalars(select(table)).all()
        assert not session.scalars(select(JobRow)).all()


def test_opening_an_existing_store_keeps_its_jobs(store_url: str, tmp_path: Path) -> None:
    h = Harness(tmp_path, url=store_url)
    job_id = h.submit(job("kept", [{"name": "a", "replicas": 1, "command": ["true"]}]))
    again = session_factory(make_engine(store_url))
    with again() as session:
        assert repo.load_job(session, job_id).name == "kept"
