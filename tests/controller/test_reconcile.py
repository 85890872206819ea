"""Mechanisms: the reconcile (tuning) pass (spec step 8) and gang admission with queueing
(spec steps 1 and 3): missing instances are recreated, surplus deleted failed-first then
youngest; nothing of a job starts until its gang fits."""

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select

from controller_harness import Harness, events, job, py, step_until
from trainmaster.backends.base import Resources
from trainmaster.backends.local import LocalBackend
from trainmaster.controller.scaling import Member, missing_indices, surplus
from trainmaster.store.models import InstanceRow

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_missing_indices_fill_the_lowest_gaps() -> None:
    members = [Member(1, 0, "running", T0), Member(2, 2, "running", T0)]
    assert missing_indices(members, 4) == [1, 3]
    assert missing_indices(members, 2) == []


def test_surplus_goes_failed_first_then_youngest() -> None:
    members = [
        Member(1, 0, "running", T0),
        Member(2, 1, "running", T0 + timedelta(seconds=5)),
        Member(3, 2, "failed", T0),
        Member(4, 3, "pending", None),
        Member(5, 4, "running", T0 + timedelta(seconds=9)),
    ]
    assert [m.key for m in surplus(members, 4)] == [3]
    assert [m.key for m in surplus(members, 2)] == [3, 4, 5]
    assert [m.key for m in surplus(members, 1)] == [3, 4, 5, 2]


def running(status: dict, role: str) -> list[dict]:
    return [i for i in status["instances"] if i["role"] == role and i["state"] == "running"]


def test_reconcile_scales_up_and_down_and_recreates_missing(harness: Harness) -> None:
    job_id = harness.submit(
        job("elastic", [{"name": "w", "replicas": 2, "command": py("import time; time.sleep(60)")}])
    )
    step_until(harness, job_id, lambda s: len(running(s, "w")) == 2)
    harness.controller.scale(job_id, "w", 4)
    status = step_until(harness, job_id, lambda s: len(running(s, "w")) == 4)
    assert sorted(i["index"] for i in running(status, "w")) == [0, 1, 2, 3]
    harness.controller.scale(job_id, "w", 1)
    status = step_until(harness, job_id, lambda s: len(running(s, "w")) == 1)
    assert running(status, "w")[0]["index"] == 0  # the oldest survives
    assert len(events(status, "ScaledDown")) == 3
    harness.controller.scale(job_id, "w", 2)  # a deleted index comes back as a new instance
    status = step_until(harness, job_id, lambda s: len(running(s, "w")) == 2)
    assert sorted(i["index"] for i in running(status, "w")) == [0, 1]
    assert [i["state"] for i in status["instances"] if i["index"] == 1] == ["stopped", "running"]
    harness.controller.cancel(job_id)
    assert harness.controller.run_job(job_id) == "cancelled"


def test_gang_that_can_never_fit_is_unschedulable(tmp_path) -> None:
    h = Harness(tmp_path, LocalBackend(Resources(cpu=2, memory=2**30)))
    state, status = h.run(job("big", [{"name": "w", "replicas": 3, "resources": {"cpu": 1}, "command": py("pass")}]))
    assert state == "failed" and status["reason"] == "Unschedulable"
    assert "exceeds the backend's total capacity" in status["message"]
    assert status["instances"] == []  # nothing started


def test_gang_waits_in_the_queue_until_resources_free(tmp_path) -> None:
    h = Harness(tmp_path, LocalBackend(Resources(cpu=2, memory=2**30)))
    first = h.submit(
        job(
            "first",
            [{"name": "w", "replicas": 2, "resources": {"cpu": 1}, "command": py("import time; time.sleep(1.5)")}],
        )
    )
    second = h.submit(
        job(
            "second",
            [{"name": "w", "replicas": 2, "resources": {"cpu": 1}, "command": py("pass")}],
            scheduling={"minAvailable": 2},
        )
    )
    status = step_until(h, second, lambda s: s["state"] == "pending" and "waiting for resources" in s["message"])
    assert status["instances"] == []
    assert h.status(first)["state"] in ("starting", "running")
    assert h.controller.run_job(second) == "succeeded"
    first_done = h.status(first)["completedAt"]
    second_started = h.status(second)["startedAt"]
    assert second_started >= first_done
    assert any(e["reason"] == "Pending" for e in h.status(second)["events"])


