"""Mechanism: the reconcile pass costs what changed, not what exists (issue 31): every active job
is read as plain columns in a fixed number of queries, every live instance observed in one
backend call, and only jobs that changed are loaded and reconciled: an observation that differs
from the stored state, or an event since the last pass (a cancel or a scale written by another
process sharing the store). Event ids, the store's resource versions, are never reused."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import event, func, inspect as sa_inspect, select

from controller_harness import Harness, job
from trainmaster.backends.hollow import RUN_SECONDS, HollowBackend, HollowCluster
from trainmaster.loading import validate_document
from trainmaster.store import repository as repo
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import EventRow, InstanceRow, JobRow, RegistryRow


def long_job(name: str, replicas: int = 2) -> dict:
    doc = job(name, [{"name": "w", "replicas": replicas, "command": ["true"], "resources": {"cpu": 1}}])
    doc["metadata"]["annotations"] = {RUN_SECONDS: "3600"}
    return doc


def running_harness(tmp_path: Path, jobs: int) -> tuple[Harness, list[int]]:
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("10x100"), state_dir=tmp_path / "hollow"))
    ids = [h.submit(long_job(f"long-{n}")) for n in range(jobs)]
    for _ in range(4):  # admit and start, then look once at every job's own events
        h.controller.step()
    assert {h.status(i)["state"] for i in ids} == {"running"}
    return h, ids


def pass_with_listener(h: Harness, listener: Callable[..., None]) -> None:
    """One pass with ``listener`` called before each statement the store executes."""
    engine = h.sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", listener)
    try:
        h.controller.step()
    finally:
        event.remove(engine, "before_cursor_execute", listener)


def statements_of_a_pass(h: Harness) -> list[str]:
    seen: list[str] = []

    def record(conn, cursor, statement, *args) -> None:  # noqa: ANN001
        seen.append(statement)

    pass_with_listener(h, record)
    return seen


def test_a_pass_over_running_jobs_that_did_not_change_loads_no_job(tmp_path: Path) -> None:
    few, _ = running_harness(tmp_path / "few", 5)
    many, _ = running_harness(tmp_path / "many", 40)
    try:
        small, large = statements_of_a_pass(few), statements_of_a_pass(many)
        assert len(small) == len(large) <= 8, large  # the same few queries for 10 or 80 instances
        assert not any(s.lstrip().upper().startswith(("UPDATE", "INSERT")) for s in large), large
    finally:
        few.backend.close()
        many.backend.close()


def test_a_cancel_written_by_another_process_is_acted_on_at_the_next_pass(tmp_path: Path) -> None:
    """The CLI cancels on the store directly (no server): its event marks the job changed."""
    h, ids = running_harness(tmp_path, 3)
    try:
        other = session_factory(make_engine(h.url))  # another process's connection
        with other() as session:
            assert repo.request_cancel(session, repo.load_job(session, ids[1]))
            repo.set_replicas(session, repo.load_job(session, ids[2]), "w", 3, validate_document)
            session.commit()
        h.controller.step()
        h.controller.step()
        assert h.status(ids[1])["state"] == "cancelled"
        scaled = h.status(ids[2])
        assert len([i for i in scaled["instances"] if i["state"] == "running"]) == 3
        assert h.status(ids[0])["state"] == "running"
    finally:
        h.backend.close()


def test_a_suspend_written_just_before_a_full_pass_is_acted_on(tmp_path: Path) -> None:
    """The pass that looks at every job (one every 30 s) leaves alone running jobs whose cached
    spec stands; a job with an event since the last pass is not one of them, even on that pass
    (a suspend changes the spec: found under load, the CLI's suspend landing just before it)."""
    h, ids = running_harness(tmp_path, 2)
    try:
        other = session_factory(make_engine(h.url))
        with other() as session:
            assert repo.set_suspended(session, repo.load_job(session, ids[0]), True)
            session.commit()
        h.controller._full_pass_at = 0.0  # the next pass is a full one
        h.controller.step()
        held = h.status(ids[0])
        assert held["state"] == "pending" and held["reason"] == "Suspended", held["reason"]
        assert h.status(ids[1])["state"] == "running"
    finally:
        h.backend.close()


def test_waiting_jobs_reasons_come_from_memory_and_the_event_range(tmp_path: Path) -> None:
    """A waiting job's new reason is an event only when its last "job" event says otherwise; that
    last reason is known from this controller's own events and the range of events each pass
    reads, not from a query per job (the pass at 1,000 queued jobs read each one's last event)."""
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("1x1"), state_dir=tmp_path / "hollow"))
    try:
        ids = [h.submit(long_job(f"q-{n}", 1)) for n in range(6)]
        first = statements_of_a_pass(h)  # five jobs go from Submitted to Pending: the same queries as one
        on_events = [s for s in first if "FROM events" in s]
        assert len(on_events) <= 2, on_events
        for _ in range(3):
            h.controller.step()
        assert not [s for s in statements_of_a_pass(h) if "FROM events" in s and "DESC" in s]
        waiting = [h.status(i) for i in ids[1:]]
        assert {w["reason"] for w in waiting} == {"Pending"}
        for w in waiting:  # one "Pending" event each, however many passes found it still waiting
            assert [e["reason"] for e in w["events"] if e["object"] == "job"].count("Pending") == 1
    finally:
        h.backend.close()


