"""Mechanism: the job list in pages with filters (state, queue, name, label) and the watch of
changes from a resource version (``GET /api/v1/jobs``, as the Kubernetes API lists and
watches), on SQLite and PostgreSQL; ``trainmaster job list`` follows the pages."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from controller_harness import job
from server_process import ServerProcess
from trainmaster.api import LocalTrainmaster
from trainmaster.errors import UserError
from trainmaster.loading import load_document
from trainmaster.store import listing
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.listing import JobFilter
from trainmaster.store.models import EventRow, JobRow


def stored(url: str, count: int, state_dir: Path) -> LocalTrainmaster:
    """``count`` jobs stored as a submit stores them (queue a/b alternating, label team=vision on
    every third), no controller: listing reads the store only."""
    from trainmaster.controller import Controller
    from trainmaster.backends.hollow import HollowBackend

    facade = LocalTrainmaster(session_factory(make_engine(url)), url)
    controller = Controller(facade.sessions, HollowBackend(state_dir=state_dir), url)
    for n in range(count):
        doc = job(f"j{n}", [{"name": "w", "command": ["true"]}], scheduling={"queue": "ab"[n % 2]})
        if n % 3 == 0:
            doc["metadata"]["labels"] = {"team": "vision", "kueue.x-k8s.io/queue-name": "cq-1"}
        controller.submit(load_document(doc))
    return facade


@pytest.fixture
def facade(store_url: str, tmp_path: Path) -> LocalTrainmaster:
    url = store_url if store_url.startswith("postgresql") else f"sqlite:///{tmp_path / 'list.db'}"
    return stored(url, 25, tmp_path / "hollow")


def test_pages_follow_continue_tokens_and_count_what_remains(facade: LocalTrainmaster) -> None:
    pages, after = [], None
    while True:
        page = facade.list_jobs(JobFilter(), limit=10, after=after)
        pages.append(page)
        after = page.next
        if after is None:
            break
    assert [len(p.items) for p in pages] == [10, 10, 5]
    assert [p.remaining for p in pages] == [15, 5, 0]
    ids = [j["id"] for p in pages for j in p.items]
    assert ids == sorted(ids) and len(set(ids)) == 25  # oldest first, none twice
    with pytest.raises(UserError, match="not a token a list gave"):
        facade.list_jobs(JobFilter(), after="abc")
    with pytest.raises(UserError, match="limit 0"):
        facade.list_jobs(JobFilter(), limit=0)


def test_filters_keep_state_queue_name_and_labels(facade: LocalTrainmaster) -> None:
    def names(where: JobFilter) -> list[str]:
        return [j["name"] for j in facade.list_jobs(where).items]

    assert len(names(JobFilter(queue="a"))) == 13
    assert names(JobFilter(name="j7")) == ["j7"]
    assert names(JobFilter.parse(labels=["team=vision", "kueue.x-k8s.io/queue-name=cq-1"])) == [
        f"j{n}" for n in range(0, 25, 3)
    ]
    assert names(JobFilter.parse(queue="b", labels=["team=vision"])) == ["j3", "j9", "j15", "j21"]
    assert len(names(JobFilter(state="pending"))) == 25 and names(JobFilter(state="running")) == []
    for bad, why in ((["team"], "KEY=VALUE"), (["$.x=1"], "KEY=VALUE"), (["a=b c"], "KEY=VALUE")):
        with pytest.raises(UserError, match=why):
            JobFilter.parse(labels=bad)
    with pytest.raises(UserError, match="state 'runing'"):
        JobFilter.parse(state="runing")


def test_a_watch_from_a_lists_version_misses_nothing_and_repeats_nothing(
    facade: LocalTrainmaster, tmp_path: Path
) -> None:
    """Changes after the version a list gave come in order, each once; a job submitted is ADDED,
    a change of one MODIFIED, each with the event (its id the new version)."""
    start = facade.list_jobs(JobFilter(), limit=1).resource_version
    assert facade.changes(start)[0] == []
    with facade.sessions() as session:
        first = session.query(JobRow).order_by(JobRow.id).first()
        assert first is not None
        session.add(EventRow(job_id=first.id, object="job", reason="Admitted", message="fits"))
        session.commit()
    stored_more = stored(facade.sessions.kw["bind"].url.render_as_string(hide_password=False), 1, tmp_path / "more")
    changes, version = facade.changes(start)
    assert [(c.type, c.job["id"], c.event["reason"]) for c in changes][:1] == [("MODIFIED", first.id, "Admitted")]
    assert changes[-1].type == "ADDED" and changes[-1].event["reason"] == "Submitted"
    assert [int(c.event["resourceVersion"]) for c in changes] == sorted(
        int(c.event["resourceVersion"]) for c in changes
    )
    assert facade.changes(version)[0] == []
    only_b, _ = stored_more.changes(start, JobFilter(queue="b"))
    assert all(c.job["queue"] == "b" for c in only_b)


def test_the_rest_list_pages_filters_and_streams_a_watch(tmp_path: Path) -> None:
    """Over HTTP: a page with ``metadata.continue``; a filter; wrong parameters are a 422 naming
    them; a watch streams the changes after the version and ends with a BOOKMARK; the CLI's
    ``job list`` follows every page and filters."""
    server = ServerProcess(tmp_path, "--backend", "hollow", env={"TRAINMASTER_HOLLOW_NODES": "1x1"})
    try:
        api = f"{server.url}/api/v1/jobs"
        for n in range(5):
            server.submit(job(f"r{n}", [{"name": "w", "command": ["true"]}], scheduling={"queue": "ab"[n % 2]}))
        page = httpx.get(api, params={"limit": 2}, timeout=10).json()
        assert [j["name"] for j in page["items"]] == ["r0", "r1"]
        assert page["metadata"]["continue"] and page["metadata"]["remainingItemCount"] == 3
        rest = httpx.get(api, params={"limit": 5, "continue": page["metadata"]["continue"]}, timeout=10).json()
        assert [j["name"] for j in rest["items"]] == ["r2", "r3", "r4"] and rest["metadata"]["continue"] is None
        assert [j["name"] for j in httpx.get(api, params={"queue": "b"}, timeout=10).json()["items"]] == ["r1", "r3"]
        for params in ({"state": "bogus"}, {"label": "no pairs"}, {"continue": "x"}, {"resourceVersion": "-1"}):
            reply = httpx.get(api, params=params, timeout=10)
            assert reply.status_code == 422, (params, reply.text)
        version = page["metadata"]["resourceVersion"]
        lines: list[dict] = []

        def watch() -> None:
            params = {"watch": "true", "resourceVersion": version, "timeoutSeconds": 3, "name": "late"}
            with httpx.stream("GET", api, params=params, timeout=30) as stream:
                lines.extend(json.loads(line) for line in stream.iter_lines() if line)

        watcher = threading.Thread(target=watch)
        watcher.start()
        late = server.submit(job("late", [{"name": "w", "command": ["true"]}]))
        watcher.join(30)
        assert lines and lines[0]["type"] == "ADDED" and lines[0]["object"]["id"] == late
        assert {line["object"].get("id") for line in lines[:-1]} == {late}  # the filter holds
        assert lines[-1]["type"] == "BOOKMARK" and int(lines[-1]["object"]["resourceVersion"]) > int(version)
        listed = server.cli("job", "list", "--json", "--queue", "a")
        assert listed.returncode == 0, listed.stderr
        assert [j["name"] for j in json.loads(listed.stdout)] == ["r0", "r2", "r4"]
        wrong = server.cli("job", "list", "--label", "nope")
        assert wrong.returncode == 2 and "KEY=VALUE" in wrong.stderr and "Traceback" not in wrong.stderr
    finally:
        server.stop()


def test_listing_reads_only_its_page(tmp_path: Path) -> None:
    """A page's cost is its own rows: the list asks the store a bounded number of queries,
    whatever the number of jobs (none per job)."""
    from sqlalchemy import event

    facade = stored(f"sqlite:///{tmp_path / 'many.db'}", 60, tmp_path / "hollow")
    engine = facade.sessions.kw["bind"]
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    facade.list_jobs(JobFilter(), limit=50)
    assert len(statements) <= 4, statements
    assert listing.MAX_LIMIT == 1000


def test_the_sqlite_page_in_one_statement_answers_what_the_row_by_row_page_does(tmp_path: Path) -> None:
    """SQLite's page comes as one JSON row (the driver gives up the interpreter lock at each
    row); it must show exactly what the portable, row-by-row read shows: items, token, count."""
    url = f"sqlite:///{tmp_path / 'one.db'}"
    facade = stored(url, 23, tmp_path / "hollow")
    with facade.sessions() as session:
        job = session.get(JobRow, 4)
        assert job is not None
        job.state, job.reason, job.message = "cancelled", "Cancelled", "by the test"
        job.completed_at = job.created_at
        session.commit()
    filters = [JobFilter(), JobFilter(queue="a"), JobFilter(state="cancelled"), JobFilter.parse(labels=["team=vision"])]
    pages = 0
    with facade.sessions() as session:
        for where in filters + [JobFilter(name="j1", name_contains=True), JobFilter(state="running")]:
            for limit in (1, 4, 500):
                start = 0
                while True:
                    one = listing._sqlite_page(session, start, where.conditions(), limit)
                    rows = listing._portable_page(session, start, where.conditions(), limit)
                    assert one == rows, (where, limit, start)
                    pages += 1
                    if one.next is None:
                        break
                    start = int(one.next)
        shown = listing.list_jobs(session, JobFilter(state="cancelled"))
    assert pages > 40
    assert [(j["name"], j["completedAt"] is not None, j["labels"]) for j in shown.items] == [
        ("j3", True, {"team": "vision", "kueue.x-k8s.io/queue-name": "cq-1"})
    ]
