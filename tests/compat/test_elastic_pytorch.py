"""Mechanisms: elastic PyTorch (a PyTorchJob's or a Trainer torch policy's ``elasticPolicy``):
torchrun elastic agents meeting at a c10d rendezvous store the controller runs as its own role.
A 2-4 node gloo job trains a real model while a node is killed (-9) and while it is scaled
2 -> 4 -> 2 with ``scale``: the group re-forms each time with the right world size (2, 2, 4,
2), the survivors keep their first attempt (no restart of the job as a whole, no role restart),
the killed node is replaced while the others wait at the rendezvous, and training resumes from
the checkpoint each time; the time from the kill to the first step after it is measured."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller_harness import Harness, events
from helpers import wait_until
from trainmaster.loading import load_document
from trainmaster.spec.load import LoadOptions

SCRIPT = Path(__file__).with_name("elastic_train.py")


def progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_since(path: Path, moment: float, world: int, count: int = 3) -> list[dict[str, Any]]:
    """At least ``count`` steps with world size ``world`` by a group whose workers started
    after ``moment`` (a re-formed group), else []."""
    found = [p for p in progress(path) if p["born"] > moment and p["world"] == world]
    return found if len(found) >= count else []


def _started_after(status: dict[str, Any], index: int, attempt: int, moment: float) -> float | None:
    """Seconds from ``moment`` to the start of node ``index``'s attempt ``attempt`` (None: not found)."""
    from datetime import datetime, timezone

    for i in status["instances"]:
        if i["role"] == "node" and i["index"] == index and i["attempt"] == attempt and i.get("startedAt"):
            started = datetime.fromisoformat(i["startedAt"])
            started = started if started.tzinfo else started.replace(tzinfo=timezone.utc)  # the store's UTC
            return round(started.timestamp() - moment, 1)
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_job_survives_a_kill_and_scales_without_restarting(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    log = tmp_path / "progress.jsonl"
    doc = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "elastic"},
        "spec": {
            "framework": "pytorch",
            "frameworkParams": {"elastic": {"minReplicas": 2, "maxReplicas": 4, "maxRestarts": 20}},
            "roles": [
                {
                    "name": "node",
                    "replicas": 2,
                    "command": ["torchrun", str(SCRIPT)],
                    "env": {
                        "CKPT": str(tmp_path / "model.pt"),
                        "PROGRESS": str(log),
                        "STOP": str(tmp_path / "stop"),
                        "OMP_NUM_THREADS": "1",
                    },
                }
            ],
        },
    }
    loaded = load_document(doc, options=LoadOptions())
    job_id = harness.jobs.submit(loaded, harness.controller, unique_name=False).id
    result: dict[str, str] = {}
    runner = threading.Thread(target=lambda: result.update(state=harness.controller.run_job(job_id)), daemon=True)
    runner.start()
    phases: dict[str, Any] = {}
    try:
        start = time.time()
        wait_until(lambda: steps_since(log, start, 2, 5), 240, "5 steps of the first group (world 2)")
        phases["start"] = {"world": 2}

        # a node dies: its replacement joins while the survivor waits at the rendezvous
        status = harness.status(job_id)
        victim = next(i for i in status["instances"] if i["role"] == "node" and i["index"] == 1)
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        resumed = wait_until(
            lambda: steps_since(log, killed_at, 2, 5), 240, "5 steps of the group re-formed after the kill"
        )
        phases["after kill"] = {
            "world": 2,
            "kill to training resumed (s)": round(resumed[0]["t"] - killed_at, 1),
            # where the time goes: the replacement agent started, the re-formed group's rank 0 born
            "replacement started (s)": _started_after(harness.status(job_id), 1, 2, killed_at),
            "new group's workers started (s)": round(resumed[0]["born"] - killed_at, 1),
        }

        scaled_up = time.time()
        harness.jobs.scale(job_id, "node", 4)
        grown = wait_until(lambda: steps_since(log, scaled_up, 4, 5), 240, "5 steps of the group of 4")
        phases["scaled to 4"] = {
            "world": 4,
            "scale to training resumed (s)": round(grown[0]["t"] - scaled_up, 1),
            "new agents started (s)": _started_after(harness.status(job_id), 3, 1, scaled_up),
            "new group's workers started (s)": round(grown[0]["born"] - scaled_up, 1),
        }

        scaled_down = time.time()
        harness.jobs.scale(job_id, "node", 2)
        shrunk = wait_until(lambda: steps_since(log, scaled_down, 2, 5), 240, "5 steps of the group of 2 again")
        phases["scaled to 2"] = {
            "world": 2,
            "scale to training resumed (s)": round(shrunk[0]["t"] - scaled_down, 1),
            "new group's workers started (s)": round(shrunk[0]["born"] - scaled_down, 1),
        }

        (tmp_path / "stop").write_text("stop")
        stopped = time.time()
        runner.join(420)  # the agents leave the rendezvous one by one: slow on a loaded machine
        phases["stop file to job end (s)"] = round(time.time() - stopped, 1)
        assert result.get("state") == "succeeded", harness.status(job_id)["message"]
    finally:
        if runner.is_alive():
            harness.controller.cancel(job_id)
            runner.join(60)
    status = harness.status(job_id)
    print("phases:", json.dumps(phases), "load:", os.getloadavg())
    worlds = [p["world"] for p in progress(log)]
    collapsed = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert collapsed == [2, 4, 2], collapsed  # the kill keeps world 2 (replaced, not shrunk)
    steps = [p["step"] for p in progress(log)]
    assert steps == sorted(steps) and steps[-1] >= 20, steps  # resumed from the checkpoint every time
    nodes = {(i["index"], i["attempt"]): i for i in status["instances"] if i["role"] == "node"}
    assert nodes[(0, 1)]["state"] == "succeeded" and nodes[(0, 1)]["restarts"] == 0  # the survivor never restarted
    assert nodes[(1, 2)]["restarts"] == 1  # the killed node was replaced, once
    assert not events(status, "RestartingGroup")  # no role or job restart
    rendezvous = [i for i in status["instances"] if i["role"] == "rendezvous"]
    assert len(rendezvous) == 1 and rendezvous[0]["attempt"] == 1
    first, last = progress(log)[0]["loss"], progress(log)[-1]["loss"]
    assert last < first, (first, last)  # it trained
