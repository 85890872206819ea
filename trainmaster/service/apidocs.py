"""``/docs``: the API's interactive reference (swagger-ui), served entirely from this origin.

swagger-ui's files come from the ``fastapi-offline`` package (swagger-ui 5, which renders the
OpenAPI 3.1 document FastAPI writes), mounted at ``/static/swagger-ui/``; the page's start-up
script is a file of the dashboard's static folder, so the Content-Security-Policy's
``script-src 'self'`` holds on this page too. No script is loaded from a CDN into the origin
that holds the dashboard's cookie.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/static/swagger-ui"

PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>{title} - API</title>
  <link rel="stylesheet" href="{assets}/swagger-ui.css">
  <link rel="icon" href="{assets}/favicon.png">
</head>
<body>
  <div id="swagger-ui" data-openapi-url="{openapi}"></div>
  <script src="{assets}/swagger-ui-bundle.js"></script>
  <script src="/static/swagger-init.js"></script>
</body>
</html>
"""


def assets_folder() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def mount_api_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and swagger-ui's files on ``app`` (created with ``docs_url=None``)."""
    app.mount(ASSETS_URL, StaticFiles(directory=str(assets_folder())), name="swagger-ui")
    page = PAGE.format(title=app.title, assets=ASSETS_URL, openapi=app.openapi_url or "/openapi.json")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(page)