def test_higher_priority_jobs_are_admitted_first(tmp_path) -> None:
    h = Harness(tmp_path, LocalBackend(Resources(cpu=1, memory=2**30)))
    low = h.submit(
        job("low", [{"name": "w", "resources": {"cpu": 1}, "command": py("pass")}], scheduling={"priorityClass": "low"})
    )
    high = h.submit(
        job(
            "high",
            [{"name": "w", "resources": {"cpu": 1}, "command": py("pass")}],
            scheduling={"priorityClass": "high"},
        )
    )
    h.controller.step()
    assert h.status(high)["state"] != "pending" and h.status(low)["state"] == "pending"


def test_cancel_stops_every_instance(harness: Harness) -> None:
    from controller_harness import pids_alive

    job_id = harness.submit(job("long", [{"name": "w", "replicas": 3, "command": py("import time; time.sleep(60)")}]))
    status = step_until(harness, job_id, lambda s: len(running(s, "w")) == 3)
    pids = [i["pid"] for i in status["instances"]]
    harness.controller.cancel(job_id)
    assert harness.controller.run_job(job_id) == "cancelled"
    assert pids_alive(pids) == []
    assert {i["state"] for i in harness.status(job_id)["instances"]} == {"stopped"}


def _counts_match_the_table(status: dict) -> None:
    """Each role's per-state counts are its rows of the instance table, state by state."""
    for role in status["roles"]:
        rows = [i["state"] for i in status["instances"] if i["role"] == role["name"]]
        assert {k: v for k, v in role["counts"].items() if v} == {s: rows.count(s) for s in set(rows)}, role


def test_a_succeeded_jobs_stopped_roles_say_success_and_counts_match_the_table(harness: Harness) -> None:
    """Mechanism (step 9, instances stopped at the job's end; step 7, stored counts): when the
    job succeeds (here: its master did, as Kubeflow's preset says) while a role still runs, that
    role reads as a success (state succeeded, reason JobSucceeded, as Kubeflow shows the replicas
    of a succeeded job) and its stopped instances say why (JobSucceeded: no longer needed), not
    'cancelled' and a bare 'stopped'; each role's counts add up to the instance table, stopped
    ones included, after the end as during the run, and after a cancel (Ctrl-C) too (issue 38)."""
    roles = [
        {"name": "master", "command": py("import time; time.sleep(1.5)")},
        {"name": "worker", "replicas": 2, "command": py("import time; time.sleep(60)")},
    ]
    job_id = harness.submit(job("half", roles, statusPolicy={"succeeded": {"roles": ["master"]}}))
    _counts_match_the_table(step_until(harness, job_id, lambda s: len(running(s, "worker")) == 2))
    assert harness.controller.run_job(job_id) == "succeeded"
    status = harness.status(job_id)
    by_role = {r["name"]: r for r in status["roles"]}
    assert by_role["master"]["state"] == "succeeded"
    assert (by_role["worker"]["state"], by_role["worker"]["reason"]) == ("succeeded", "JobSucceeded")
    assert "2 instance(s) still running were stopped" in by_role["worker"]["message"]
    workers = [i for i in status["instances"] if i["role"] == "worker"]
    assert {(i["state"], i["reason"]) for i in workers} == {("stopped", "JobSucceeded")}
    assert all("no longer needed" in i["message"] for i in workers)
    _counts_match_the_table(status)

    cancelled = harness.submit(job("cut", [roles[1]]))
    step_until(harness, cancelled, lambda s: len(running(s, "worker")) == 2)
    harness.controller.cancel(cancelled)
    assert harness.controller.run_job(cancelled) == "cancelled"
    after = harness.status(cancelled)
    assert {(i["state"], i["reason"]) for i in after["instances"]} == {("stopped", "Stopped")}
    assert after["roles"][0]["state"] == "cancelled"
    _counts_match_the_table(after)


