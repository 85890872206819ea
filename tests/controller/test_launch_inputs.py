"""Mechanism: values the OS cannot take (a NUL byte in argv, env or workingDir; '=' in or an
empty env name) are rejected at submit with the field path (controller spec, 'Validation'),
and a server that refused such a job keeps running the next one (issue #14 part 2), whose
CPU seconds and peak RSS (from the node agent) are in its status and on /metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from controller_harness import Harness, job, py, step_until
from trainmaster.errors import UserError
from trainmaster.service.app import API, create_app
from trainmaster.loading import load_document


def _errors(role: dict) -> list[str]:  # type: ignore[type-arg]
    with pytest.raises(UserError) as info:
        load_document(job("bad", [{"name": "w", "command": ["true"], **role}]))
    return info.value.details


@pytest.mark.parametrize(
    "role, expected",
    [
        ({"command": ["echo", "a\0b"]}, "spec.roles[0].command[1]: contains a NUL byte"),
        ({"args": ["x\0"]}, "spec.roles[0].args[0]: contains a NUL byte"),
        ({"env": {"A": "1\x002"}}, "spec.roles[0].env.A: the value contains a NUL byte"),
        ({"env": {"A=B": "1"}}, "spec.roles[0].env.'A=B': a variable name cannot contain '='"),
        ({"env": {"A\0": "1"}}, "a variable name cannot contain a NUL byte"),
        ({"env": {"": "1"}}, "spec.roles[0].env: an empty variable name"),
        ({"env": {"A": ["a", "list"]}}, "spec.roles[0].env.A"),
        ({"workingDir": "/tmp/\0"}, "spec.roles[0].workingDir: contains a NUL byte"),
    ],
)
def test_values_the_os_cannot_take_are_rejected_with_their_path(role: dict, expected: str) -> None:  # type: ignore[type-arg]
    assert any(expected in e for e in _errors(role)), _errors(role)


def test_a_server_that_refused_such_a_job_runs_the_next(harness: Harness) -> None:
    client = TestClient(create_app(harness.controller, reconcile=False), base_url="http://localhost")
    bad = client.post(f"{API}/jobs", json=job("nul", [{"name": "w", "command": py("pass"), "env": {"X": "a\0b"}}]))
    assert bad.status_code == 422 and any("spec.roles[0].env.X" in d for d in bad.json()["details"])
    eq = client.post(f"{API}/jobs", json=job("eq", [{"name": "w", "command": py("pass"), "env": {"A=B": "1"}}]))
    assert eq.status_code == 422
    good = client.post(f"{API}/jobs", json=job("next", [{"name": "w", "command": py("pass")}]))
    assert good.status_code == 201
    job_id = good.json()["id"]
    status = step_until(harness, job_id, lambda s: s["state"] == "succeeded")
    assert status["instances"][0]["cpuSeconds"] > 0 and status["instances"][0]["peakRss"] > 0
    metrics = client.get("/metrics").text  # the node agent's per-instance figures, exported
    assert 'trainmaster_instance_cpu_seconds{index="0",job="next",role="w"}' in metrics
    assert 'trainmaster_instance_peak_rss_bytes{index="0",job="next",role="w"}' in metrics
