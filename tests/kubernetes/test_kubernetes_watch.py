"""Mechanism: the Kubernetes backend observes through watches resumed from their resourceVersion,
never per-pod polls (controller spec, 'Our product decisions': Kubernetes): one LIST, then WATCH
from its version; a watch the server ends resumes where it stopped; only ``410 Gone`` lists again.
A fake list call stands for the API (what it was asked is recorded)."""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the optional kubernetes extra (trainmaster[kubernetes]) is not installed")

from trainmaster.backends.kubernetes_watch import WatchedCache  # noqa: E402


def pod(name: str, version: int, phase: str = "Pending") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": str(version)}, "status": {"phase": phase}}


class Answer:
    def __init__(self, data: bytes = b"", chunks: list[bytes] | None = None):
        self.data, self.chunks = data, chunks or []

    def stream(self, amt: Any = None) -> Any:
        yield from self.chunks

    def release_conn(self) -> None:
        pass


class FakeApi:
    """LISTs answer ``listed``; each WATCH answers the next script of events (then ends, as a
    server's watch timeout ends one)."""

    def __init__(self, listed: list[dict[str, Any]], version: int, watches: list[list[dict[str, Any]]]):
        self.listed, self.version = listed, version
        self.watches: queue.Queue[list[dict[str, Any]]] = queue.Queue()
        for script in watches:
            self.watches.put(script)
        self.calls: list[dict[str, Any]] = []
        self.idle = threading.Event()

    def __call__(self, **kwargs: Any) -> Answer:
        self.calls.append({k: v for k, v in kwargs.items() if not k.startswith("_")})
        if not kwargs.get("watch"):
            return Answer(
                json.dumps({"items": self.listed, "metadata": {"resourceVersion": str(self.version)}}).encode()
            )
        try:
            script = self.watches.get(timeout=0.05)
        except queue.Empty:
            self.idle.set()
            time.sleep(0.2)
            return Answer()
        text = b"".join(json.dumps(event).encode() + b"\n" for event in script)
        return Answer(chunks=[text[:7], text[7:]])  # an event split across chunks


def test_a_watch_resumes_from_its_version_and_lists_again_only_when_it_expired() -> None:
    api = FakeApi(
        [pod("a", 10)],
        10,
        [
            [{"type": "MODIFIED", "object": pod("a", 11, "Running")}, {"type": "BOOKMARK", "object": pod("", 12)}],
            [{"type": "ADDED", "object": pod("b", 13)}],
            [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}],
        ],
    )
    seen: list[tuple[str, str]] = []
    cache = WatchedCache(
        None, api, "pods", lambda kind, obj: seen.append((kind, obj["metadata"]["name"])), namespace="ns"
    )
    try:
        assert cache.wait_synced(5)
        assert api.idle.wait(10), "the watches were not all consumed"
        watches = [c for c in api.calls if c.get("watch")]
        lists = [c for c in api.calls if not c.get("watch")]
        # LIST at 10, WATCH from 10, resumed from 12 (the bookmark), then from 13; the 410 lists again
        assert [w["resource_version"] for w in watches[:3]] == ["10", "12", "13"]
        assert len(lists) == 2 and cache.lists == 2
        assert watches[3]["resource_version"] == "10"  # from the new LIST's version
        assert ("MODIFIED", "a") in seen and ("ADDED", "b") in seen
        assert cache.get("ns", "a")["status"]["phase"] == "Pending"  # the second LIST's state (b gone)
        assert cache.get("ns", "b") is None and ("DELETED", "b") in seen
    finally:
        cache.close()