def test_successful_job_stores_its_output(harness: Harness, tmp_path) -> None:
    out = tmp_path / "artifacts"
    state, status = harness.run(
        job(
            "out",
            [
                {
                    "name": "w",
                    "command": py(
                        "import os; open(os.path.join(os.environ['TM_OUTPUT_DIR'], 'model.txt'), 'w').write('weights')"
                    ),
                }
            ],
            output={"path": str(out)},
        )
    )
    assert state == "succeeded" and (out / "model.txt").read_text() == "weights"
    assert events(status, "OutputStored")


def test_controllers_sharing_a_store_reconcile_only_their_own_jobs(tmp_path) -> None:
    """An embedded `trainmaster run` beside a server on the same store never acts on the other's jobs."""
    from trainmaster.controller import Controller

    h = Harness(tmp_path)
    other = Controller(h.sessions, LocalBackend(), h.url, interval=0.1, owner="run-other", runs_dir=tmp_path / "r2")
    mine = h.submit(job("mine", [{"name": "w", "command": py("pass")}]))
    for _ in range(3):
        other.step()
    assert h.status(mine)["state"] == "pending" and h.status(mine)["instances"] == []
    assert h.controller.run_job(mine) == "succeeded"


def test_a_job_cancelled_while_queued_is_cleaned_up_and_skipped(tmp_path) -> None:
    """Spec step 1: the controller takes the next job; if cancelled meanwhile it is skipped."""
    h = Harness(tmp_path, LocalBackend(Resources(cpu=1, memory=2**30)))
    busy = h.submit(job("busy", [{"name": "w", "resources": {"cpu": 1}, "command": py("import time; time.sleep(30)")}]))
    queued = h.submit(job("queued", [{"name": "w", "resources": {"cpu": 1}, "command": py("pass")}]))
    h.controller.step()
    assert h.status(queued)["state"] == "pending"
    h.controller.cancel(queued)
    h.controller.step()
    status = h.status(queued)
    assert status["state"] == "cancelled" and status["instances"] == []
    h.controller.cancel(busy)
    assert h.controller.run_job(busy) == "cancelled"


def test_several_jobs_run_at_once_up_to_the_limit(tmp_path) -> None:
    h = Harness(tmp_path)
    h.controller.max_jobs = 2
    ids = [h.submit(job(f"j{n}", [{"name": "w", "command": py("import time; time.sleep(1)")}])) for n in range(3)]
    h.controller.step()
    states = [h.status(i)["state"] for i in ids]
    assert states[:2] == ["running", "running"] and states[2] == "pending"
    assert h.status(ids[2])["reason"] == "Queued"
    assert all(h.controller.run_job(i) == "succeeded" for i in ids)


@pytest.mark.parametrize("weights, expected", [({}, {"a": 1, "b": 1}), ({"a": 3}, {"a": 3, "b": 1})])
def test_queues_share_admissions_by_weight(tmp_path, weights: dict, expected: dict) -> None:
    """Queue and priority: a queue flooded first does not starve a later queue; weights set the
    share (Volcano's proportion); jobs beyond the limit wait with reason Queued."""
    h = Harness(tmp_path)
    h.controller.max_jobs = sum(expected.values())
    h.controller.queue_weights = weights
    sleeper = [{"name": "w", "command": py("import time; time.sleep(60)")}]
    ids = {q: [h.submit(job(f"{q}{n}", sleeper, scheduling={"queue": q})) for n in range(4)] for q in "ab"}
    h.controller.step()
    admitted = {q: sum(h.status(i)["state"] != "pending" for i in ids[q]) for q in "ab"}
    assert admitted == expected
    assert ids["a"][: expected["a"]] == [i for i in ids["a"] if h.status(i)["state"] != "pending"]
    for i in ids["a"] + ids["b"]:
        h.controller.cancel(i)
    h.controller.step()
    h.backend.close()


