"""Mechanism: the operator's replicas elect a leader on a coordination.k8s.io Lease with fencing
of late writes (controller spec, 'Our product decisions': Kubernetes operator mode). A leader
whose own clock deposed it (a stall longer than ``duration * 3 / 4``) takes the lease again with
exactly one renewer: the last term's renewer is stopped first, so two renewers of one identity
never conflict on the Lease and depose the new term. A fake Lease API stands for the cluster's
(every write carries the resourceVersion read; a stale one is refused with Conflict)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the optional kubernetes extra (trainmaster[kubernetes]) is not installed")

from kubernetes.client.exceptions import ApiException  # noqa: E402

from trainmaster.operator.leader import LeaseElector  # noqa: E402


class Answer:
    def __init__(self, obj: dict[str, Any]):
        self.data = json.dumps(obj).encode()


class FakeLeases:
    """One Lease, with optimistic concurrency as the API server has it."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.conflicts = 0
        self.reads = 0
        self.writes = 0
        self.lock = threading.Lock()

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Answer:
        with self.lock:
            self.reads += 1
            if self.lease is None:
                raise ApiException(status=404, reason="Not Found")
            return Answer(json.loads(json.dumps(self.lease)))

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], **_: Any) -> Answer:
        with self.lock:
            if self.lease is not None:
                raise ApiException(status=409, reason="AlreadyExists")
            self.version += 1
            self.writes += 1
            self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
            return Answer(self.lease)

    def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Answer:
        with self.lock:
            assert self.lease is not None
            if body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
                self.conflicts += 1
                raise ApiException(status=409, reason="Conflict")
            self.version += 1
            self.writes += 1
            self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
            return Answer(self.lease)


def fake_elector() -> tuple[LeaseElector, FakeLeases]:
    """An elector of 0.4 s terms, renewing every 0.05 s, over the fake Lease API."""
    elector = LeaseElector(None, "default", "tm-test", "me", duration=0.4, retry=0.05)
    fake = FakeLeases()
    elector.coordination = fake
    return elector, fake


def renewers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lease-renew" and t.is_alive()]


def test_a_leader_deposed_by_its_own_clock_leads_again_with_one_renewer() -> None:
    before = len(renewers())
    elector, fake = fake_elector()
    stop = threading.Event()
    try:
        assert elector.acquire(stop)
        assert elector.holding()
        # a stall: the fence closed by this process' own clock while its renewer still runs
        elector._valid_until = 0.0
        assert not elector.holding()
        assert elector.acquire(stop)  # leads again (its own Lease, not yet expired)
        assert len(renewers()) == before + 1, "the last term's renewer still runs beside the new one"
        time.sleep(1.0)  # ten renewals of the new term
        assert elector.holding(), "the new term was deposed"
        assert fake.conflicts == 0, f"{fake.conflicts} renewals conflicted on the Lease"
        assert fake.lease is not None and fake.lease["spec"]["holderIdentity"] == "me"
    finally:
        stop.set()
        elector.release()
    deadline = time.monotonic() + 5
    while len(renewers()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(renewers()) == before
    assert fake.lease is not None and fake.lease["spec"]["holderIdentity"] == ""


def test_a_renewal_is_one_write_and_a_foreign_write_deposes_the_leader() -> None:
    """As client-go's leader election: the leader renews over the Lease as its last write left
    it (one request, no read); a write by anyone else makes that renewal conflict, and the
    leader, reading the Lease, finds another holder and stops writing."""
    elector, fake = fake_elector()
    stop = threading.Event()
    try:
        assert elector.acquire(stop)
        reads, writes = fake.reads, fake.writes
        time.sleep(0.55)  # five renewals
        assert fake.writes - writes >= 3
        assert fake.reads == reads, f"{fake.reads - reads} reads for {fake.writes - writes} renewals"
        assert elector.holding()
        with fake.lock:  # another candidate takes the Lease
            assert fake.lease is not None
            fake.version += 1
            fake.lease = {
                **fake.lease,
                "metadata": {**fake.lease["metadata"], "resourceVersion": str(fake.version)},
                "spec": {**fake.lease["spec"], "holderIdentity": "other"},
            }
        deadline = time.monotonic() + 2
        while elector.holding() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not elector.holding(), "the leader kept writing after another candidate took the Lease"
        assert fake.lease["spec"]["holderIdentity"] == "other"
    finally:
        stop.set()
        elector._stop.set()
