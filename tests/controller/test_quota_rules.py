"""Mechanisms: queue quotas as plain rules (:mod:`trainmaster.controller.quota`): nominal quota
per resource, cohorts that lend and borrow within borrowing and lending limits, fair sharing of
borrowed quota by dominant-resource share and weight, preemption of lower-priority jobs within a
queue, and reclaim of lent quota from borrowers with a minimal set of victims. The controller and
its events are tested in test_quota_controller.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmaster.controller.quota import Holder, QueueQuota, QuotaBook, ResourceQuota
from trainmaster.spec.queue import QueueSpec

GI = float(1 << 30)


def cpu(n: float) -> dict[str, float]:
    return {"cpu": n, "memory": 0.0, "gpu": 0.0}


def queue(
    name: str,
    nominal: float,
    cohort: str | None = "c",
    borrow: float | None = None,
    lend: float | None = None,
    weight: float = 1.0,
) -> QueueQuota:
    return QueueQuota(name, {"cpu": ResourceQuota(nominal, borrow, lend)}, cohort, weight)


def held(job_id: int, q: str, n: float, priority: int = 0) -> Holder:
    return Holder(job_id, f"j{job_id}", q, priority, cpu(n))


def test_nominal_quota_admits_up_to_it_and_says_by_how_much_it_is_short() -> None:
    """Nominal quota: a queue without a cohort admits up to its nominal quota of a resource; the
    shortfall names the resource, the limit and the missing amount."""
    book = QuotaBook({"a": queue("a", 10, cohort=None)}, {1: held(1, "a", 8)})
    assert book.fits("a", cpu(2))
    (short,) = book.shortfalls("a", cpu(3))
    assert (short.resource, short.limit, short.needed, short.available, short.short_by) == (
        "cpu",
        "nominal quota",
        3,
        2,
        1,
    )
    assert "short by 1" in short.describe() and "nominal 10" in short.describe()


def test_resources_a_queue_does_not_name_are_not_limited_by_it() -> None:
    """Nominal quota: only the resources the queue names are counted (memory here is free)."""
    book = QuotaBook({"a": queue("a", 4, cohort=None)})
    assert book.fits("a", {"cpu": 4, "memory": 512 * GI, "gpu": 8})
    assert not book.fits("a", {"cpu": 5, "memory": 0, "gpu": 0})


def test_a_queue_borrows_what_its_cohort_leaves_unused() -> None:
    """Borrowing: a queue may use its cohort's unused nominal quota beyond its own."""
    book = QuotaBook({"a": queue("a", 10), "b": queue("b", 10)}, {1: held(1, "b", 4)})
    assert book.fits("a", cpu(16))  # its 10 and 6 of b's
    (short,) = book.shortfalls("a", cpu(17))
    assert short.limit == "cohort" and short.short_by == pytest.approx(1)
    assert "cohort 'c' has 16 unused of 20 lent" in short.describe()


def test_borrowing_limit_caps_what_a_queue_uses_beyond_nominal() -> None:
    """Borrowing limit: at most nominal + borrowingLimit, whatever the cohort leaves unused."""
    book = QuotaBook({"a": queue("a", 10, borrow=3), "b": queue("b", 10)})
    assert book.fits("a", cpu(13))
    (short,) = book.shortfalls("a", cpu(14))
    assert short.limit == "borrowing limit" and short.short_by == pytest.approx(1)


def test_lending_limit_keeps_part_of_the_nominal_quota_for_its_owner() -> None:
    """Lending limit: a queue lends at most lendingLimit of its unused nominal quota; the rest
    stays its own even while idle."""
    book = QuotaBook({"a": queue("a", 10), "b": queue("b", 10, lend=4)})
    assert book.fits("a", cpu(14))
    assert not book.fits("a", cpu(15))


def test_lending_limit_guarantees_the_kept_part_even_when_borrowers_took_the_rest() -> None:
    """Lending limit: with a borrower using all that was lent, the owner still gets its guaranteed part."""
    book = QuotaBook({"a": queue("a", 10), "b": queue("b", 10, lend=4)}, {1: held(1, "a", 14)})
    assert book.fits("b", cpu(6))
    (short,) = book.shortfalls("b", cpu(7))
    assert short.limit == "cohort" and short.short_by == pytest.approx(1)


