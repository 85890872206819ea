"""Mechanisms: the application facade (``trainmaster.api.LocalTrainmaster``) that the CLI's job verbs
and the REST handlers share (run to the end with a tick callback, list, status, wait, logs as a
bounded tail and a follow iterator, cancel, scale, delete, errors as typed user errors), and
fresh reasons: an instance the controller stopped says ``Stopped`` and why, never the
``Running`` of the state it left (controller spec, step 7: the stored states a user queries)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from controller_harness import Harness, job, py
from trainmaster.api import LocalTrainmaster, RunOptions
from trainmaster.client import JobNotFound, WaitTimedOut
from trainmaster.errors import JobConflict
from trainmaster.errors import UserError
from trainmaster.loading import load_document
from trainmaster.store.ownership import RUN_PREFIX

pytestmark = pytest.mark.timeout(120)

LINES = "import sys\nfor i in range(5): print('line', i, flush=True)\n"
SLEEPER = "import time; print('up', flush=True); time.sleep(60)"


@pytest.fixture
def facade(harness: Harness) -> LocalTrainmaster:
    return LocalTrainmaster(harness.sessions, harness.url)


def _wait_running(facade: LocalTrainmaster, harness: Harness, job_id: int, instances: int) -> None:
    """Step the harness's controller until ``instances`` instances of the job run (at most 60 s)."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        harness.controller.step()
        running = [i for i in facade.status(job_id)["instances"] if i["state"] == "running"]
        if len(running) >= instances:
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job_id}: fewer than {instances} instance(s) running after 60 s")


def _wait_logged(facade: LocalTrainmaster, job_id: int, text: str) -> None:
    """Wait (at most 60 s) until instance w-0's log holds ``text``."""
    import time

    deadline = time.monotonic() + 60
    while text not in facade.tail(job_id, "w", 0, lines=5):
        assert time.monotonic() < deadline, f"w-0 did not log {text!r} within 60 s"
        time.sleep(0.05)


def test_run_ticks_then_reads_back_through_every_verb(facade: LocalTrainmaster, tmp_path: Path) -> None:
    ticks: list[int] = []
    loaded = load_document(job("lines", [{"name": "talk", "replicas": 2, "command": py(LINES)}]))
    result = facade.run(loaded, RunOptions(interval=0.1, grace=2), on_tick=ticks.append)
    assert result.succeeded and result.status["name"] == "lines"
    assert ticks and set(ticks) == {result.job_id}  # the tick callback gets the job's id every pass
    assert [j["name"] for j in facade.list_jobs().items] == ["lines"]
    assert facade.find("lines").state == "succeeded"
    assert facade.wait("lines", timeout=1).state == "succeeded"
    assert facade.status(str(result.job_id))["roles"][0]["counts"]["succeeded"] == 2
    assert facade.tail("lines", "talk", 1, lines=2) == "line 3\nline 4\n"
    assert b"".join(facade.read_log("lines", "talk", 0, follow=True, timeout=5)).count(b"line") == 5
    assert facade.cancel("lines").cancel_requested is False  # already ended
    assert facade.delete("lines").id == result.job_id
    with pytest.raises(JobNotFound):
        facade.status("lines")


def test_unknown_references_and_forbidden_verbs_are_user_errors(facade: LocalTrainmaster, harness: Harness) -> None:
    for ref in ("nope", "²", "9" * 30):
        with pytest.raises(JobNotFound):
            facade.status(ref)
    job_id = harness.submit(job("waits", [{"name": "w", "command": py(SLEEPER)}]))  # queued, never stepped
    with pytest.raises(JobConflict, match="cancel it first"):
        facade.delete(job_id)
    with pytest.raises(UserError, match="no role 'x'"):
        facade.scale(job_id, "x", 2)
    with pytest.raises(JobNotFound, match="has no instance w-3"):
        facade.tail(job_id, "w", 3)
    # a role that is not the job's: the roles it has, and the closest (issue 38: `--role wrker`)
    with pytest.raises(JobNotFound, match=r"has no role 'ww' \(did you mean 'w'\? its roles: w\)"):
        facade.tail(job_id, "ww", 0)
    with pytest.raises(JobNotFound, match="no job 'nope'.*`trainmaster job list` shows them"):
        facade.status("nope")
    with pytest.raises(WaitTimedOut, match=r"still pending after 0.2 s"):
        facade.wait(job_id, timeout=0.2, poll=0.05)
    assert facade.cancel(job_id).cancel_requested


