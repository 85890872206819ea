"""Request latency by route, for ``/metrics``: how long the server took to answer each request,
as a Prometheus histogram labelled by the route's template (``/api/v1/jobs/{ref}``, never the
job's name) and the method, as the field's servers export it (the Kubernetes API server's
``apiserver_request_duration_seconds``, the FastAPI instrumentators' ``http_request_duration_seconds``).

The time runs from the moment the application is handed the request to the moment it starts
its answer (``http.response.start``): for a JSON answer, the route, the store's reads and the
serialisation; for a watch (a stream), the time to open it, not how long it lasts. What comes
before (the socket, the HTTP parser and the event loop's queue) is not in it, so a client that
sees a slower answer than this histogram waited in the network, the event loop or itself.

Each answer also says its own time in a ``Server-Timing: app;dur=MS`` header (the W3C header
browsers' tools show), so a client can tell, request by request, the server's part of what it saw.

Labels are bounded: a path no route matches is ``route="<unmatched>"`` and a method the API does
not use is ``method="OTHER"``, so no client can grow the series without limit.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from trainmaster.controller.metrics import REGISTRY
from trainmaster.service.limits import ASGIApp, Message, Receive, Scope, Send

#: Fine around the API's 100 ms goal, so a 99th percentile can be read from the buckets.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "<unmatched>"

REQUEST_SECONDS = Histogram(
    "trainmaster_http_request_duration_seconds",
    "Seconds from a request reaching the application to the start of its answer, by route template and method",
    ["method", "route"],
    registry=REGISTRY,
    buckets=BUCKETS,
)
REQUESTS = Counter(
    "trainmaster_http_requests",
    "Requests answered, by route template, method and status class (2xx, 4xx, 5xx...)",
    ["method", "route", "status"],
    registry=REGISTRY,
)


class RequestTiming:
    """ASGI middleware: observe each HTTP request's time to answer in :data:`REQUEST_SECONDS`
    and tell it in the answer's ``Server-Timing`` header."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        observed = False

        def observe(status: int) -> float:
            nonlocal observed
            seconds = time.perf_counter() - began
            if not observed:
                observed = True
                method = scope["method"] if scope["method"] in METHODS else "OTHER"
                route = route_of(scope)
                REQUEST_SECONDS.labels(method=method, route=route).observe(seconds)
                REQUESTS.labels(method=method, route=route, status=f"{status // 100}xx").inc()
            return seconds

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seconds = observe(int(message["status"]))
                timing = (b"server-timing", f"app;dur={1000 * seconds:.2f}".encode())
                message = {**message, "headers": [*message.get("headers", []), timing]}
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        except BaseException:
            observe(500)  # the server's last handler answers 500 for what escaped the routes
            raise


def route_of(scope: Scope) -> str:
    """The template of the route that served the request (the routers leave it in the scope),
    or :data:`UNMATCHED`."""
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED
