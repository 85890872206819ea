"""Mechanism: a submit, and a list or status of jobs, costs a fixed number of plain statements
(issue 31's scale test: hundreds of submits, lists and statuses a second beside the reconcile
pass). A batch of submits is stored with one INSERT per table and one UPDATE of the jobs' folders
whatever its size; a list page reads plain columns, the spec's labels taken by the database, not
every job's whole spec."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event, select

from controller_harness import Harness, job
from trainmaster.backends.hollow import HollowBackend, HollowCluster
from trainmaster.loading import load_document
from trainmaster.store import repository as repo
from trainmaster.store.listing import JobFilter
from trainmaster.store.models import EventRow, JobRow, RoleRow


@contextmanager
def statements(h: Harness) -> Iterator[list[str]]:
    engine = h.sessions.kw["bind"]
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def harness(tmp_path: Path) -> Harness:
    return Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("2x8"), state_dir=tmp_path / "hollow"))


def documents(names: list[str]) -> list[Any]:
    found = []
    for n, name in enumerate(names):
        doc = job(
            name,
            [
                {"name": "master", "command": ["true"]},
                {"name": "worker", "replicas": 1 + n % 3, "command": ["true"]},
            ],
        )
        doc["metadata"]["labels"] = {"team": f"t{n % 2}"}
        if n % 2:
            doc["spec"]["output"] = {"path": "out"}
        found.append(load_document(doc))
    return found


def write_count(seen: list[str]) -> int:
    return sum(s.lstrip().upper().startswith(("INSERT", "UPDATE")) for s in seen)


def test_a_submit_batch_is_stored_in_the_same_statements_whatever_its_size(tmp_path: Path) -> None:
    h = harness(tmp_path)
    try:
        with statements(h) as one:
            h.controller.submit_batch(documents(["solo"]), unique_name=True)
        names = [f"job-{n}" for n in range(20)] + ["job-3"]  # the last one's name is taken in the batch
        with statements(h) as many:
            results = h.controller.submit_batch(documents(names), unique_name=True)
        # jobs, their folders, roles, events; a batch's ids then in one query (one job's come with its INSERT)
        assert len(one) == len(many) - 1 and write_count(many) == write_count(one) == 4, (one, many)
        assert isinstance(results[-1], repo.NameTaken)
        ids = [r for r in results[:-1] if isinstance(r, int)]
        assert ids == sorted(ids) and len(set(ids)) == 20
        with h.sessions() as session:
            for n, job_id in enumerate(ids):  # what the ORM wrote before, column by column
                row = session.get(JobRow, job_id)
                assert row is not None and row.name == f"job-{n}" and row.state == "pending"
                assert row.run_dir == str((tmp_path / "runs" / f"{job_id}-job-{n}").resolve())
                assert (row.output_path is not None) == bool(n % 2)
                assert row.spec["metadata"]["labels"] == {"team": f"t{n % 2}"}
                roles = session.scalars(select(RoleRow).where(RoleRow.job_id == job_id).order_by(RoleRow.position))
                assert [(r.name, r.position, r.replicas) for r in roles] == [("master", 0, 1), ("worker", 1, 1 + n % 3)]
                reasons = session.scalars(select(EventRow.reason).where(EventRow.job_id == job_id)).all()
                assert reasons == ["Submitted"]
        for _ in range(3):  # the cached specs are the stored ones: the jobs run as submitted
            h.controller.step()
        assert h.status(ids[4])["state"] == "succeeded" and len(h.status(ids[4])["instances"]) == 3
    finally:
        h.backend.close()


def read_of(h: Harness, call: Callable[[], Any]) -> list[str]:
    with statements(h) as seen:
        call()
    return seen


def test_a_list_page_reads_plain_columns_and_a_status_no_spec(tmp_path: Path) -> None:
    h = harness(tmp_path)
    try:
        ids = [r for r in h.controller.submit_batch(documents([f"job-{n}" for n in range(30)])) if isinstance(r, int)]
        small = read_of(h, lambda: h.jobs.list_jobs(JobFilter(), 1))
        page = h.jobs.list_jobs(JobFilter.parse("", "", "", ["team=t1"]), 100)
        large = read_of(h, lambda: h.jobs.list_jobs(JobFilter.parse("", "", "", ["team=t1"]), 100))
        assert len(small) <= 3 and len(large) <= 3, (small, large)  # a count only when more jobs follow
        assert [j["id"] for j in page.items] == ids[1::2] and {j["labels"]["team"] for j in page.items} == {"t1"}
        whole_spec = re.compile(r"(?<!\()jobs\.spec\s*(,|FROM)", re.IGNORECASE)  # the column itself, not a path in it
        assert not any(whole_spec.search(s) for s in large), large
        status = read_of(h, lambda: h.jobs.status(ids[0]))
        assert not any(whole_spec.search(s) for s in status), status
        assert h.jobs.status(ids[0])["events"][0]["reason"] == "Submitted"
    finally:
        h.backend.close()
