"""The dashboard's queue page: every queue with quota, its usage against its nominal quota,
what it borrows, and its waiting jobs in order with why each waits (``/queues``)."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.controller.quota import amount
from trainmaster.controller.quota_status import queue_view, queue_views

WAITING_ON_PAGE = 20


def add_queue_page(router: APIRouter, sessions: sessionmaker[Session], page: Callable[..., HTMLResponse]) -> None:
    """``GET /queues`` on the dashboard's router (its access guard and error pages apply)."""

    @router.get("/queues", response_class=HTMLResponse)
    def queues(request: Request) -> HTMLResponse:
        with sessions() as session:
            listed = queue_views(session)
            details = {q["name"]: queue_view(session, q["name"])["waitingJobs"][:WAITING_ON_PAGE] for q in listed}
        rows: list[dict[str, Any]] = []
        for q in listed:
            rows.append(
                {
                    "name": q["name"],
                    "cohort": q["cohort"] or "",
                    "weight": f"{q['weight']:g}",
                    "share": "-" if q["share"] is None else f"{q['share']:.2f}",
                    "admitted": q["admitted"],
                    "waiting": q["waiting"],
                    "resources": [
                        {
                            "name": r,
                            "used": amount(r, u["used"]),
                            "nominal": amount(r, u["nominal"]),
                            "borrowed": amount(r, u["borrowed"]),
                            "percent": min(100, round(100 * u["used"] / u["nominal"])) if u["nominal"] else 100,
                        }
                        for r, u in q["usage"].items()
                    ],
                    "jobs": details[q["name"]],
                }
            )
        return page(request, "queues.html", queues=rows)
