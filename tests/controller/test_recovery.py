"""Crash safety of the controller's start path (controller spec: nothing accepted is lost, and
each instance's run is counted once across a controller crash)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller_harness import Harness, job
from helpers import wait_until


class ControllerCrash(Exception):
    """Stands for the controller process dying at that point."""


def test_an_attempt_that_started_and_ended_while_no_controller_recorded_it_runs_once(tmp_path: Path) -> None:
    """Crash safety: the controller dies after spawning the attempts but before saving their
    handles, and the attempts end before a new controller starts. The new controller learns
    each attempt's exit code from the node agent's journal and applies the restart policy to it; it
    does not take the attempts for never started and run them a second time."""
    markers = tmp_path / "markers"
    markers.mkdir()
    first = Harness(tmp_path)
    job_id = first.submit(
        job(
            "once",
            [
                {
                    "name": "worker",
                    "replicas": 2,
                    "command": ["/bin/sh", "-c", f"mktemp -p {markers}"],
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 3},
                }
            ],
        )
    )
    spawn = first.backend.start

    def start_then_crash(requests):  # type: ignore[no-untyped-def]
        list(spawn(requests))  # every attempt really starts...
        raise ControllerCrash  # ...and the controller dies before recording one

    first.backend.start = start_then_crash  # type: ignore[method-assign]
    with pytest.raises(ControllerCrash):
        first.controller.step()
    wait_until(lambda: [s.phase.value for s in first.backend.agent.list()] == ["exited", "exited"])

    second = Harness(tmp_path)
    second.controller.recover()
    assert second.controller.run_job(job_id) == "succeeded"
    assert len(list(markers.iterdir())) == 2
    events = [e["reason"] for e in second.status(job_id)["events"]]
    assert "NotStarted" not in events