def test_an_instance_that_ends_is_seen_without_any_event(tmp_path: Path) -> None:
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("2x4"), state_dir=tmp_path / "hollow"))
    try:
        doc = long_job("short", replicas=1)
        doc["metadata"]["annotations"] = {RUN_SECONDS: "4"}
        job_id = h.submit(doc)
        for _ in range(4):
            h.controller.step()
        assert h.status(job_id)["state"] == "running"  # and quiet: no event since the last pass
        deadline = time.monotonic() + 30
        while h.status(job_id)["state"] == "running" and time.monotonic() < deadline:
            h.controller.wait_for_work(1.0)
            h.controller.step()
        assert h.status(job_id)["state"] == "succeeded"
    finally:
        h.backend.close()


def test_event_ids_are_never_reused_after_a_job_is_deleted(tmp_path: Path) -> None:
    """A reader past the newest event (a watch, the controller) would never see an event given
    a deleted one's id again: SQLite's AUTOINCREMENT on events (PostgreSQL's sequence never reuses)."""
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("1x1"), state_dir=tmp_path / "hollow"))
    try:
        first = h.submit(long_job("first", 1))
        second = h.submit(long_job("second", 1))
        with h.sessions() as session:
            newest = repo.newest_event_id(session)
            session.delete(session.get(JobRow, second))
            session.commit()
        h.submit(long_job("third", 1))
        with h.sessions() as session:
            ids = session.scalars(select(EventRow.id).where(EventRow.job_id != first)).all()
        assert min(ids) > newest
    finally:
        h.backend.close()


def test_a_gang_start_writes_each_table_in_a_fixed_number_of_statements(store_url: str, tmp_path: Path) -> None:
    """Issue 38 item 8: starting a 64-replica gang wrote 64 one-row INSERTs into ``instances``
    (the start intents, before anything is spawned) and 64 into ``registry``, because on SQLite
    the ORM could not match the ids a multi-row INSERT returns to its objects. With the insert
    sentinel column each table takes one multi-row INSERT (and the states one UPDATE batch),
    whatever the gang's size, on SQLite and on PostgreSQL; every row still has its own id."""
    backend = HollowBackend(HollowCluster.parse("4x100"), state_dir=tmp_path / "hollow")
    h = Harness(tmp_path, backend=backend, url=store_url)
    engine = h.sessions.kw["bind"]
    counts: dict[int, Counter[str]] = {}
    try:
        for replicas in (8, 64):
            job_id = h.submit(long_job(f"gang-{replicas}", replicas))
            seen: list[str] = []

            def record(conn, cursor, statement, *args) -> None:  # noqa: ANN001
                seen.append(" ".join(statement.split()))

            event.listen(engine, "before_cursor_execute", record)
            try:
                for _ in range(3):  # admit and start (intents, then handles and running states)
                    h.controller.step()
            finally:
                event.remove(engine, "before_cursor_execute", record)
            status = h.status(job_id)
            assert status["state"] == "running"
            assert [i["state"] for i in status["instances"]] == ["running"] * replicas
            with h.sessions() as session:
                ids = session.scalars(select(InstanceRow.id).where(InstanceRow.job_id == job_id)).all()
                assert len(set(ids)) == replicas
                assert len(repo.registry(session, job_id)["w"]) == replicas
            words = [s.split() for s in seen if s.startswith(("INSERT", "UPDATE", "DELETE"))]
            counts[replicas] = Counter(f"{w[0]} {w[1] if w[0] == 'UPDATE' else w[2]}" for w in words)
            counts[replicas].pop("INSERT keys", None)  # the channel's key, made at the store's first start
    finally:
        h.backend.close()
    assert counts[64]["INSERT instances"] == counts[8]["INSERT instances"] == 1, counts
    assert counts[64]["INSERT registry"] == counts[8]["INSERT registry"] == 1, counts
    assert counts[64] == counts[8], counts  # no table takes more statements for a bigger gang


