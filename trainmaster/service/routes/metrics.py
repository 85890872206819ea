"""``/metrics``: job counts by state, leadership and the metrics live jobs' roles report, for
Prometheus."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest

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
    metrics.LEADING.set(1 if service.elector is None or service.elector.leading else 0)
    metrics.REPORTED.clear()  # only live jobs' points: ended jobs' series go away
    for (job, role, index, name), value in latest.items():
        metrics.REPORTED.labels(job=job, role=role, index=str(index), metric=name).set(value)
    return PlainTextResponse(generate_latest(metrics.REGISTRY).decode(), media_type="text/plain; version=0.0.4")
