"""Mechanisms: queue quotas in the reconcile pass, with real processes on the local backend and
the events each rule writes: a job waits for its queue's nominal quota (WaitingForQuota, saying
by how much) and its status and `job explain` say so with its position; a queue borrows its
cohort's unused quota; a higher-priority job preempts a lower one of its queue; a queue reclaims
quota it lent from a borrower; every victim gets a Preempted event naming the job that took its
place and starts again once quota is back; a job larger than its queue can ever hold waits as
Inadmissible; a queue without quota keeps capacity-and-weight admission."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from controller_harness import Harness, events, job, pids_alive

from trainmaster.backends.base import Resources
from trainmaster.backends.local import LocalBackend
from trainmaster.controller.quota_status import explain, queue_view, queue_views
from trainmaster.spec.queue import QueueSpec
from trainmaster.store import queues as queue_store


@pytest.fixture
def roomy(tmp_path: Path) -> Iterator[Harness]:
    """A controller whose backend offers far more than any queue's quota: quota alone decides."""
    h = Harness(tmp_path, backend=LocalBackend(capacity=Resources(64.0, 1 << 40, 8)))
    yield h
    h.backend.close()


def make_queue(h: Harness, **doc: Any) -> None:
    with h.sessions() as session:
        queue_store.save_queue(session, QueueSpec.model_validate(doc))
        session.commit()


def sleeper(name: str, queue: str, cpu: float, priority: str = "normal", replicas: int = 1) -> dict[str, Any]:
    role = {"name": "w", "replicas": replicas, "command": ["sleep", "60"], "resources": {"cpu": cpu}}
    return job(name, [role], scheduling={"queue": queue, "priorityClass": priority})