def test_a_job_larger_than_the_queue_can_ever_hold_is_inadmissible() -> None:
    """Nominal quota and limits: the most a queue may ever use is nominal + borrowing limit,
    within what the cohort lends; a larger job is never admitted (the reason says so)."""
    book = QuotaBook({"a": queue("a", 10, borrow=5), "b": queue("b", 10)})
    assert book.never_fits("a", cpu(15)) == []
    (never,) = book.never_fits("a", cpu(16))
    assert never.available == 15 and "may ever use is 15" in never.describe()
    alone = QuotaBook({"a": queue("a", 10, cohort=None)})
    assert alone.never_fits("a", cpu(11))


def test_fair_sharing_orders_borrowers_by_dominant_resource_share_and_weight() -> None:
    """Fair sharing: the next borrowing admission goes to the queue whose dominant-resource share
    (borrowed / lendable in the cohort, the largest over resources, divided by weight) would be
    lowest after it; a queue of weight 2 gets twice the borrowed quota of one of weight 1."""
    queues = {"a": queue("a", 0, weight=2), "b": queue("b", 0), "lender": queue("lender", 30)}

    @dataclass
    class W:
        id: int
        queue: str
        admitted: bool = False

    jobs = [W(i, "a") for i in range(1, 21)] + [W(i, "b") for i in range(21, 41)]
    book = QuotaBook(queues)
    ordered = book.order(jobs, lambda w: (w.id, 0, cpu(1)))
    first = ordered[:30]  # the 30 that fit the lender's quota
    assert sum(w.queue == "a" for w in first) == 20 and sum(w.queue == "b" for w in first) == 10
    assert sorted(w.id for w in ordered) == list(range(1, 41))  # nobody lost, nobody twice
    shares = QuotaBook(queues, {1: held(1, "a", 3), 2: held(2, "b", 3)})
    assert shares.share("a") == pytest.approx(3 / 30 / 2) and shares.share("b") == pytest.approx(3 / 30)


def test_dominant_share_is_the_largest_over_resources() -> None:
    """Fair sharing: the dominant resource is the one a queue borrows most of, relative to the pool."""
    queues = {
        "a": QueueQuota("a", {"cpu": ResourceQuota(0), "gpu": ResourceQuota(0)}, "c"),
        "l": QueueQuota("l", {"cpu": ResourceQuota(100), "gpu": ResourceQuota(4)}, "c"),
    }
    book = QuotaBook(queues, {1: Holder(1, "j", "a", 0, {"cpu": 10, "memory": 0, "gpu": 2})})
    assert book.share("a") == pytest.approx(0.5)  # gpu 2/4 dominates cpu 10/100


def test_preemption_within_a_queue_takes_lower_priority_jobs_only() -> None:
    """Preemption within a queue: a job that does not fit evicts lower-priority jobs of its own
    queue (lowest priority, then newest, first); equal or higher priority ones are never taken."""
    holders = {1: held(1, "a", 4, priority=0), 2: held(2, "a", 4, priority=-100), 3: held(3, "a", 2, priority=100)}
    book = QuotaBook({"a": queue("a", 10, cohort=None)}, holders)
    plan = book.preemption("a", 100, cpu(4))
    assert plan is not None and [h.id for h in plan.victims] == [2] and not plan.reclaim
    assert book.preemption("a", 0, cpu(4)) is not None  # priority 0 may take the -100 one
    assert book.preemption("a", -100, cpu(4)) is None  # nothing below -100
    assert book.preemption("a", 1000, cpu(11)) is None  # more than the queue can hold at all
    assert book.usage["a"]["cpu"] == 10  # asking changes nothing


def test_preemption_picks_a_minimal_set_of_victims() -> None:
    """Preemption: after taking victims in order until the job fits, any victim whose eviction
    the others already make unnecessary is kept."""
    holders = {1: held(1, "a", 1, priority=-100), 2: held(2, "a", 6, priority=0)}
    book = QuotaBook({"a": queue("a", 7, cohort=None)}, holders)
    plan = book.preemption("a", 100, cpu(6))
    assert plan is not None and [h.id for h in plan.victims] == [
        2
    ]  # the small one would not be enough; alone it is not needed


def test_reclaim_takes_lent_quota_back_from_borrowers_of_any_priority() -> None:
    """Reclaim within the cohort: a job that stays within its queue's nominal quota evicts jobs
    of queues that borrow (any priority), most-borrowing queue first; only queues above their
    nominal quota are touched."""
    queues = {"a": queue("a", 10), "b": queue("b", 10), "c2": queue("c2", 10)}
    holders = {1: held(1, "b", 10, priority=1000), 2: held(2, "b", 8, priority=1000), 3: held(3, "c2", 2)}
    book = QuotaBook(queues, holders)
    assert book.borrowing("b") and not book.borrowing("c2")
    plan = book.preemption("a", -100, cpu(8))
    assert plan is not None and plan.reclaim and [h.id for h in plan.victims] == [2]
    assert book.preemption("a", -100, cpu(11)) is None  # beyond its nominal: no reclaim, and a has nothing of its own


