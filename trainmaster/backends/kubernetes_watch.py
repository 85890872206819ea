"""A watched cache of one kind of Kubernetes object (an informer, as client-go calls it).

One LIST, then one WATCH from the list's ``resourceVersion``; every event updates the cache and
moves the version on (bookmarks too), so a watch the server closes (timeouts, apiserver
restarts) resumes where it stopped; only a ``410 Gone`` (the version was compacted away) costs
a new LIST. Readers never call the API: the backend observes a thousand pods with one stream,
not a thousand polls.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

WATCH_SECONDS = 240  # the server ends each watch after this; it is resumed at once
RETRY_SECONDS = 1.0


class WatchedCache:
    """Objects of one list call (e.g. ``CoreV1Api.list_namespaced_pod`` with a label selector),
    kept current by a daemon thread. ``on_change(event_type, obj)`` runs on that thread after
    each change (objects are the API's JSON, as dicts)."""

    def __init__(
        self,
        api_client: Any,
        list_call: Callable[..., Any],
        what: str,
        on_change: Callable[[str, dict[str, Any]], None] | None = None,
        **list_args: Any,
    ):
        self._client = api_client
        self._list = list_call
        self._args = list_args
        self._what = what
        self._on_change = on_change
        self._objects: dict[str, dict[str, Any]] = {}  # "<namespace>/<name>" -> object
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._closing = threading.Event()
        self.version = ""
        self.lists = 0  # LIST requests made (1 unless a version expired)
        self.watches = 0  # WATCH requests made
        self._thread = threading.Thread(target=self._run, name=f"watch-{what}", daemon=True)
        self._thread.start()

    # ---- readers -------------------------------------------------------------------------------
    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(f"{namespace}/{name}")

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._objects.values())

    def put(self, obj: dict[str, Any]) -> None:
        """Record an object this process just wrote (the watch confirms it later); a newer
        version already seen is kept."""
        key = _key(obj)
        with self._lock:
            known = self._objects.get(key)
            if known is None or _version(known) <= _version(obj):
                self._objects[key] = obj

    def close(self) -> None:
        self._closing.set()

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        while not self._closing.is_set():
            try:
                if not self.version:
                    self._relist()
                self._watch()
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch of %s: version %s expired; listing again", self._what, self.version)
                    self.version = ""
                    continue
                log.warning("watch of %s failed (%s); retrying in %.0f s", self._what, exc.reason, RETRY_SECONDS)
                self._closing.wait(RETRY_SECONDS)
            except Exception as exc:  # the connection dropped, the apiserver restarts
                if self._closing.is_set():
                    return
                log.info("watch of %s interrupted (%s); resuming from %s", self._what, exc, self.version)
                self._closing.wait(RETRY_SECONDS)

    def _relist(self) -> None:
        answer = self._list(**self._args, _preload_content=False)
        import json

        data = json.loads(answer.data)
        self.lists += 1
        objects = {_key(o): o for o in data.get("items", [])}
        with self._lock:
            gone = [o for k, o in self._objects.items() if k not in objects]
            self._objects = objects
        self.version = data.get("metadata", {}).get("resourceVersion", "")
        self._synced.set()
        for obj in gone:
            self._notify("DELETED", obj)
        for obj in objects.values():
            self._notify("ADDED", obj)

    def _watch(self) -> None:
        import json

        from kubernetes.client.exceptions import ApiException

        self.watches += 1
        answer = self._list(
            **self._args,
            watch=True,
            resource_version=self.version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=(10, WATCH_SECONDS + 30),
        )
        partial = b""  # chunks may split or join events: one JSON object per line
        try:
            for chunk in answer.stream(amt=None):
                if self._closing.is_set():
                    return
                *lines, partial = (partial + chunk).split(b"\n")
                for text in (line for line in lines if line.strip()):
                    event = json.loads(text)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise ApiException(status=int(obj.get("code") or 500), reason=obj.get("message", ""))
                    version = (obj.get("metadata") or {}).get("resourceVersion")
                    if version:
                        self.version = version
                    if kind == "BOOKMARK":
                        continue
                    with self._lock:
                        if kind == "DELETED":
                            self._objects.pop(_key(obj), None)
                        else:
                            self._objects[_key(obj)] = obj
                    self._notify(str(kind), obj)
        finally:
            answer.release_conn()

    def _notify(self, kind: str, obj: dict[str, Any]) -> None:
        if self._on_change is not None:
            try:
                self._on_change(kind, obj)
            except Exception:  # a reader's bug must not stop the watch
                log.exception("handling a %s event of %s", kind, self._what)


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _version(obj: dict[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def wait_until(check: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(step)
    return check()
