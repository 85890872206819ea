"""Mechanism: the scale-test rig's hollow backend (simulated nodes, as kubemark's hollow
kubelets: the real backend contract, no processes, a run time per instance from its job's
annotations), found by name like every backend and driven through the real controller, store
and REST API on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from controller_harness import Harness, job, step_until
from server_process import ServerProcess
from trainmaster.backends import registry
from trainmaster.backends.base import BackendOptions, LaunchRequest, PlacementRequest, Resources, StartFailure
from trainmaster.backends.hollow import EXIT_CODE, RUN_SECONDS, HollowBackend, HollowCluster
from trainmaster.contract import InstanceHandle, InstancePhase, LaunchSpec
from trainmaster.errors import UserError


def request(backend: HollowBackend, name: str, annotations: dict[str, str], cpu: float = 1.0) -> LaunchRequest:
    placement = backend.place(PlacementRequest(name, 1, Resources(cpu)))
    spec = LaunchSpec(
        instance_id=f"u/{name}-0/1",
        job_id=1,
        job_name="t",
        role=name,
        index=0,
        attempt=1,
        argv=["/bin/false"],  # never run: a hollow node runs nothing
        env={},
        cwd=None,
        log_path="/nonexistent/log",
        instance_dir="/nonexistent/dir",
        host=placement.host,
        ports=placement.ports,
        cpu=cpu,
        annotations=annotations,
    )
    return LaunchRequest(placement, spec, Resources(cpu))


def test_the_cluster_is_parsed_and_a_wrong_one_is_refused_clearly() -> None:
    cluster = HollowCluster.parse("100x32x256x2")
    assert cluster.capacity == Resources(3200, 100 * 256 << 30, 200)
    assert HollowCluster.parse("3").node == Resources(8, 32 << 30, 0)
    for bad in ("", "0", "ten", "5x", "100001x1"):
        with pytest.raises(UserError, match="NODES\\[xCPU"):
            HollowCluster.parse(bad)


def test_the_hollow_backend_is_found_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMASTER_HOLLOW_NODES", "7x4")
    backend = registry.make_backend("hollow", BackendOptions())
    try:
        assert isinstance(backend, HollowBackend) and backend.capacity().cpu == 28
        assert "hollow" in registry.installed_backends()
    finally:
        backend.close()


def test_an_attempt_runs_for_its_annotated_time_and_exits_with_its_code(tmp_path: Path) -> None:
    backend = HollowBackend(HollowCluster.parse("2x4"), state_dir=tmp_path)
    try:
        quick, slow, bad = list(
            backend.start(
                [
                    request(backend, "quick", {RUN_SECONDS: "0", EXIT_CODE: "3"}),
                    request(backend, "slow", {RUN_SECONDS: "0.5"}),
                    request(backend, "bad", {RUN_SECONDS: "soon"}),
                ]
            )
        )
        assert isinstance(bad, StartFailure) and RUN_SECONDS in bad.message and "soon" in bad.message
        assert isinstance(quick, InstanceHandle) and isinstance(slow, InstanceHandle)
        assert quick.node != slow.node  # spread over the node with the most free CPU
        first = backend.observe([quick, slow])
        assert (first[0].phase, first[0].exit_code) == (InstancePhase.EXITED, 3)
        assert first[1].phase == InstancePhase.RUNNING
        time.sleep(0.6)
        assert backend.observe([slow])[0].exit_code == 0
        ghost = InstanceHandle("hollow-0", "u/never/1")
        assert backend.observe([ghost])[0].phase == InstancePhase.LOST
    finally:
        backend.close()


def test_stop_ends_an_attempt_as_a_term_would_and_frees_its_node(tmp_path: Path) -> None:
    backend = HollowBackend(HollowCluster.parse("1x4"), state_dir=tmp_path)
    try:
        [handle] = backend.start([request(backend, "long", {RUN_SECONDS: "600"}, cpu=3)])
        assert isinstance(handle, InstanceHandle)
        assert backend.node_usage() == {"hollow-0": 3}
        backend.stop([handle], grace=1)
        obs = backend.observe([handle])[0]
        assert (obs.phase, obs.exit_code) == (InstancePhase.EXITED, 143)
        assert backend.node_usage() == {"hollow-0": 0}
    finally:
        backend.close()


def test_a_new_backend_re_finds_attempts_from_the_journal_until_forgotten(tmp_path: Path) -> None:
    """A controller restarted over the same state folder adopts and recovers hollow attempts
    (the journal, as the local node agent's); forgotten ones are gone; a repeated start of one
    instance id returns the first handle and starts nothing."""
    first = HollowBackend(HollowCluster.parse("2x4"), state_dir=tmp_path)
    [live] = first.start([request(first, "live", {RUN_SECONDS: "600"})])
    [done] = first.start([request(first, "done", {RUN_SECONDS: "0"})])
    [again] = first.start([request(first, "live", {RUN_SECONDS: "0"})])
    assert isinstance(live, InstanceHandle) and isinstance(done, InstanceHandle) and again == live
    first.forget([done])
    first.close()
    second = HollowBackend(HollowCluster.parse("2x4"), state_dir=tmp_path)
    try:
        assert second.adopt(live)
        assert second.recover(live.instance_id, "") == live
        assert second.recover(done.instance_id, "") is None
        assert second.observe([done])[0].phase == InstancePhase.LOST
    finally:
        second.close()


def hollow_job(name: str, seconds: float, replicas: int = 2, code: int = 0) -> dict:
    doc = job(name, [{"name": "worker", "replicas": replicas, "command": ["/bin/false"]}])
    doc["metadata"]["annotations"] = {RUN_SECONDS: str(seconds), EXIT_CODE: str(code)}
    return doc


def test_the_real_controller_runs_jobs_on_hollow_nodes(tmp_path: Path) -> None:
    """Admission, start, exit, restart policy and events are the real controller's; no process runs."""
    h = Harness(tmp_path, backend=HollowBackend(HollowCluster.parse("4x2"), state_dir=tmp_path / "hollow"))
    try:
        ok = h.submit(hollow_job("ok", 0.3))
        bad = h.submit(hollow_job("bad", 0, replicas=1, code=2))
        done = step_until(h, ok, lambda s: s["state"] == "succeeded", timeout=30)
        assert [i["exitCode"] for i in done["instances"]] == [0, 0]
        assert {i["pid"] for i in done["instances"]} == {None}
        failed = step_until(h, bad, lambda s: s["state"] == "failed", timeout=30)
        assert failed["instances"][0]["exitCode"] == 2
    finally:
        h.backend.close()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_the_server_drives_hollow_nodes_through_its_rest_api(tmp_path: Path, store: str, request) -> None:
    """``trainmaster server --backend hollow``: jobs submitted over REST are admitted within
    the simulated cluster's capacity and all end, on SQLite and on PostgreSQL."""
    db = request.getfixturevalue("postgres").url() if store == "postgresql" else None
    server = ServerProcess(tmp_path, "--backend", "hollow", db=db, env={"TRAINMASTER_HOLLOW_NODES": "2x2"})
    try:
        ids = [server.submit(hollow_job(f"h{n}", 0.2)) for n in range(12)]  # 24 instances, 4 CPUs
        for job_id in ids:
            assert server.wait_state(job_id, {"succeeded"}, timeout=60)["state"] == "succeeded"
        listed = httpx.get(f"{server.url}/api/v1/jobs", timeout=10).json()
        assert {j["state"] for j in listed["items"] if j["id"] in ids} == {"succeeded"}
    finally:
        server.stop()