def test_a_borrowing_job_does_not_reclaim() -> None:
    """Reclaim: only a job within its queue's nominal quota takes quota back; one that would
    itself borrow waits (no preemption of other queues to borrow)."""
    queues = {"a": queue("a", 4), "b": queue("b", 10)}
    book = QuotaBook(queues, {1: held(1, "b", 14)})
    assert book.preemption("a", 0, cpu(4)) is not None
    assert book.preemption("a", 0, cpu(5)) is None


def test_jobs_of_another_controller_are_counted_but_never_preempted() -> None:
    """Preemption: a job driven by another controller (a `trainmaster run`) holds quota but is not a victim."""
    holder = Holder(1, "j", "a", -100, cpu(10), preemptible=False)
    book = QuotaBook({"a": queue("a", 10, cohort=None)}, {1: holder})
    assert not book.fits("a", cpu(1)) and book.preemption("a", 100, cpu(1)) is None


def test_a_failed_search_is_remembered_until_usage_changes() -> None:
    """Preemption: a blocked queue of like jobs costs one search per usage change, and a change
    (a job ends) makes the next question searched again."""
    book = QuotaBook({"a": queue("a", 10, cohort=None)}, {1: held(1, "a", 10, priority=100)})
    assert book.preemption("a", 0, cpu(5)) is None
    assert len(book._no_preemption) == 1
    book.release_job(1)
    book.hold(held(2, "a", 10, priority=-100))
    assert book.preemption("a", 0, cpu(5)) is not None


@settings(max_examples=200, deadline=None)
@given(
    nominals=st.lists(st.integers(0, 20), min_size=2, max_size=4),
    jobs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8), st.integers(-1, 1)), max_size=30),
)
def test_admitting_by_the_rules_never_breaks_a_limit(nominals: list[int], jobs: list[tuple[int, int, int]]) -> None:
    """Nominal quota, borrowing and preemption together: admitting job after job (preempting
    where the rules allow) never puts a queue beyond nominal + borrowing limit, nor the cohort
    beyond its total nominal quota, and a queue within nominal always fits after reclaim."""
    queues = {f"q{i}": queue(f"q{i}", n, borrow=5) for i, n in enumerate(nominals)}
    book = QuotaBook(queues)
    for job_id, (qi, size, priority) in enumerate(jobs):
        name = f"q{qi % len(nominals)}"
        demand = cpu(size)
        if not book.fits(name, demand):
            plan = book.preemption(name, priority, demand)
            if plan is None:
                continue
            for victim in plan.victims:
                book.release(victim)
            assert book.fits(name, demand)
        book.hold(held(job_id, name, size, priority))
        for q, quota in queues.items():
            assert book.usage[q]["cpu"] <= quota.resources["cpu"].nominal + 5 + 1e-9
        assert sum(book.usage[q]["cpu"] for q in queues) <= sum(nominals) + 1e-9


def test_queue_spec_validates_amounts_and_limits() -> None:
    """Queue objects: quantities per resource (memory as 64Gi), limits only with a cohort, a
    lending limit within the nominal quota; each mistake named."""
    spec = QueueSpec.model_validate(
        {
            "name": "team-a",
            "cohort": "org",
            "quota": {"cpu": {"nominal": 20, "borrowingLimit": 100}, "memory": {"nominal": "64Gi"}},
        }
    )
    assert spec.amounts()["memory"]["nominal"] == 64 * GI and spec.amounts()["cpu"]["borrowingLimit"] == 100
    bad = [
        {"name": "a", "quota": {}},
        {"name": "a", "quota": {"cpu": {"nominal": -1}}},
        {"name": "a", "quota": {"gpu": {"nominal": 1.5}}},
        {"name": "a", "quota": {"memory": {"nominal": "lots"}}},
        {"name": "a", "quota": {"cpu": {"nominal": 4, "borrowingLimit": 2}}},  # no cohort
        {"name": "a", "cohort": "c", "quota": {"cpu": {"nominal": 4, "lendingLimit": 5}}},
        {"name": "A_b", "quota": {"cpu": {"nominal": 4}}},
        {"name": "a", "quota": {"tpu": {"nominal": 4}}},
        {"name": "a", "weight": -1, "quota": {"cpu": {"nominal": 4}}},
    ]
    for doc in bad:
        with pytest.raises(ValueError):
            QueueSpec.model_validate(doc)
