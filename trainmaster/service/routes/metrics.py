"""``/metrics``: job counts by state, leadership and the metrics live jobs' roles report, for
Prometheus."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from trainmaster.controller import metrics
from trainmaster.service.state import service_of
from trainmaster.store import repository as repo

router = APIRouter()


@router.get("/metrics")
def prometheus(request: Request) -> PlainTextResponse:
    service = service_of(request)
    with service.controller.sessions() as session:
        counts = repo.state_counts(session)
        latest = repo.latest_metrics_of_live_jobs(session)
    for state in ("pending", "starting", "running", "succeeded", "failed", "cancelled"):
        metrics.JOBS.labels(state=state).set(counts.get(state, 0))
    metrics.LEADING.set(1 if service.leadership()["leading"] else 0)
    metrics.REPORTED.clear()  # only live jobs' points: ended jobs' series go away
    for (job, role, index, name), value in latest.items():
        metrics.REPORTED.labels(job=job, role=role, index=str(index), metric=name).set(value)
    elsewhere = service.reconciler.families()  # the controller process's pass durations, launches...
    served = _Families(metrics.REGISTRY, elsewhere) if elsewhere else metrics.REGISTRY
    return PlainTextResponse(generate_latest(served).decode(), media_type="text/plain; version=0.0.4")  # type: ignore[arg-type]


class _Families:
    """This process's families, those the controller process recorded in place of their (unused) copies here."""

    def __init__(self, registry: CollectorRegistry, elsewhere: list[Metric]):
        self.registry, self.elsewhere = registry, elsewhere

    def collect(self) -> Iterator[Metric]:
        names = {family.name for family in self.elsewhere}
        yield from (family for family in self.registry.collect() if family.name not in names)
        yield from self.elsewhere
