"""Mechanism: the per-route request latency histogram of ``/metrics``
(``trainmaster_http_request_duration_seconds`` by route template and method, and
``trainmaster_http_requests`` by status class), read over a real socket from a real server;
the API process's garbage collection pauses by generation (``trainmaster_gc_pause_seconds``)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from api_server import ThreadedServer
from controller_harness import job
from server_process import ServerProcess


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric's samples in a Prometheus text answer."""
    found = {}
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def test_requests_are_timed_by_route_template_method_and_status(tmp_path: Path) -> None:
    with ThreadedServer(tmp_path, reconcile=False) as url, httpx.Client(base_url=url, timeout=30) as client:
        before = client.get("/metrics").text
        assert client.post("/api/v1/jobs", json=job("m1", [{"name": "w", "command": ["true"]}])).status_code == 201
        for ref in ("m1", "1", "no-such-job"):  # two found, one 404: one route template for all three
            client.get(f"/api/v1/jobs/{ref}")
        for _ in range(3):
            assert client.get("/api/v1/jobs", params={"queue": "default", "limit": 10}).status_code == 200
        assert client.get("/no/such/path/7").status_code == 404
        assert client.request("PROPFIND", "/api/v1/jobs").status_code == 415  # refused before any route
        text = client.get("/metrics").text

    def grown(name: str, labels: str) -> float:
        return samples(text, name).get(labels, 0.0) - samples(before, name).get(labels, 0.0)

    hist = "trainmaster_http_request_duration_seconds"
    assert grown(f"{hist}_count", 'method="GET",route="/api/v1/jobs/{ref}"') == 3
    assert grown(f"{hist}_count", 'method="GET",route="/api/v1/jobs"') == 3
    assert grown(f"{hist}_count", 'method="POST",route="/api/v1/jobs"') == 1
    assert grown(f"{hist}_count", 'method="GET",route="<unmatched>"') == 1  # a path is never a label
    assert grown(f"{hist}_count", 'method="OTHER",route="<unmatched>"') == 1  # nor an unknown method; refusals count
    assert not any(
        "m1" in labels or "no-such-job" in labels or "PROPFIND" in labels for labels in samples(text, hist + "_count")
    )
    # the buckets are cumulative and end with every request; the time is a real, positive duration
    buckets = {
        labels: value
        for labels, value in samples(text, f"{hist}_bucket").items()
        if labels.endswith(',method="GET",route="/api/v1/jobs"')
    }
    bounds = sorted(buckets, key=lambda labels: float(re.search(r'le="([^"]+)"', labels).group(1)))  # type: ignore[union-attr]
    counts = [buckets[b] for b in bounds]
    assert (
        counts == sorted(counts) and counts[-1] == samples(text, f"{hist}_count")['method="GET",route="/api/v1/jobs"']
    )
    assert samples(text, f"{hist}_sum")['method="GET",route="/api/v1/jobs"'] > 0
    requests = "trainmaster_http_requests_total"
    assert grown(requests, 'method="GET",route="/api/v1/jobs/{ref}",status="2xx"') == 2
    assert grown(requests, 'method="GET",route="/api/v1/jobs/{ref}",status="4xx"') == 1
    assert grown(requests, 'method="POST",route="/api/v1/jobs",status="2xx"') == 1


def test_each_answer_says_its_server_time(tmp_path: Path) -> None:
    with ThreadedServer(tmp_path, reconcile=False) as url:
        answer = httpx.get(url + "/api/v1/jobs", params={"limit": 5}, timeout=30)
        refused = httpx.get(url + "/api/v1/jobs", params={"limit": 0}, timeout=30)
    for reply in (answer, refused):
        match = re.fullmatch(r"app;dur=(\d+\.\d\d)", reply.headers["server-timing"])
        assert match and 0 < float(match.group(1)) < 30_000, reply.headers


def test_the_servers_listener_turns_nagle_off_on_each_connection() -> None:
    """The listener `trainmaster server` binds gives asyncio's transports TCP sockets they set
    TCP_NODELAY on: with Nagle's algorithm on, an answer's body waited for the client's delayed
    ACK of its headers (~40 ms a request on a kept-alive connection, outside the server's time)."""
    import asyncio
    import socket

    from trainmaster.cli.server import _bind

    listener = _bind("127.0.0.1", 0)
    seen: list[int] = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Record, sock=listener)
        async with server:
            port = listener.getsockname()[1]
            _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.05)
            writer.close()

    asyncio.run(accept_one())
    assert seen and seen[0] != 0, "the accepted connection kept Nagle's algorithm on"


def test_the_servers_garbage_collections_are_timed_by_generation(tmp_path: Path) -> None:
    """``trainmaster server`` times each collection of its API process after start-up: while one
    runs no request is read, and the client sees a wait the server's own time does not have."""
    server = ServerProcess(tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for n in range(20):  # allocations: young collections at least
                client.post("/api/v1/jobs", json=job(f"gc{n}", [{"name": "w", "command": ["true"]}]))
                client.get("/api/v1/jobs", params={"limit": 100})
            text = client.get("/metrics").text
    finally:
        server.stop()
    counts = samples(text, "trainmaster_gc_pause_seconds_count")
    assert set(counts) == {f'generation="{g}"' for g in range(3)}, counts
    assert counts['generation="0"'] > 0
    sums = samples(text, "trainmaster_gc_pause_seconds_sum")
    assert 0 < sums['generation="0"'] < counts['generation="0"']  # real pauses, well under a second each