def test_queue_weights_parse_and_refuse_bad_items() -> None:
    from trainmaster.controller.queues import parse_weights

    assert parse_weights(["research=2", " prod =0.5"]) == {"research": 2.0, "prod": 0.5}
    for bad in ("research", "=2", "x=0", "x=-1", "x=abc"):
        with pytest.raises(ValueError, match="QUEUE=WEIGHT"):
            parse_weights([bad])


def test_status_has_kubeflow_style_conditions(tmp_path) -> None:
    """Status (spec step 7): conditions per phase reached, with reason, message and times; a
    job waiting its turn says why in Admitted=False."""
    h = Harness(tmp_path)
    h.controller.max_jobs = 1
    first = h.submit(job("first", [{"name": "w", "command": py("pass")}]))
    second = h.submit(job("second", [{"name": "w", "command": py("pass")}]))
    h.controller.step()
    waiting = {c["type"]: c for c in h.status(second)["conditions"]}
    assert waiting["Admitted"]["status"] == "False" and waiting["Admitted"]["reason"] == "Queued"
    assert h.controller.run_job(first) == "succeeded"
    done = {c["type"]: c for c in h.status(first)["conditions"]}
    assert [done[t]["status"] for t in ("Created", "Admitted", "Running", "Succeeded")] == [
        "True",
        "True",
        "False",
        "True",
    ]
    assert done["Succeeded"]["lastTransitionTime"] and done["Succeeded"]["reason"]
    assert h.controller.run_job(second) == "succeeded"
    h.backend.close()


def test_a_pass_is_one_transaction_and_a_failed_pass_spawns_nothing(tmp_path, monkeypatch) -> None:
    """Reconcile pass as one transaction (issue #14, controller speed): every job's start intent
    is committed once, before anything is spawned. A pass that fails half-way (here: while
    reconciling the second job) commits nothing and spawns nothing, and the next pass starts
    each replica exactly once."""
    from trainmaster.controller.controller import Controller

    h = Harness(tmp_path)
    marks = tmp_path / "marks"
    marks.mkdir()
    ids = [
        h.submit(
            job(
                f"j{n}",
                [
                    {
                        "name": "w",
                        "replicas": 2,
                        "command": ["/bin/sh", "-c", f"echo $$ >> {marks}/j{n}-$TM_REPLICA_INDEX; exec sleep 30"],
                    }
                ],
            )
        )
        for n in range(2)
    ]
    real = Controller._reconcile

    def second_job_fails(self, session, job_row, free):  # type: ignore[no-untyped-def]
        if job_row.id == ids[1]:
            raise RuntimeError("injected failure")
        return real(self, session, job_row, free)

    monkeypatch.setattr(Controller, "_reconcile", second_job_fails)
    with pytest.raises(RuntimeError, match="injected"):
        h.controller.step()
    assert [h.status(i)["state"] for i in ids] == ["pending", "pending"]
    assert all(i["attempt"] == 0 for i in h.status(ids[0])["instances"])
    assert list(marks.iterdir()) == []
    monkeypatch.setattr(Controller, "_reconcile", real)
    h.controller.step()
    assert [h.status(i)["state"] for i in ids] == ["running", "running"]
    for i in ids:
        h.controller.cancel(i)
        assert h.controller.run_job(i) == "cancelled"
    written = sorted(p.name for p in marks.iterdir())
    assert written == ["j0-0", "j0-1", "j1-0", "j1-1"]
    assert all(len(p.read_text().split()) == 1 for p in marks.iterdir())  # each started once


