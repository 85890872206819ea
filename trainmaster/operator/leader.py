"""Leader election on a ``coordination.k8s.io/v1`` Lease, with fencing of late writes.

As client-go's leaderelection: a candidate takes the Lease when it is free or its holder has not
renewed it for ``leaseDurationSeconds`` (judged by when *this* candidate last saw it change, so
clocks need not agree); every write of the Lease carries the ``resourceVersion`` it read, so two
candidates never both win. The leader renews every ``duration / 4``, as client-go does since
1.25 with one request, not two: it writes over the Lease as its last write left it (that write's
answer carries the ``resourceVersion``), and reads the Lease only when that write conflicts
(someone else wrote it since; still its holder, it writes again over what it read).

Fencing: the leader's right to write ends ``duration * 3 / 4`` after its last successful renewal
by its own monotonic clock, earlier than any candidate may take over (``duration`` after it last
saw a change). :meth:`LeaseElector.check` raises :class:`Deposed` past that point, and every write
the operator makes (pods, services, status) calls it first; a write already in flight when a
leader stalls is caught by the next two rules: pod names are deterministic (a late create of a
pod the new leader made fails with AlreadyExists: one pod per instance), and status is written
with the resource's ``resourceVersion`` (a late status write over a newer one fails with Conflict).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)


class Deposed(RuntimeError):
    """This process is not the leader (any more): it must not write."""


def _micro_time() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(
        self, api_client: Any, namespace: str, name: str, identity: str, duration: float = 8.0, retry: float = 1.0
    ):
        from kubernetes import client

        self.coordination: Any = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration, self.retry = duration, retry
        self.epoch = 0  # leaseTransitions when this process took the lease: its fencing token
        self._valid_until = 0.0  # monotonic: no write after this
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._written: dict[str, Any] | None = None  # the Lease as this process' last write left it
        self._stop = threading.Event()  # the current term's renewer's
        self._renewer: threading.Thread | None = None

    # ---- the fence -------------------------------------------------------------------------------
    def holding(self) -> bool:
        return time.monotonic() < self._valid_until

    def check(self) -> None:
        if not self.holding():
            raise Deposed(f"{self.identity} does not hold the lease {self.namespace}/{self.name}")

    # ---- acquiring -----------------------------------------------------------------------------
    def acquire(self, stop: threading.Event) -> bool:
        """Block until this candidate leads (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if self._try_acquire():
                    self._start_renewing()
                    return True
            except Exception as exc:  # the API is away: keep trying
                log.info("lease %s/%s: %s", self.namespace, self.name, exc)
            stop.wait(self.retry)
        return False

    def _try_acquire(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        started = time.monotonic()
        lease = self._read()
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(transitions=0),
            }
            try:
                self._written = _lease(
                    self.coordination.create_namespaced_lease(self.namespace, body, _preload_content=False)
                )
            except ApiException as create:
                if create.status == 409:
                    return False
                raise
            self._won(started, 0)
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        renewed = str(spec.get("renewTime") or "")
        if (holder, renewed) != self._observed:
            self._observed, self._observed_at = (holder, renewed), time.monotonic()
        free = not holder or time.monotonic() - self._observed_at > float(spec.get("leaseDurationSeconds") or 0)
        if holder != self.identity and not free:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        try:
            self._written = self._replace(lease, self._spec(transitions))
        except ApiException as exc:
            if exc.status == 409:  # another candidate wrote it first
                return False
            raise
        self._won(started, transitions)
        return True

    def _read(self) -> dict[str, Any] | None:
        """The Lease as the API's JSON, or None when there is none."""
        import json

        from kubernetes.client.exceptions import ApiException

        try:
            answer = self.coordination.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(json.loads(answer.data))

    def _replace(self, lease: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
        """Write ``spec`` over the Lease as it was read (``lease``): the write carries the
        ``resourceVersion`` read, so it fails with Conflict if anyone wrote it since. Returns the
        Lease as written (None where the answer holds none)."""
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": lease["metadata"]["resourceVersion"],
            },
            "spec": spec,
        }
        return _lease(
            self.coordination.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False)
        )

    def _spec(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        now = _micro_time()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.duration),
            "acquireTime": acquired or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _won(self, started: float, transitions: int) -> None:
        self.epoch = transitions
        self._valid_until = started + self.duration * 3 / 4
        log.info("%s leads (lease %s/%s, epoch %d)", self.identity, self.namespace, self.name, transitions)

    # ---- keeping it ---------------------------------------------------------------------------------
    def _start_renewing(self) -> None:
        """One renewer per term. A leader deposed by its own clock (a stall past ``duration * 3 /
        4``) may still have the last term's renewer running: it is stopped first, and its stop
        event is its own, so a renewal of the old term still in flight can neither write over the
        new term's Lease nor depose it (two renewers of one identity conflict on every write)."""
        if self._renewer is not None and self._renewer.is_alive():
            self._stop.set()
            self._renewer.join(timeout=self.duration)
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, args=(self._stop,), name="lease-renew", daemon=True)
        self._renewer.start()

    def _renew_loop(self, stop: threading.Event) -> None:
        from kubernetes.client.exceptions import ApiException

        while not stop.wait(self.duration / 4):
            started = time.monotonic()
            try:
                self._renew()
                if not stop.is_set():
                    self._valid_until = started + self.duration * 3 / 4
            except (ApiException, Deposed) as exc:
                if stop.is_set():
                    return  # a renewal of an ended term: the next term's renewer decides
                log.warning("%s lost the lease: %s", self.identity, exc)
                self._valid_until = 0.0
                return
            except Exception as exc:  # the API did not answer: keep the lease until it runs out
                log.info("renewing the lease: %s", exc)

    def _renew(self) -> None:
        """One renewal: over the Lease as the last write left it (one request); on Conflict, or
        with none known, over the Lease as read, if this process still holds it."""
        from kubernetes.client.exceptions import ApiException

        known = self._written
        self._written = None
        if known is not None:
            try:
                acquired = (known.get("spec") or {}).get("acquireTime")
                self._written = self._replace(known, self._spec(self.epoch, acquired=acquired))
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
        lease = self._read() or {}
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            raise Deposed(f"the lease is held by {spec.get('holderIdentity') or 'nobody'}")
        self._written = self._replace(lease, self._spec(self.epoch, acquired=spec.get("acquireTime")))

    def release(self) -> None:
        """Stop renewing and give the lease up (a standby takes over at once)."""
        self._stop.set()
        if not self.holding():
            return
        self._valid_until = 0.0
        try:
            lease = self._read() or {}
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                self._replace(lease, {"holderIdentity": "", "leaseDurationSeconds": 1, "leaseTransitions": self.epoch})
        except Exception as exc:
            log.info("releasing the lease: %s", exc)


def _lease(answer: Any) -> dict[str, Any] | None:
    """The Lease in a raw answer of a write (``_preload_content=False``), if it holds one."""
    import json

    data = getattr(answer, "data", None)
    if not data:
        return None
    try:
        found = json.loads(data)
    except ValueError:
        return None
    return found if isinstance(found, dict) and (found.get("metadata") or {}).get("resourceVersion") else None