def settle(h: Harness, predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        h.controller.step()
        if predicate():
            return
        assert time.monotonic() < deadline, f"waited {timeout}s for the quota rule to act"
        time.sleep(0.1)


def pids(status: dict[str, Any]) -> list[int]:
    return [i["pid"] for i in status["instances"] if i.get("pid") and i["state"] == "running"]


def test_a_job_waits_for_its_queues_nominal_quota_and_says_why(roomy: Harness) -> None:
    """Nominal quota and "why pending": a job beyond the queue's free nominal quota waits
    (WaitingForQuota, one event), its status message and `job explain` name the resource, the
    limit and the shortfall, and its position; it starts once a running job ends."""
    make_queue(roomy, name="team", quota={"cpu": {"nominal": 3}})
    first = roomy.submit(sleeper("first", "team", 2))
    second = roomy.submit(sleeper("second", "team", 2))
    third = roomy.submit(sleeper("third", "team", 2))
    settle(roomy, lambda: roomy.status(first)["state"] == "running")
    roomy.controller.step()
    status = roomy.status(second)
    assert status["state"] == "pending" and status["reason"] == "WaitingForQuota", status
    assert "cpu needs 2, 1 available (nominal 3, in use 2): short by 1" in status["message"]
    assert len(events(status, "WaitingForQuota")) == 1
    with roomy.sessions() as session:
        why = explain(session, "third")
        view = queue_view(session, "team")
    assert why["position"] == 2 and why["waitingInQueue"] == 2 and why["pending"]
    assert why["blocking"][0]["resource"] == "cpu" and why["blocking"][0]["shortBy"] == 1
    assert "position 2 of 2 waiting in queue 'team'" in why["summary"]
    assert view["usage"]["cpu"]["used"] == 2 and view["admitted"] == 1 and view["waiting"] == 2
    assert [w["name"] for w in view["waitingJobs"]] == ["second", "third"]
    roomy.controller.cancel(first)
    settle(roomy, lambda: roomy.status(second)["state"] == "running")
    assert roomy.status(third)["reason"] == "WaitingForQuota"
    for j in (second, third):
        roomy.controller.cancel(j)
    roomy.controller.step()


def test_a_queue_borrows_unused_quota_of_its_cohort_within_its_borrowing_limit(roomy: Harness) -> None:
    """Borrowing: a queue runs beyond its nominal quota on what its cohort leaves unused, up to
    its borrowing limit; `queue list` shows what it borrows."""
    make_queue(roomy, name="a", cohort="org", quota={"cpu": {"nominal": 1, "borrowingLimit": 2}})
    make_queue(roomy, name="b", cohort="org", quota={"cpu": {"nominal": 4}})
    big = roomy.submit(sleeper("big", "a", 3))
    more = roomy.submit(sleeper("more", "a", 1))
    settle(roomy, lambda: roomy.status(big)["state"] == "running")
    roomy.controller.step()
    status = roomy.status(more)
    assert status["reason"] == "WaitingForQuota" and "borrowing limit 2" in status["message"], status["message"]
    with roomy.sessions() as session:
        (a, b) = queue_views(session)
    assert a["usage"]["cpu"]["borrowed"] == 2 and a["share"] == pytest.approx(2 / 5)
    assert b["usage"]["cpu"]["used"] == 0
    for j in (big, more):
        roomy.controller.cancel(j)
    roomy.controller.step()


def test_a_higher_priority_job_preempts_a_lower_one_of_its_queue(roomy: Harness) -> None:
    """Preemption within a queue: a high-priority job that does not fit evicts a lower-priority
    job of its queue: the victim's processes are stopped, it gets a Preempted warning naming the
    job that took its place and waits again; the preemptor records Preempting; once the
    preemptor ends, the victim starts afresh."""
    make_queue(roomy, name="team", quota={"cpu": {"nominal": 2}})
    low = roomy.submit(sleeper("low", "team", 2, priority="low"))
    settle(roomy, lambda: roomy.status(low)["state"] == "running")
    victim_pids = pids(roomy.status(low))
    high = roomy.submit(sleeper("high", "team", 2, priority="high"))
    settle(roomy, lambda: roomy.status(high)["state"] == "running")
    status = roomy.status(low)
    assert status["state"] == "pending" and status["reason"] == "Preempted"
    (preempted,) = events(status, "Preempted")
    assert preempted["type"] == "Warning"
    assert f"preempted by job high (id {high}, priority 100)" in preempted["message"]
    assert "higher priority than this job's -100 in queue 'team'" in preempted["message"]
    assert pids_alive(victim_pids) == []
    (preempting,) = events(roomy.status(high), "Preempting")
    assert f"low (id {low}, queue 'team')" in preempting["message"]
    roomy.controller.cancel(high)
    settle(roomy, lambda: roomy.status(low)["state"] == "running")
    roomy.controller.cancel(low)
    roomy.controller.step()


def test_equal_priority_never_preempts(roomy: Harness) -> None:
    """Preemption within a queue: only strictly lower priority is evicted; an equal one waits."""
    make_queue(roomy, name="team", quota={"cpu": {"nominal": 2}})
    first = roomy.submit(sleeper("first", "team", 2))
    settle(roomy, lambda: roomy.status(first)["state"] == "running")
    second = roomy.submit(sleeper("second", "team", 2))
    for _ in range(3):
        roomy.controller.step()
    assert roomy.status(first)["state"] == "running" and roomy.status(second)["reason"] == "WaitingForQuota"
    for j in (first, second):
        roomy.controller.cancel(j)
    roomy.controller.step()


def test_a_queue_reclaims_quota_it_lent_from_a_borrower(roomy: Harness) -> None:
    """Reclaim within the cohort: queue b borrows a's idle quota; a job of a within a's nominal
    quota then evicts b's borrowing job (whatever its priority), whose Preempted event names the
    reclaiming job; b's job within b's own nominal quota is left alone."""
    make_queue(roomy, name="a", cohort="org", quota={"cpu": {"nominal": 2}})
    make_queue(roomy, name="b", cohort="org", quota={"cpu": {"nominal": 2}})
    own = roomy.submit(sleeper("b-own", "b", 2, priority="critical"))
    settle(roomy, lambda: roomy.status(own)["state"] == "running")
    borrower = roomy.submit(sleeper("b-borrower", "b", 2, priority="critical"))
    settle(roomy, lambda: roomy.status(borrower)["state"] == "running")
    reclaimer = roomy.submit(sleeper("a-job", "a", 2, priority="low"))
    settle(roomy, lambda: roomy.status(reclaimer)["state"] == "running")
    status = roomy.status(borrower)
    assert status["reason"] == "Preempted", status
    (preempted,) = events(status, "Preempted")
    assert f"preempted by job a-job (id {reclaimer}) of queue 'a', which reclaims the quota" in preempted["message"]
    assert "queue 'b' borrowed from it in cohort 'org'" in preempted["message"]
    assert roomy.status(own)["state"] == "running" and not events(roomy.status(own), "Preempted")
    roomy.controller.step()
    assert roomy.status(borrower)["reason"] == "WaitingForQuota"  # no thrash: it waits now
    for j in (own, borrower, reclaimer):
        roomy.controller.cancel(j)
    roomy.controller.step()


def test_a_job_larger_than_its_queue_waits_as_inadmissible(roomy: Harness) -> None:
    """Nominal quota: a job no state of the cohort could admit waits as Inadmissible and says what
    to change; it is not failed (the queue's quota may be raised)."""
    make_queue(roomy, name="tiny", quota={"cpu": {"nominal": 1}})
    big = roomy.submit(sleeper("big", "tiny", 1, replicas=2))
    roomy.controller.step()
    status = roomy.status(big)
    assert status["state"] == "pending" and status["reason"] == "Inadmissible"
    assert "queue 'tiny' can never admit it: cpu needs 2" in status["message"]
    with roomy.sessions() as session:
        queue_store.save_queue(
            session, QueueSpec.model_validate({"name": "tiny", "quota": {"cpu": {"nominal": 2}}}), replace=True
        )
        session.commit()
    settle(roomy, lambda: roomy.status(big)["state"] == "running")
    roomy.controller.cancel(big)
    roomy.controller.step()


def test_queues_without_quota_keep_capacity_admission(roomy: Harness) -> None:
    """Back-compatible default: with queues with quota in the store, a job of a queue without
    one is admitted by capacity alone, as before."""
    make_queue(roomy, name="team", quota={"cpu": {"nominal": 1}})
    free = roomy.submit(sleeper("free", "default", 8))
    settle(roomy, lambda: roomy.status(free)["state"] == "running")
    roomy.controller.cancel(free)
    roomy.controller.step()


def test_borrowed_quota_is_shared_by_weight(roomy: Harness) -> None:
    """Fair sharing: two queues with no quota of their own borrow a lender's 6 cpus; the one of
    weight 2 gets twice the other's (4 and 2) whatever the submission order."""
    make_queue(roomy, name="lender", cohort="org", quota={"cpu": {"nominal": 6}})
    make_queue(roomy, name="heavy", cohort="org", weight=2, quota={"cpu": {"nominal": 0}})
    make_queue(roomy, name="light", cohort="org", quota={"cpu": {"nominal": 0}})
    ids = [roomy.submit(sleeper(f"light-{i}", "light", 1)) for i in range(5)]
    ids += [roomy.submit(sleeper(f"heavy-{i}", "heavy", 1)) for i in range(5)]
    roomy.controller.step()
    with roomy.sessions() as session:
        views = {q["name"]: q for q in queue_views(session)}
    assert (views["heavy"]["admitted"], views["light"]["admitted"]) == (4, 2)
    assert views["heavy"]["share"] == pytest.approx(views["light"]["share"])  # 4/6/2 == 2/6/1
    for j in ids:
        roomy.controller.cancel(j)
    roomy.controller.step()


def test_a_new_controller_over_the_store_keeps_quota_and_preemption_state(roomy: Harness, tmp_path: Path) -> None:
    """Recovery: quota usage is read from the store every pass, so a controller started over the
    store after a preemption re-adopts the preemptor, keeps the victim waiting for quota (no
    second eviction, no double admission), and admits it once the preemptor ends."""
    from trainmaster.controller import Controller

    make_queue(roomy, name="team", quota={"cpu": {"nominal": 2}})
    low = roomy.submit(sleeper("low", "team", 2, priority="low"))
    settle(roomy, lambda: roomy.status(low)["state"] == "running")
    high = roomy.submit(sleeper("high", "team", 2, priority="high"))
    settle(roomy, lambda: roomy.status(high)["state"] == "running")
    running = pids(roomy.status(high))
    again = Controller(roomy.sessions, roomy.backend, roomy.url, interval=0.1, grace=2.0, runs_dir=tmp_path / "runs")
    again.recover()
    for _ in range(3):
        again.step()
    assert pids_alive(running) == running and roomy.status(high)["state"] == "running"
    status = roomy.status(low)
    assert status["reason"] == "WaitingForQuota" and len(events(status, "Preempted")) == 1
    again.cancel(high)
    deadline = time.monotonic() + 30
    while roomy.status(low)["state"] != "running":
        assert time.monotonic() < deadline, roomy.status(low)
        again.step()
        time.sleep(0.1)
    again.cancel(low)
    again.step()


def test_a_controller_killed_between_eviction_and_stop_leaves_nothing_running(roomy: Harness, tmp_path: Path) -> None:
    """Preemption and kill -9: the eviction is committed before the victim's processes are
    stopped; a controller that dies in between (simulated: its stop step raises) leaves a
    waiting job with terminating instances, whose processes the next controller stops on
    recovery, then starts the preemptor once; the victim waits for quota."""
    from trainmaster.controller import Controller

    make_queue(roomy, name="team", quota={"cpu": {"nominal": 2}})
    low = roomy.submit(sleeper("low", "team", 2, priority="low"))
    settle(roomy, lambda: roomy.status(low)["state"] == "running")
    victim_pids = pids(roomy.status(low))
    high = roomy.submit(sleeper("high", "team", 2, priority="high"))

    def killed(session: Any) -> None:
        raise RuntimeError("killed after the commit")

    roomy.controller._stop_evicted = killed  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        roomy.controller.step()
    status = roomy.status(low)
    assert status["reason"] == "Preempted" and {i["state"] for i in status["instances"]} == {"terminating"}
    assert pids_alive(victim_pids) == victim_pids  # not stopped yet: the controller "died"
    again = Controller(roomy.sessions, roomy.backend, roomy.url, interval=0.1, grace=2.0, runs_dir=tmp_path / "runs")
    again.recover()
    assert pids_alive(victim_pids) == []
    deadline = time.monotonic() + 30
    while roomy.status(high)["state"] != "running":
        assert time.monotonic() < deadline, roomy.status(high)
        again.step()
        time.sleep(0.1)
    status = roomy.status(low)
    assert status["state"] == "pending" and {i["state"] for i in status["instances"]} == {"stopped"}
    assert [i["attempt"] for i in roomy.status(high)["instances"]] == [1]  # started once
    for j in (high, low):
        again.cancel(j)
    again.step()