def test_submit_and_instance_exits_wake_the_servers_reconcile_loop(tmp_path) -> None:
    """Event-driven wake (issue #14, controller speed): a submit starts the next pass at once
    instead of after the reconcile interval (here 60 s), so does an instance's end (the local
    backend's watcher blocks in the node agent's wait_exit), and stopping the loop does not
    wait for the interval either."""
    from trainmaster.service.app import Reconciler

    h = Harness(tmp_path)
    h.controller.interval = 60.0
    reconciler = Reconciler(h.controller)
    reconciler.start()
    try:
        time.sleep(0.3)  # the first pass has run; the loop now waits up to 60 s
        job_id = h.submit(job("woken", [{"name": "w", "command": py("import time; time.sleep(1)")}]))
        deadline = time.monotonic() + 20
        while h.status(job_id)["state"] in ("pending", "starting"):
            assert time.monotonic() < deadline, "the submit did not wake the reconcile loop"
            time.sleep(0.05)
        while h.status(job_id)["state"] != "succeeded":
            assert time.monotonic() < deadline, "the instance's exit did not wake the reconcile loop"
            time.sleep(0.05)
    finally:
        stopping = time.monotonic()
        reconciler.stop()
        reconciler.join(timeout=20)
    assert not reconciler.is_alive() and time.monotonic() - stopping < 20


def test_a_long_queue_is_passed_over_without_rewriting_it_and_still_backfills(tmp_path) -> None:
    """Admission over a queue: a pass reads waiting jobs as plain columns and loads (and writes)
    the row of only those whose state, reason or message it changes. The order and the rules
    stay those of a full pass: a small job queued behind a big one that does not fit now is
    admitted (backfill); the big one's message follows the free capacity; a pass that changes
    nothing writes no job row."""
    from sqlalchemy import event

    h = Harness(tmp_path, LocalBackend(Resources(cpu=3, memory=2**30)))
    sleeper = py("import time; time.sleep(30)")
    hold = h.submit(job("hold", [{"name": "w", "resources": {"cpu": 2}, "command": sleeper}]))
    big = h.submit(job("big", [{"name": "w", "resources": {"cpu": 3}, "command": sleeper}]))
    small = h.submit(job("small", [{"name": "w", "resources": {"cpu": 1}, "command": sleeper}]))
    queued = [h.submit(job(f"q{n}", [{"name": "w", "resources": {"cpu": 1}, "command": sleeper}])) for n in range(5)]
    h.controller.step()
    assert h.status(hold)["state"] != "pending" and h.status(small)["state"] != "pending"
    waiting = h.status(big)
    assert waiting["state"] == "pending" and "free now: cpu=1" in waiting["message"], waiting  # before small's turn
    assert all(h.status(q)["reason"] == "Pending" for q in queued)
    h.controller.step()  # the big job's message now says what is free at its turn: nothing
    assert "free now: cpu=0" in h.status(big)["message"]
    writes: list[str] = []
    engine = h.sessions.kw["bind"]
    listen = lambda *args: writes.append(args[2]) if args[2].startswith("UPDATE jobs") else None  # noqa: E731
    event.listen(engine, "before_cursor_execute", listen)
    try:
        h.controller.step()  # nothing changed: the queue is not rewritten
        assert writes == []
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    h.controller.cancel(small)
    h.controller.step()  # one cpu free: the first queued job is admitted, the big one's message follows
    assert h.status(queued[0])["state"] != "pending"
    assert "free now: cpu=1" in h.status(big)["message"]  # when its turn came, before q0 took the cpu
    h.controller.cancel(hold)
    h.controller.step()  # two cpus free: the big job still does not fit, the next two queued jobs do
    assert [h.status(q)["state"] != "pending" for q in queued] == [True, True, True, False, False]
    for job_id in (big, *queued):
        h.controller.cancel(job_id)
    h.controller.step()
    h.backend.close()


