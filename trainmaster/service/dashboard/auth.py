"""``/login``: trade the server's token for the dashboard's cookie (:mod:`.access`)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from trainmaster.service.dashboard.access import login
from trainmaster.service.dashboard.site import dashboard_of

router = APIRouter(include_in_schema=False)


@router.get("/login")
def login_page(request: Request, token: str = Query("", max_length=512)) -> Response:
    return login(request, dashboard_of(request).access, token)