def writes_of_a_pass(h: Harness) -> Counter[str]:
    """The pass's writing statements by kind and table (an executemany counts once)."""
    words = [" ".join(s.split()).split() for s in statements_of_a_pass(h)]
    return Counter(
        f"{w[0]} {w[1] if w[0] == 'UPDATE' else w[2]}" for w in words if w[0] in ("INSERT", "UPDATE", "DELETE")
    )


def test_a_pass_that_stops_many_jobs_writes_each_table_in_a_fixed_number_of_statements(
    store_url: str, tmp_path: Path
) -> None:
    """Issue 31: a pass's row changes are written per table, not per job. Cancelling running
    jobs made the pass flush once per job (their registry rows deleted before a restart could
    re-insert one), each flush one UPDATE of instances, one of roles, one DELETE of registry:
    the statements grew with the jobs that changed. Now every changed column of the pass's rows
    goes out in one UPDATE per table and set of columns, and the registry's deletes with them,
    on SQLite and on PostgreSQL; a restart in the same pass takes its withdrawn row back."""
    backend = HollowBackend(HollowCluster.parse("4x100"), state_dir=tmp_path / "hollow")
    h = Harness(tmp_path, backend=backend, url=store_url)
    counts: dict[int, Counter[str]] = {}
    try:
        ids = [h.submit(long_job(f"stop-{n}", 2)) for n in range(2 + 12)]
        for _ in range(4):
            h.controller.step()
        assert {h.status(i)["state"] for i in ids} == {"running"}
        first, rest = ids[:2], ids[2:]
        for batch in (first, rest):
            for job_id in batch:
                h.controller.cancel(job_id)
            counts[len(batch)] = writes_of_a_pass(h)
            for job_id in batch:
                status = h.status(job_id)
                assert status["state"] == "cancelled"
                assert {i["state"] for i in status["instances"]} == {"stopped"}
                with h.sessions() as session:
                    assert repo.registry(session, job_id) == {}
    finally:
        h.backend.close()
    assert counts[12]["UPDATE instances"] <= 2 and counts[12]["DELETE registry"] == 1, counts
    assert counts[12] == counts[2], counts  # 24 instances stopped cost what 4 did


