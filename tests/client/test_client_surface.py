"""One client surface (issue 33): the job verbs answer the same typed results from the local
store (:class:`LocalTrainmaster`) and from a controller service over HTTP
(:class:`RemoteTrainmaster`), and fail the same way, so a CLI verb cannot tell them apart.

Mechanism: status ("states and counts are stored so that a user can query them at any time"),
with and without a server; cancel, scale, suspend and delete as intents the owning controller
carries out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from api_server import ThreadedServer
from helpers import wait_until
from trainmaster.api import LocalTrainmaster
from trainmaster.client import (
    CancelResult,
    Deleted,
    JobNotFound,
    JobRef,
    ScaleResult,
    Submitted,
    SuspendResult,
    Trainmaster,
    WaitTimedOut,
)
from trainmaster.client.remote import RemoteTrainmaster
from trainmaster.errors import JobConflict

pytestmark = pytest.mark.timeout(120)

SLEEPER = "import time; print('up', flush=True); time.sleep(60)"


def job(name: str, replicas: int = 1) -> dict[str, object]:
    return {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"roles": [{"name": "w", "replicas": replicas, "command": [sys.executable, "-c", SLEEPER]}]},
    }


def clients(server: ThreadedServer, url: str) -> tuple[LocalTrainmaster, RemoteTrainmaster]:
    return LocalTrainmaster(server.controller.sessions, server.controller.db_url), RemoteTrainmaster(url)


def test_local_and_remote_answer_the_same_typed_results(tmp_path: Path) -> None:
    server = ThreadedServer(tmp_path, reconcile=True)
    with server as url:
        local, remote = clients(server, url)
        both: list[Trainmaster] = [local, remote]  # mypy checks that each implements the protocol
        submitted = remote.submit(job("parity"))
        assert isinstance(submitted, Submitted) and submitted.name == "parity" and submitted.ignored == []

        running = [jobs.wait("parity", timeout=60, states=frozenset({"running"})) for jobs in both]
        assert running == [JobRef(submitted.id, "parity", "running")] * 2
        assert local.list_jobs() == remote.list_jobs()
        assert [jobs.find(submitted.id) for jobs in both] == [JobRef(submitted.id, "parity", "running")] * 2
        wait_until(lambda: "up" in local.tail("parity", "w", 0, lines=1), 30, "the instance's first line")
        assert local.tail("parity", "w", 0, lines=1) == remote.tail("parity", "w", 0, lines=1) == "up\n"
        whole = b"".join(local.read_log("parity"))
        assert whole == b"".join(remote.read_log("parity")) and whole.endswith(b"---\nup\n")

        assert remote.scale("parity", "w", 2) == local.scale("parity", "w", 2) == ScaleResult(submitted.id, "w", 2)
        assert remote.suspend("parity") == SuspendResult(submitted.id, True, True)
        assert local.suspend("parity") == SuspendResult(submitted.id, True, False)
        assert local.suspend("parity", False) == SuspendResult(submitted.id, False, True)
        assert remote.suspend("parity", False) == SuspendResult(submitted.id, False, False)

        for jobs in both:  # an active job cannot be deleted: the same conflict from both
            with pytest.raises(JobConflict, match="cancel it first"):
                jobs.delete("parity")
        cancelled = remote.cancel("parity")
        assert isinstance(cancelled, CancelResult) and cancelled.cancel_requested
        ended = [jobs.wait("parity", timeout=60) for jobs in both]
        assert ended == [JobRef(submitted.id, "parity", "cancelled")] * 2
        assert local.cancel("parity").cancel_requested is False

        over_http = remote.status("parity", events=200)
        assert over_http.pop("controller") == {"leading": True, "leader": None}
        assert local.status("parity", events=200) == over_http

        assert remote.delete("parity") == Deleted(submitted.id)
        for jobs in both:
            with pytest.raises(JobNotFound):
                jobs.status("parity")
        assert local.list_jobs().items == remote.list_jobs().items == []


def test_both_refuse_the_same_mistakes_the_same_way(tmp_path: Path) -> None:
    server = ThreadedServer(tmp_path, reconcile=False)  # nothing runs: the job stays pending
    with server as url:
        local, remote = clients(server, url)
        remote.submit(job("held"))
        for jobs in (local, remote):
            with pytest.raises(JobNotFound, match="no-such-job"):
                jobs.find("no-such-job")
            with pytest.raises(JobNotFound, match="no role 'x'"):
                jobs.tail("held", "x", 0)
            with pytest.raises(WaitTimedOut, match=r"job held \(id 1\) still pending after 0.2 s") as timed_out:
                jobs.wait("held", timeout=0.2)
            assert timed_out.value.exit_code == 1
        with pytest.raises(JobConflict):  # its name is taken while it is active
            remote.submit(job("held"))
