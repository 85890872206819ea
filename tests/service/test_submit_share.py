"""Mechanism: job submits have a concurrency share of their own in the API process
(:mod:`trainmaster.service.inflight`, as the Kubernetes API server's mutating in-flight limit):
no more than ``MUTATING_INFLIGHT`` are worked on at once, the others wait and all succeed, and
reads are answered while the share is full."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import ThreadedServer
from controller_harness import job
from trainmaster.service import inflight


def test_submits_beyond_the_share_wait_and_reads_go_beside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inflight, "MUTATING_INFLIGHT", 2)
    server = ThreadedServer(tmp_path, reconcile=False)
    facade = server.app.state.service.jobs
    load = facade.load
    lock, gate = threading.Lock(), threading.Event()
    inside, most = [0], [0]

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            assert gate.wait(30), "the test never opened the gate"
            return load(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(facade, "load", counted_load)
    with server as url, ThreadPoolExecutor(6) as pool:

        def submit(n: int) -> int:
            doc = job(f"s{n}", [{"name": "w", "command": ["true"]}])
            return httpx.post(url + "/api/v1/jobs", json=doc, timeout=60).status_code

        replies = [pool.submit(submit, n) for n in range(6)]
        for _ in range(200):  # until the share is full
            with lock:
                if inside[0] == 2:
                    break
            threading.Event().wait(0.05)
        # the share is full and four submits wait: a list and a status are answered meanwhile
        assert httpx.get(url + "/api/v1/jobs", params={"limit": 5}, timeout=30).status_code == 200
        assert httpx.get(url + "/api/v1/jobs/nothing-here", timeout=30).status_code == 404
        with lock:
            assert inside[0] == 2
        gate.set()
        assert [r.result(60) for r in replies] == [201] * 6
        listed = httpx.get(url + "/api/v1/jobs", timeout=30).json()["items"]
    assert most[0] == 2
    assert sorted(j["name"] for j in listed) == [f"s{n}" for n in range(6)]