def test_a_pass_leaves_the_flush_no_row_it_wrote_itself(store_url: str, tmp_path: Path) -> None:
    """Issue 31, the drain of ``true`` jobs: the pass writes its rows' changed columns itself
    (:func:`repo.write_changed_columns`), so at its commits the ORM's flush must find none of
    those rows still marked changed. Before, they stayed on the session's dirty list with
    nothing to write, and each commit's unit of work registered and walked every one of them
    (a fifth of a drain's pass). What the flush is left: rows added or deleted, and a job whose
    registry collection changed. The jobs still end once each, their rows as stored."""
    backend = HollowBackend(HollowCluster.parse("4x100"), state_dir=tmp_path / "hollow")
    h = Harness(tmp_path, backend=backend, url=store_url)
    walked: Counter[str] = Counter()  # rows of the pass at a flush with only columns pending

    def before_flush(session, context, objects) -> None:  # noqa: ANN001
        for row in session.dirty:
            if isinstance(row, repo.PASS_ROWS):
                pending = set(sa_inspect(row).committed_state)
                if not pending & {"addresses", "instances", "roles", "events"}:
                    walked[type(row).__name__] += 1

    event.listen(h.sessions, "before_flush", before_flush)
    try:
        roles = [{"name": "w", "replicas": 2, "command": ["true"], "resources": {"cpu": 1}}]
        ids = [h.submit(job(f"t-{n}", roles)) for n in range(24)]
        for _ in range(8):
            h.controller.step()
            if {h.status(i)["state"] for i in ids} == {"succeeded"}:
                break
        for job_id in ids:
            status = h.status(job_id)
            assert status["state"] == "succeeded", status
            assert [(i["state"], i["attempt"]) for i in status["instances"]] == [("succeeded", 1)] * 2
        with h.sessions() as session:
            assert session.scalar(select(func.count(InstanceRow.id))) == 48
    finally:
        event.remove(h.sessions, "before_flush", before_flush)
        h.backend.close()
    assert not walked, walked


def test_an_address_registered_again_before_the_pass_writes_takes_its_withdrawn_row_back(tmp_path: Path) -> None:
    """The registry's deletes are written with the pass, not flushed as they happen: an instance
    withdrawn and registered again before then (a restart) must not insert a second row of its
    (job, role, index), which the unique constraint refuses."""
    h, ids = running_harness(tmp_path, 1)
    try:
        with h.sessions() as session:
            job = repo.load_job(session, ids[0])
            before = repo.registry(session, ids[0])["w"]
            repo.unregister_address(job, "w", 0)
            repo.unregister_address(job, "w", 1)
            repo.register_address(job, "w", 0, "127.0.0.1:1")
            session.commit()
        with h.sessions() as session:
            assert repo.registry(session, ids[0]) == {"w": ["127.0.0.1:1"]}, before
            rows = session.scalars(select(RegistryRow.id).where(RegistryRow.job_id == ids[0])).all()
            assert len(rows) == 1
    finally:
        h.backend.close()


def queue_behind_a_full_cluster(tmp_path: Path, waiting: int) -> tuple[Harness, int, list[int]]:
    """One cpu, held by a long job; ``waiting`` one-cpu jobs queued behind it, each found
    waiting by a pass (and the pass that followed)."""
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("1x1"), state_dir=tmp_path / "hollow"))
    holder = h.submit(long_job("holder", 1))
    h.controller.step()
    ids = [h.submit(long_job(f"w-{n}", 1)) for n in range(waiting)]
    for _ in range(3):
        h.controller.step()
    assert h.status(holder)["state"] == "running"
    return h, holder, ids


def sqlite_work_of_a_pass(h: Harness) -> int:
    """SQLite's virtual machine steps (in hundreds) over one pass: the rows its queries walk."""
    steps = [0]
    connections = []

    def count() -> int:
        steps[0] += 1
        return 0

    def attach(conn, cursor, statement, *args) -> None:  # noqa: ANN001
        raw = conn.connection.dbapi_connection
        raw.set_progress_handler(count, 100)
        connections.append(raw)

    try:
        pass_with_listener(h, attach)
    finally:
        for raw in connections:
            raw.set_progress_handler(None, 0)
    return steps[0]


