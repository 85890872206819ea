"""The dashboard's live streams (server-sent events) when the server stops or the browser comes
back: both streams end themselves as the server begins to stop, and a followed log resumed with
the browser's Last-Event-ID shows nothing twice."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from api_server import ThreadedServer

from trainmaster.service.draining import Draining

pytestmark = pytest.mark.timeout(90)


def job_doc(trigger: Path) -> dict[str, object]:
    """Prints 'first', then 'second' once ``trigger`` exists (or after 60 s), then idles."""
    program = (
        "import os, time\nprint('first', flush=True)\n"
        f"for _ in range(600):\n    if os.path.exists({str(trigger)!r}): break\n    time.sleep(0.1)\n"
        "print('second', flush=True)\ntime.sleep(60)\n"
    )
    return {"metadata": {"name": "talker"}, "spec": {"roles": [{"name": "main", "command": ["python", "-c", program]}]}}


def test_draining_wakes_a_waiting_stream_and_refuses_new_waits() -> None:
    async def scenario() -> None:
        draining = Draining()
        queue: asyncio.Queue[int] = asyncio.Queue()
        queue.put_nowait(7)
        assert await draining.first(queue.get(), 5) == 7
        assert await draining.first(queue.get(), 0.01) is None and not draining.begun  # a keepalive
        waiting = asyncio.ensure_future(draining.first(queue.get(), 60))
        await asyncio.sleep(0.05)
        draining.begin()
        assert await asyncio.wait_for(waiting, 5) is None and draining.begun
        assert await draining.first(queue.get(), 60) is None  # returns at once once begun

    asyncio.run(scenario())


def read_events(response: httpx.Response, count: int) -> list[dict[str, str]]:
    """The next ``count`` events (comments skipped) of an SSE response, as field -> value."""
    events, fields = [], {}
    for line in response.iter_lines():
        if not line:
            if fields:
                events.append(fields)
                fields = {}
                if len(events) == count:
                    return events
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    raise AssertionError(f"the stream ended after {len(events)} of {count} events")


def test_streams_end_when_the_server_stops_and_a_log_resumes_where_it_was(tmp_path: Path) -> None:
    server = ThreadedServer(tmp_path, reconcile=True)
    ended: list[str] = []

    def follow(path: str, params: dict[str, str]) -> None:  # a tab that stays open
        with httpx.stream("GET", server.url + path, params=params, timeout=httpx.Timeout(10, read=None)) as reply:
            for _ in reply.iter_raw():
                pass
        ended.append(path)

    with server as url:
        trigger = tmp_path / "go"
        job = httpx.post(f"{url}/api/v1/jobs", json=job_doc(trigger), timeout=30).json()["id"]
        log = f"/ui/jobs/{job}/log/stream"
        deadline = time.monotonic() + 60
        while "first" not in httpx.get(f"{url}/ui/jobs/{job}/log", params={"instance": "main-0"}, timeout=10).text:
            assert time.monotonic() < deadline, "the job printed nothing within 60 s"
            time.sleep(0.1)
        with httpx.stream("GET", url + log, params={"instance": "main-0"}, timeout=10) as reply:
            (event,) = read_events(reply, 1)
        assert "first" in event["data"] and event["id"] == str(json.loads(event["data"])["offset"])
        trigger.touch()
        # the browser reconnects to the URL it opened, with the id it saw last: nothing twice
        with httpx.stream(
            "GET", url + log, params={"instance": "main-0", "offset": "0"}, headers={"Last-Event-ID": event["id"]}
        ) as reply:
            (resumed,) = read_events(reply, 1)
        assert json.loads(resumed["data"])["text"] == "second\n"
        bad = httpx.get(url + log, params={"instance": "main-0"}, headers={"Last-Event-ID": "x"}, timeout=10)
        assert bad.status_code == 422

        tabs = [
            threading.Thread(target=follow, args=("/ui/stream", {}), daemon=True),
            threading.Thread(target=follow, args=(log, {"instance": "main-0"}), daemon=True),
        ]
        for tab in tabs:
            tab.start()
        time.sleep(0.5)  # both requests reach their streams' loops
        httpx.post(f"{url}/api/v1/jobs/{job}/cancel", json={}, timeout=30)
    # leaving the block stopped the server: the streams ended (no cancellation: uvicorn's drain is
    # unbounded here, so a stream that did not end would hold the server, failing the exit's check)
    for tab in tabs:
        tab.join(timeout=10)
    assert sorted(ended) == sorted(["/ui/stream", log])
