"""What every request of the controller service passes before any route, and what every answer carries.

Three rules, in one ASGI middleware placed outermost (so even a refusal gets the headers):

- **Host** (DNS rebinding): a page on ``attacker.example`` whose name the attacker re-points at
  127.0.0.1 reaches a loopback server as a "same-origin" page; its requests name the attacker's
  host in ``Host``. The service answers only the names it serves (:class:`ServedHosts`): IP
  literals (a rebinding needs a name the attacker controls), ``localhost`` and ``*.localhost``
  (browsers resolve them to loopback themselves), this machine's host names, the ``--host`` it
  listens on, and the names the operator adds (``--allow-host``).
- **State changes of the REST API** (CSRF): a cross-site form or a ``no-cors`` fetch can send a
  POST, but only with a "simple" content type (form, multipart, text/plain) and without an
  ``Authorization`` header. Every ``/api/`` request other than GET/HEAD must therefore say
  ``Content-Type: application/json``, which a browser sends cross-origin only after a CORS
  preflight this service never grants, and a request whose ``Origin`` names another origin is
  refused outright. (With a token, REST state changes also need the bearer header: the browser's
  cookie authenticates reads and the dashboard's own CSRF-protected actions only, see
  :mod:`trainmaster.service.dashboard.access`.)
- **Headers**: the pages cannot be framed (``X-Frame-Options: DENY`` and CSP
  ``frame-ancestors 'none'``: no click-jacking of Cancel), scripts come from this origin only,
  responses are not content-sniffed (``nosniff``), no URL leaks in a ``Referer``, and other
  origins cannot embed the answers (``Cross-Origin-Resource-Policy``).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

#: Scripts, styles, fonts and images from this origin only (htmx, Chart.js and swagger-ui ship in
#: the package); inline styles stay allowed for the charts' and swagger-ui's element styles.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


def split_host(value: str) -> tuple[str, str]:
    """``(host, port)`` of a ``Host`` header (``name:port``, ``[v6]:port``, or without a port);
    the host lower-cased, without brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest.removeprefix(":")
    if value.count(":") > 1:  # a bare IPv6 literal (not valid in Host, but unambiguous)
        return value, ""
    host, _, port = value.partition(":")
    return host.rstrip("."), port


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ServedHosts:
    """The host names this server answers to (besides IP literals and ``localhost``)."""

    names: frozenset[str] = frozenset()
    any_host: bool = False  # ``--allow-host '*'``: behind a proxy that checks Host itself

    @classmethod
    def for_listener(cls, listen_host: str, extra: list[str] | tuple[str, ...] = ()) -> ServedHosts:
        """The names a server listening on ``listen_host`` serves: that address (when it is a
        name), this machine's names and ``extra`` (the operator's ``--allow-host``)."""
        names = {n.lower().rstrip(".") for n in extra if n and n != "*"}
        if listen_host and not is_ip_literal(listen_host.strip("[]")):
            names.add(listen_host.lower().rstrip("."))
        for name in _machine_names():
            names.add(name)
        return cls(frozenset(names), any_host="*" in extra)

    def allows(self, host_header: str | None) -> bool:
        if self.any_host:
            return True
        if not host_header:
            return False
        host, port = split_host(host_header)
        if port and not port.isdigit():
            return False
        if is_ip_literal(host) or host == "localhost" or host.endswith(".localhost"):
            return True
        return host in self.names


def _machine_names() -> set[str]:
    """This machine's own names: an attacker cannot point them at another address."""
    names: set[str] = set()
    try:
        hostname = socket.gethostname()
    except OSError:
        return names
    if hostname:
        names.add(hostname.lower())
        try:
            names.add(socket.getfqdn(hostname).lower())
        except OSError:
            pass
    return {n.rstrip(".") for n in names if n}


def origin_matches(origin: str, host_header: str) -> bool:
    """Whether an ``Origin`` header names the origin the request was sent to."""
    if origin == "null":
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    return split_host(parts.netloc) == split_host(host_header) or _default_port(parts.scheme, origin, host_header)


def _default_port(scheme: str, origin: str, host_header: str) -> bool:
    """``http://h`` and ``Host: h:80`` are one origin."""
    o_host, o_port = split_host(urlsplit(origin).netloc)
    h_host, h_port = split_host(host_header)
    default = "443" if scheme == "https" else "80"
    return o_host == h_host and (o_port or default) == (h_port or default)


class RequestGuard:
    """ASGI middleware enforcing the module's three rules."""

    def __init__(self, app: ASGIApp, hosts: ServedHosts):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        host = headers.get("host")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if not self.hosts.allows(host):
            shown = (host or "(none)")[:100]
            await refuse(
                send_with_headers,
                400,
                f"this server does not answer to the host name {shown!r} (a page served under another name "
                "may be trying DNS rebinding); open it by an address or a name it serves, or start it with "
                "--allow-host NAME",
            )
            return
        method = scope.get("method", "GET").upper()
        if scope.get("path", "").startswith("/api/") and method not in SAFE_METHODS:
            origin = headers.get("origin")
            if origin is not None and not origin_matches(origin, host or ""):
                await refuse(
                    send_with_headers,
                    403,
                    f"cross-origin request from {origin[:100]!r} refused: the API takes "
                    "state changes from its own origin and from non-browser clients only",
                )
                return
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                await refuse(
                    send_with_headers,
                    415,
                    f"{method} {scope.get('path', '')[:100]} needs 'Content-Type: application/json' (send a JSON "
                    "body, {} when there is nothing to say); a browser form or a no-cors fetch from another "
                    "site cannot send it, which is what keeps them from acting here",
                )
                return
        await self.app(scope, receive, send_with_headers)


async def refuse(send: Send, status: int, message: str) -> None:
    payload = json.dumps({"error": message, "details": []}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
