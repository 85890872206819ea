"""How the service answers what went wrong: user mistakes with their field paths (422), unknown
references (404), conflicts (409), quotas (429), the store away (503); an unexpected exception is
logged and answered 500 without internals, the last line of defence only. A browser's page
request gets the dashboard's error page instead of JSON."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError

from trainmaster.client import JobNotFound
from trainmaster.errors import JobConflict
from trainmaster.errors import UserError
from trainmaster.service.dashboard.errors import error_page
from trainmaster.service.quotas import OverQuota
from trainmaster.spec.validate import field_path

log = logging.getLogger("trainmaster.service")


def install_error_handlers(app: FastAPI) -> None:
    """Register the service's exception handlers on ``app``."""

    @app.exception_handler(OperationalError)
    def _store_down(_request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("store unreachable: %s", exc.orig or exc)
        return JSONResponse(
            status_code=503,
            headers={"Retry-After": "2"},
            content={"error": "the store (database) is unreachable right now; retry shortly"},
        )

    @app.exception_handler(JobNotFound)
    def _not_found(_request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": exc.message})

    @app.exception_handler(JobConflict)
    def _conflict(_request: Request, exc: JobConflict) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": exc.message})

    @app.exception_handler(OverQuota)
    def _over_quota(_request: Request, exc: OverQuota) -> JSONResponse:
        return JSONResponse(
            status_code=429, headers={"Retry-After": "30"}, content={"error": exc.message, "details": exc.details}
        )

    @app.exception_handler(UserError)
    def _user_error(_request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": exc.message, "details": exc.details})

    @app.exception_handler(RequestValidationError)
    def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        details = [f"{field_path(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in exc.errors()]
        page = error_page(request, 422, details)  # a browser's page request: the dashboard's error page
        if page is not None:
            return page
        return JSONResponse(
            status_code=422, content={"error": f"invalid request to {request.url.path}", "details": details}
        )

    @app.exception_handler(Exception)
    def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
        page = error_page(request, 500, ["internal error; the server's log has the details"])
        if page is not None:
            return page
        return JSONResponse(
            status_code=500, content={"error": "internal error; the server's log has the details", "details": []}
        )
