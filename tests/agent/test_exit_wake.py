"""Mechanism: the controller's wake on an instance's end (issue #14). ``trainmaster run``
(:meth:`Controller.run_job`) waits between passes on the same wake as the server's loop (the
node agent's ``wait_exit`` through :meth:`LocalBackend.watch_exits`), not a fixed sleep; and a
local backend dropped without ``close`` ends its exit watcher instead of keeping it (and its
connection to the agent) forever."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

from controller_harness import Harness, job
from trainmaster.backends.local import LocalBackend
from trainmaster.controller import Controller
from trainmaster.store.db import make_engine, session_factory


def test_run_job_wakes_on_an_instance_exit_not_after_its_interval(harness: Harness) -> None:
    """With a 60 s interval, a job whose only instance ends after 0.3 s is seen ended at once:
    the agent's exit wakes ``run_job`` (a fixed sleep would hold it for the whole interval)."""
    harness.controller.interval = 60.0
    job_id = harness.submit(job("woken", [{"name": "task", "command": ["sleep", "0.3"]}]))
    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(harness.controller.run_job(job_id)), daemon=True)
    runner.start()
    runner.join(timeout=20)
    if runner.is_alive():  # let the thread end: the cancel wakes it too
        harness.controller.cancel(job_id)
        runner.join(timeout=70)
    assert result == ["succeeded"], "run_job slept through the exit instead of waking on it"


def test_a_local_backend_dropped_without_close_ends_its_exit_watcher(tmp_path: Path) -> None:
    """The watcher holds its backend and the controllers it wakes only weakly, so dropping them
    ends it within one ``wait_exit``, and its connection no longer keeps the agent from lingering out."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    backend = LocalBackend(watch_seconds=0.2)
    controller = Controller(session_factory(make_engine(url)), backend, url, runs_dir=tmp_path / "runs")
    backend.agent.ping()  # an agent to watch
    backend.watch_exits(controller.wake)
    watcher = backend._watcher
    assert watcher is not None and watcher.is_alive()
    agent = backend.agent
    del backend, controller
    gc.collect()
    watcher.join(timeout=10)
    assert not watcher.is_alive(), "the exit watcher outlived its backend"
    agent.close()