def test_a_pass_over_a_long_queue_behind_a_full_cluster_reads_and_looks_at_no_waiting_job(
    tmp_path: Path, monkeypatch
) -> None:  # noqa: ANN001
    """The controller keeps its waiting queue between passes (read whole on its first pass and
    every full pass) and reads again only the jobs an event named; and a waiting job left as it
    is under the same free capacity is not looked at again. So a quiet pass costs the same with
    300 jobs waiting as with 10: the same store work, and no job checked for admission (before,
    every pass read every waiting job's columns and checked each)."""
    few, _, _ = queue_behind_a_full_cluster(tmp_path / "few", 10)
    many, _, _ = queue_behind_a_full_cluster(tmp_path / "many", 300)
    try:
        looked: list[int] = []
        original = type(many.controller)._stays_as_it_is

        def counted(self, job, free, admitted):  # noqa: ANN001, ANN202
            looked.append(job.id)
            return original(self, job, free, admitted)

        monkeypatch.setattr(type(many.controller), "_stays_as_it_is", counted)
        small, large = sqlite_work_of_a_pass(few), sqlite_work_of_a_pass(many)
        assert large <= small + 5, (small, large)
        assert looked == []
    finally:
        few.backend.close()
        many.backend.close()


def test_a_queue_kept_between_passes_sees_what_other_processes_write(tmp_path: Path) -> None:
    """Jobs deep in a settled queue, changed by another process sharing the store (a cancel, a
    submit of higher priority), are acted on at the next pass; the freed capacity goes to the
    queue's head in priority order, and the jobs still waiting say the free capacity they saw."""
    h, holder, ids = queue_behind_a_full_cluster(tmp_path, 40)
    try:
        other = session_factory(make_engine(h.url))
        with other() as session:
            assert repo.request_cancel(session, repo.load_job(session, ids[30]))
            session.commit()
        h.controller.step()
        assert h.status(ids[30])["state"] == "cancelled"
        # another server's controller on the same store (its own queue in memory) submits
        second = Harness(tmp_path / "second", backend=h.backend, url=h.url)
        urgent_doc = long_job("urgent", 1)
        urgent_doc["spec"]["scheduling"] = {"priorityClass": "high"}
        urgent = second.submit(urgent_doc)
        h.controller.step()
        assert h.status(urgent)["state"] == "pending"
        with other() as session:
            assert repo.request_cancel(session, repo.load_job(session, holder))
            session.commit()
        for _ in range(3):
            h.controller.step()
        assert h.status(holder)["state"] == "cancelled"
        assert h.status(urgent)["state"] == "running"
        assert {h.status(i)["state"] for i in ids if i != ids[30]} == {"pending"}
        assert "free now: cpu=0" in h.status(ids[-1])["message"]
        with other() as session:
            assert repo.request_cancel(session, repo.load_job(session, urgent))
            session.commit()
        for _ in range(3):
            h.controller.step()
        assert h.status(ids[0])["state"] == "running"  # the oldest next, not any other
        assert {h.status(i)["state"] for i in ids[1:] if i != ids[30]} == {"pending"}
    finally:
        h.backend.close()


def test_a_gangs_new_rows_are_filled_without_attribute_events_and_stored_whole(tmp_path: Path) -> None:
    """Issue 38 item 8: the rows a pass creates for a gang and starts in the same pass are written
    as plain dicts until their one INSERT (``repo.new_instance_row``, ``repo.set_unstored``: no
    attribute events, a dozen per replica). What the pass gave them is stored whole, its later
    changes (running, the handle) are written as updates, and a stored row refuses a dict write
    (its change would be lost to the pass's UPDATEs)."""
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("4x100"), state_dir=tmp_path / "hollow"))
    try:
        job_id = h.submit(long_job("gang", 16))
        for _ in range(3):
            h.controller.step()
        with h.sessions() as session:
            rows = session.scalars(select(InstanceRow).where(InstanceRow.job_id == job_id)).all()
            assert sorted(r.index for r in rows) == list(range(16))
            for row in rows:
                assert (row.state, row.attempt, row.reason, row.restarts) == ("running", 1, "Running", 0)
                assert row.log_path and row.log_path.endswith(f"logs/w-{row.index}.log")
                assert row.host and row.address and row.started_at and row.running_at and row.created_at
                assert row.handle is not None and row.cpu == 1.0
            with pytest.raises(ValueError, match="stored"):
                repo.set_unstored(rows[0], state="pending")
        fresh = repo.new_instance_row(job_id=job_id, role="w", index=99, state="pending")
        repo.set_unstored(fresh, attempt=1)
        assert (fresh.state, fresh.attempt) == ("pending", 1)
    finally:
        h.backend.close()
