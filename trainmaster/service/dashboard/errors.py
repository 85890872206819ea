"""Error pages for browsers: a page a person reads, where the REST API answers JSON.

A request is a browser's page request when it asks for HTML (``Accept: text/html``), is not
an htmx fragment request, and is not under ``/api/``: such a request that fails (an unknown job,
a malformed address, a server error) gets the dashboard's layout with what went wrong and where
to go, with the same status code; API clients keep the JSON answers.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

HINTS = {
    404: "Jobs are found by name, id or uid, as the command line takes them (`trainmaster job list` lists them).",
    422: "The address has a value the dashboard cannot use; start again from the list of jobs.",
    500: "The server's log has the details; the list of jobs may still answer.",
}


def wants_page(request: Request) -> bool:
    """Whether the failing request came from a browser showing a page (not the API, not htmx)."""
    return (
        request.method in ("GET", "HEAD")
        and not request.url.path.startswith("/api/")
        and "hx-request" not in request.headers
        and "text/html" in request.headers.get("accept", "")
    )


def error_page(request: Request, status: int, problems: list[str]) -> HTMLResponse | None:
    """The error page for ``request`` if a browser showing a page made it, else None."""
    templates: Jinja2Templates | None = getattr(request.app.state, "dashboard_templates", None)
    if templates is None or not wants_page(request):
        return None
    title = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    context = {"status": status, "title": title, "problems": problems, "hint": HINTS.get(status, "")}
    return templates.TemplateResponse(request, "error.html", context, status_code=status)


def install_error_pages(app: FastAPI, templates: Jinja2Templates) -> None:
    """HTML for browsers' failing page requests (unknown paths and jobs, HTTP errors of the
    dashboard's routes); the service's own handlers ask :func:`error_page` for the rest."""
    app.state.dashboard_templates = templates

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        page = error_page(request, exc.status_code, [str(exc.detail)])
        return page if page is not None else await http_exception_handler(request, exc)
