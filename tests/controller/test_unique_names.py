"""Mechanism: job names are unique among active jobs in the store, not only per server: two
controllers (two servers) over one store submitting the same name at the same moment, many
times over, never both succeed; a name is free again once its job ended."""

from __future__ import annotations

import threading
from pathlib import Path

from controller_harness import Harness, job
from trainmaster.controller import Controller
from trainmaster.loading import load_document
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.repository import NameTaken


def servers(url: str, tmp_path: Path, backend: object) -> list[Controller]:
    return [
        Controller(session_factory(make_engine(url)), backend, url, runs_dir=tmp_path / "runs")  # type: ignore[arg-type]
        for _ in range(2)
    ]


def race(controllers: list[Controller], name: str) -> list[object]:
    loaded = load_document(job(name, [{"name": "a", "command": ["true"]}]))
    barrier = threading.Barrier(len(controllers))
    results: list[object] = [None] * len(controllers)

    def submit(i: int) -> None:
        barrier.wait(10)
        try:
            results[i] = controllers[i].submit(loaded, unique_name=True)
        except NameTaken as exc:
            results[i] = exc

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(controllers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def check_races(controllers: list[Controller], harness: Harness) -> None:
    for n in range(20):
        results = race(controllers, f"same-{n}")
        ids = [r for r in results if isinstance(r, int)]
        assert len(ids) == 1, results  # exactly one server queued it
        assert sum(isinstance(r, NameTaken) for r in results) == 1
    taken = race(controllers[:1], "same-0")[0]
    assert isinstance(taken, NameTaken) and "still active" in str(taken)
    with harness.sessions() as session:  # once the job ended, its name is free again
        from trainmaster.store.models import JobRow

        for row in session.query(JobRow).filter(JobRow.name == "same-0"):
            row.state = "cancelled"
        session.commit()
    assert isinstance(race(controllers[:1], "same-0")[0], int)


def test_two_servers_on_one_sqlite_store_never_both_take_a_name(harness: Harness, tmp_path: Path) -> None:
    check_races(servers(harness.url, tmp_path, harness.backend), harness)


def test_two_servers_on_one_postgres_store_never_both_take_a_name(postgres, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tmp_path, url=postgres.url())
    try:
        check_races(servers(h.url, tmp_path, h.backend), h)
    finally:
        h.backend.close()