def test_a_gangs_logs_are_hinted_before_its_intents_are_built_and_committed(tmp_path, monkeypatch) -> None:
    """The start hint (``Backend.prepare_start``, issue 38 item 8): a start of ``EARLY_HINT``
    instances or more has its log files hinted to the backend as soon as it is due, before its
    launch specs are built and its intents committed, so the local agent creates them on the core
    the pass leaves idle; smaller starts are hinted together before the commit. A hint runs
    nothing: a pass that fails after it commits nothing and spawns nothing (the hinted logs stay
    empty), and the next pass starts each replica exactly once."""
    from trainmaster.controller.controller import EARLY_HINT, Controller

    h = Harness(tmp_path)
    marks = tmp_path / "marks"
    marks.mkdir()
    command = ["/bin/sh", "-c", f"echo $$ >> {marks}/$TM_ROLE-$TM_REPLICA_INDEX; exec sleep 30"]
    gang = h.submit(job("gang", [{"name": "g", "replicas": EARLY_HINT, "command": command}]))
    small = h.submit(job("small", [{"name": "s", "replicas": 1, "command": command}]))
    seen: list[tuple[str, list[str], int]] = []  # (call, log files, intents committed by then)

    def committed() -> int:  # as another connection sees the store: only what was committed
        with h.sessions() as session:
            rows = session.scalars(select(InstanceRow).where(InstanceRow.state == "starting")).all()
            return len(rows)

    real_hint, real_prepare = h.backend.prepare_start, Controller._prepare
    monkeypatch.setattr(
        h.backend, "prepare_start", lambda logs: (seen.append(("hint", logs, committed())), real_hint(logs))
    )

    def prepare(self, job_row, *args):  # type: ignore[no-untyped-def]
        seen.append(("spec", [], committed()))
        if job_row.id == small:
            raise RuntimeError("injected failure")
        return real_prepare(self, job_row, *args)

    monkeypatch.setattr(Controller, "_prepare", prepare)
    with pytest.raises(RuntimeError, match="injected"):
        h.controller.step()
    gang_logs = [str(tmp_path / "runs" / f"{gang}-gang" / "logs" / f"g-{n}.log") for n in range(EARLY_HINT)]
    assert seen[0] == ("hint", gang_logs, 0)  # before the gang's first launch spec
    assert [call for call, _, _ in seen[1:]] == ["spec"] * EARLY_HINT + ["spec"]  # the small job's failed
    assert [h.status(i)["state"] for i in (gang, small)] == ["pending", "pending"]
    assert committed() == 0
    h.backend.agent.ping()  # the agent has taken the hint (requests on one connection are answered in order)
    assert all(not Path(p).exists() or Path(p).stat().st_size == 0 for p in gang_logs)
    assert list(marks.iterdir()) == []

    seen.clear()
    monkeypatch.setattr(Controller, "_prepare", real_prepare)
    real_start = h.backend.start
    monkeypatch.setattr(
        h.backend, "start", lambda requests: (seen.append(("start", [], committed())), real_start(requests))[1]
    )
    h.controller.step()
    small_logs = [str(tmp_path / "runs" / f"{small}-small" / "logs" / "s-0.log")]
    assert seen == [("hint", gang_logs, 0), ("hint", small_logs, 0), ("start", [], EARLY_HINT + 1)]
    assert [h.status(i)["state"] for i in (gang, small)] == ["running", "running"]
    for i in (gang, small):
        h.controller.cancel(i)
        assert h.controller.run_job(i) == "cancelled"
    assert sorted(p.name for p in marks.iterdir()) == sorted([f"g-{n}" for n in range(EARLY_HINT)] + ["s-0"])
    assert all(len(p.read_text().split()) == 1 for p in marks.iterdir())  # each started once