def test_follow_streams_until_the_instance_ends(facade: LocalTrainmaster, harness: Harness) -> None:
    job_id = harness.submit(job("follow", [{"name": "w", "command": py(SLEEPER)}]))
    _wait_running(facade, harness, job_id, 1)
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(facade.read_log(job_id, "w", 0, follow=True, poll=0.05, timeout=60))
    )
    reader.start()
    _wait_logged(facade, job_id, "up")
    facade.cancel(job_id)
    harness.controller.step()  # the pass that carries the cancellation out
    reader.join(timeout=30)
    assert not reader.is_alive() and b"up" in b"".join(chunks)
    job2 = harness.submit(job("follow2", [{"name": "w", "command": py(SLEEPER)}]))
    _wait_running(facade, harness, job2, 1)
    with pytest.raises(WaitTimedOut, match="still runs after"):  # a follow has a timeout too
        list(facade.read_log(job2, "w", 0, follow=True, poll=0.05, timeout=0.3))
    # a job whose `trainmaster run` is gone never ends in the store: the follow stops and says why
    _set_owner(harness, job2, f"{RUN_PREFIX}1-0.00")  # pid 1, another start time: a dead run
    with pytest.raises(UserError, match="stopped following w-0: .*trainmaster resume"):
        list(facade.read_log(job2, "w", 0, follow=True, poll=0.05, timeout=30))
    _set_owner(harness, job2, "service")
    facade.cancel(job2)
    harness.controller.step()


def _set_owner(harness: Harness, job_id: int, owner: str) -> None:
    from trainmaster.store.models import JobRow

    with harness.sessions() as session:
        row = session.get(JobRow, job_id)
        assert row is not None
        row.owner = owner
        session.commit()


def test_stopped_instances_say_stopped_and_why_not_running(facade: LocalTrainmaster, harness: Harness) -> None:
    """The stale-reason fix: the controller's ``_stop_instances`` gives every instance it stops
    the reason ``Stopped`` and the cause (scaled down, the job cancelled)."""
    job_id = harness.submit(job("stale", [{"name": "w", "replicas": 2, "command": py(SLEEPER)}]))
    _wait_running(facade, harness, job_id, 2)
    assert {i["reason"] for i in facade.status(job_id)["instances"]} == {"Running"}

    facade.scale(job_id, "w", 1)
    harness.controller.step()
    gone = [i for i in facade.status(job_id)["instances"] if i["state"] == "stopped"]
    assert len(gone) == 1 and gone[0]["reason"] == "Stopped" and "scaled down" in gone[0]["message"]

    facade.cancel(job_id)
    harness.controller.step()
    status = facade.status(job_id)
    assert status["state"] == "cancelled"
    for inst in status["instances"]:
        assert inst["state"] == "stopped" and inst["reason"] == "Stopped", inst
    assert any("the job cancelled" in i["message"] for i in status["instances"])


def test_a_log_larger_than_one_chunk_is_read_whole(facade: LocalTrainmaster) -> None:
    """Logs are read in 64 KiB chunks: every chunk comes, in order, following or not."""
    code = "import sys\nfor i in range(20000): print(f'{i:09d}')\n"  # 200,000 bytes
    loaded = load_document(job("big", [{"name": "w", "command": py(code)}]))
    assert facade.run(loaded, RunOptions(interval=0.1, grace=2)).succeeded
    for follow in (False, True):
        lines = b"".join(facade.read_log("big", "w", 0, follow=follow, timeout=10)).decode().splitlines()
        numbers = [line for line in lines if line.isdigit()]  # the agent's attempt header aside
        assert numbers == [f"{i:09d}" for i in range(20000)]
    assert facade.tail("big", "w", 0, lines=1) == "000019999\n"


def test_submit_is_the_one_way_in_names_unique_among_active_jobs(facade: LocalTrainmaster, harness: Harness) -> None:
    """``LocalTrainmaster.submit``: the REST API, the dashboard, ``run`` and the tests all queue a job
    here. With unique names (the server's), a second active job of a name is a NameTaken
    conflict (HTTP 409) until the first has ended; ``load`` refuses a job that names another
    backend than the controller's, with the field path."""
    from trainmaster.api import NameTaken

    doc = job("only", [{"name": "w", "command": py("pass")}])
    first = facade.submit(facade.load(doc, harness.backend.name), harness.controller)
    assert (first.name, first.state) == ("only", "pending")
    with pytest.raises(NameTaken, match="still active"):
        facade.submit(facade.load(doc, harness.backend.name), harness.controller)
    assert harness.controller.run_job(first.id) == "succeeded"
    second = facade.submit(facade.load(doc, harness.backend.name), harness.controller)
    twin = facade.submit(load_document(doc), harness.controller, unique_name=False)
    assert len({first.id, second.id, twin.id}) == 3
    other = {**doc, "spec": {**doc["spec"], "scheduling": {"backend": "ray"}}}
    with pytest.raises(UserError) as refused:
        facade.load(other, "local")
    assert any(d.startswith("spec.scheduling.backend:") for d in refused.value.details)
