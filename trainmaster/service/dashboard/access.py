"""Who may use the API and the dashboard, and protection of the dashboard's actions.

On loopback the service may run open (as Ray's dashboard does by default). Bound to any other
address it requires a token, given as ``Authorization: Bearer <token>`` (the CLI, scripts) or
once in the browser through ``/login?token=<token>``, which sets an HttpOnly, SameSite=Strict
cookie. The cookie authenticates reads and the dashboard's own actions only, never a state
change of the REST API: SameSite counts every port of a host as the same site, so a page on
another loopback port would send it along. Every state-changing dashboard request also carries a
CSRF token derived from a per-server secret (another origin cannot read it from the page).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "tm_token"
CSRF_HEADER = "x-csrf-token"
OPEN_PATHS = ("/login", "/healthz", "/static/")


@dataclass(frozen=True)
class AccessOptions:
    """``token``: required on every request when set. ``secret``: signs CSRF tokens."""

    token: str | None = None
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def csrf_token(self) -> str:
        return hmac.new(self.secret, b"dashboard-csrf", hashlib.sha256).hexdigest()

    def csrf_ok(self, request: Request) -> bool:
        return hmac.compare_digest(request.headers.get(CSRF_HEADER, ""), self.csrf_token())

    def authorised(self, request: Request) -> bool:
        if self.token is None:
            return True
        bearer = request.headers.get("authorization", "")
        given = bearer.removeprefix("Bearer ").strip() if bearer.startswith("Bearer ") else ""
        if not given and cookie_counts(request.method, request.url.path):
            given = request.cookies.get(COOKIE, "")
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())


def cookie_counts(method: str, path: str) -> bool:
    """Whether the browser's cookie may authenticate this request: any read, and the dashboard's
    actions (``/ui/``, which need the page's CSRF token besides); never a REST state change."""
    return method.upper() in ("GET", "HEAD") or path.startswith("/ui/")


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable only from this machine (``::ffff:127.0.0.1``, the
    IPv4 loopback mapped into IPv6, is)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


class TokenMiddleware:
    """Refuses (401) any request without the token, except the login page, health and assets.

    A plain ASGI middleware, not a ``BaseHTTPMiddleware``: that one runs every request's app in
    a task of its own behind memory streams, an overhead each API call paid (a fifth of the
    event loop's time under a scale test's load) for a check that only reads headers."""

    def __init__(self, app: ASGIApp, options: AccessOptions):
        self.app = app
        self.options = options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.options.token is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if self.options.authorised(request) or request.url.path.startswith(OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        refusal: Response
        if request.headers.get("accept", "").startswith("text/html"):
            refusal = PlainTextResponse(
                "401: this Trainmaster server needs its token: open /login?token=...", status_code=401
            )
        else:
            refusal = JSONResponse(
                {"error": "missing or wrong token: send 'Authorization: Bearer <token>'"}, status_code=401
            )
        await refusal(scope, receive, send)


def login(request: Request, options: AccessOptions, token: str) -> Response:
    """Trade a correct token for the session cookie, then go to the job list."""
    if options.token is None:
        return RedirectResponse("/", status_code=303)
    if not hmac.compare_digest(token.encode(), options.token.encode()):
        return PlainTextResponse("401: wrong token", status_code=401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response
