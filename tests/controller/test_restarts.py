"""Mechanism: fault tolerance by restart policy, with restart limits and backoff (spec step 6)."""

import time
from pathlib import Path

import pytest

from controller_harness import Harness, events, job, pids_alive, py
from trainmaster.backends.base import Observation
from trainmaster.contract import InstancePhase as Phase
from trainmaster.backends.local import LocalBackend
from trainmaster.controller.restart import decide
from trainmaster.spec.model import RestartPolicy


def flaky(counter: Path, failures: int) -> list[str]:
    """A command that fails its first ``failures`` runs."""
    return py(
        f"import pathlib, sys\np = pathlib.Path('{counter}')\nn = int(p.read_text()) if p.exists() else 0\n"
        f"p.write_text(str(n + 1))\nsys.exit(1 if n < {failures} else 0)\n"
    )


def test_on_failure_restarts_until_success(harness: Harness, tmp_path: Path) -> None:
    state, status = harness.run(
        job(
            "flaky",
            [
                {
                    "name": "w",
                    "command": flaky(tmp_path / "n", 2),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 3, "backoffSeconds": 0.05},
                }
            ],
        )
    )
    assert state == "succeeded"
    inst = status["instances"][0]
    assert inst["restarts"] == 2 and inst["attempt"] == 3
    restarting = events(status, "Restarting")
    assert len(restarting) == 2 and "exited with code 1; restart 1 of 3" in restarting[0]["message"]


def test_restart_limit_fails_the_job_and_says_why(harness: Harness, tmp_path: Path) -> None:
    state, status = harness.run(
        job(
            "flaky",
            [
                {
                    "name": "w",
                    "command": flaky(tmp_path / "n", 2),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 1, "backoffSeconds": 0.05},
                }
            ],
        )
    )
    assert state == "failed"
    exhausted = events(status, "RestartsExhausted")
    assert exhausted and "has used all 1 restarts" in exhausted[0]["message"]
    assert status["reason"] == "RolesFailed"
    assert (tmp_path / "n").read_text() == "2"  # ran exactly twice


def test_never_policy_does_not_restart(harness: Harness) -> None:
    state, status = harness.run(job("once", [{"name": "w", "command": py("raise SystemExit(3)")}]))
    assert state == "failed"
    assert status["instances"][0]["exitCode"] == 3 and status["instances"][0]["restarts"] == 0


def test_always_restarts_after_success_too(harness: Harness, tmp_path: Path) -> None:
    state, status = harness.run(
        job(
            "svc",
            [
                {
                    "name": "w",
                    "command": flaky(tmp_path / "n", 0),
                    "restartPolicy": {"policy": "Always", "maxRestarts": 2, "backoffSeconds": 0.01},
                }
            ],
        )
    )
    assert state == "succeeded" and (tmp_path / "n").read_text() == "3"


def test_a_restarting_instance_does_not_count_as_failed(harness: Harness, tmp_path: Path) -> None:
    """While its policy will restart it, a failed instance is pending, so the role is not failed."""
    job_id = harness.submit(
        job(
            "flaky",
            [
                {
                    "name": "w",
                    "command": flaky(tmp_path / "n", 1),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 1, "backoffSeconds": 2},
                }
            ],
        )
    )
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        harness.controller.step()
        status = harness.status(job_id)
        if status["instances"] and status["instances"][0]["restarts"] == 1:
            break
        time.sleep(0.1)
    assert status["instances"][0]["state"] == "pending"
    assert status["roles"][0]["state"] != "failed" and status["state"] != "failed"
    assert harness.controller.run_job(job_id) == "succeeded"


@pytest.mark.parametrize("restarts,delay", [(0, 1.0), (1, 2.0), (2, 4.0), (10, 60.0)])
def test_backoff_doubles_and_is_capped(restarts: int, delay: float) -> None:
    policy = RestartPolicy(policy="OnFailure", max_restarts=20, backoff_seconds=1)
    assert decide(policy, 1, restarts).delay == delay


def test_decisions_follow_the_policy_kind() -> None:
    assert not decide(RestartPolicy(policy="OnFailure"), 0, 0).restart
    assert decide(RestartPolicy(policy="Always"), 0, 0).restart
    assert not decide(RestartPolicy(policy="Never"), 1, 0).restart
    assert decide(RestartPolicy(policy="OnFailure", max_restarts=2), 1, 2).exhausted


def test_immediate_restart_reregisters_the_address(harness: Harness, tmp_path: Path) -> None:
    """Backoff 0: the instance fails and runs again within one reconcile pass."""
    state, status = harness.run(
        job(
            "quick",
            [
                {
                    "name": "w",
                    "command": flaky(tmp_path / "n", 2),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 3, "backoffSeconds": 0},
                }
            ],
        )
    )
    assert state == "succeeded" and status["instances"][0]["restarts"] == 2


def test_an_instance_that_cannot_start_fails_by_its_policy(harness: Harness, tmp_path: Path) -> None:
    """Restart policy applies to an attempt the OS refuses to start (missing workingDir): the
    instance fails with reason StartFailed naming the path, and the other replicas still start."""
    missing = tmp_path / "no-such-dir"
    state, status = harness.run(
        job(
            "nostart",
            [
                {"name": "good", "replicas": 2, "command": py("pass")},
                {
                    "name": "bad",
                    "command": py("pass"),
                    "workingDir": str(missing),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 1, "backoffSeconds": 0.05},
                },
            ],
        )
    )
    assert state == "failed"
    by_role = {i["role"]: i for i in status["instances"] if i["state"] != "stopped"}
    bad = by_role["bad"]
    assert bad["reason"] == "StartFailed" and str(missing) in bad["message"]
    assert bad["restarts"] == 1
    good = [i for i in status["instances"] if i["role"] == "good"]
    assert len(good) == 2 and all(i["pid"] for i in good)  # started beside the refused one


class Silent(LocalBackend):
    """A local backend whose instances' host stops answering while ``silent`` is set."""

    silent = False
    asked_to_stop: list[int] = []

    def observe(self, handles):
        if self.silent:
            return [
                Observation(Phase.UNREACHABLE, reason="HostSilent", message="no answer from the host") for _ in handles
            ]
        return super().observe(handles)

    def stop(self, handles, grace):
        self.asked_to_stop = [*self.asked_to_stop, *(h.pid for h in handles)]
        silent, self.silent = self.silent, False  # the host answers the stop (best case)
        super().stop(handles, grace)
        self.silent = silent


def test_an_unreachable_instance_is_unknown_then_back_or_lost(tmp_path: Path) -> None:
    """Instance state unknown: its host does not answer. It goes back to running when the host
    answers again; past the grace it is taken as lost and its restart policy acts."""
    backend = Silent()
    h = Harness(tmp_path, backend)
    h.controller.unreachable_grace = 0.5
    job_id = h.submit(
        job(
            "far",
            [
                {
                    "name": "w",
                    "command": py("import time; time.sleep(60)"),
                    "restartPolicy": {"policy": "OnFailure", "maxRestarts": 1, "backoffSeconds": 0},
                }
            ],
        )
    )
    h.controller.step()
    first = h.status(job_id)["instances"][0]
    assert first["state"] == "running"
    backend.silent = True
    h.controller.step()
    inst = h.status(job_id)["instances"][0]
    assert inst["state"] == "unknown" and inst["reason"] == "HostSilent"
    assert h.status(job_id)["state"] == "running"  # unknown is not failure
    backend.silent = False
    h.controller.step()
    assert h.status(job_id)["instances"][0]["state"] == "running" and events(h.status(job_id), "Reachable")
    backend.silent = True
    h.controller.step()
    time.sleep(0.6)
    h.controller.step()  # past the grace: lost, restarted by its policy (a new attempt)
    backend.silent = False
    status = h.status(job_id)
    inst = status["instances"][0]
    assert inst["restarts"] == 1 and "did not answer for 0.5s" in events(status, "Restarting")[0]["message"]
    assert backend.asked_to_stop == [first["pid"]] and not pids_alive([first["pid"]])  # never two copies
    h.controller.cancel(job_id)
    assert h.controller.run_job(job_id) == "cancelled"
    backend.close()


def test_restart_scope_job_restarts_every_instance(harness: Harness, tmp_path) -> None:
    """Mechanism: restartPolicy scope Job (Volcano RestartJob): one instance failing stops every
    instance of the job and starts them all again; maxRestarts counts those job restarts."""
    marker = tmp_path / "starts"
    flaky = (
        f"import os, time; open({str(marker)!r}, 'a').write(os.environ['TM_ROLE'] + '\\n'); "
        f"n = open({str(marker)!r}).read().count('flaky'); time.sleep(0.5); raise SystemExit(1 if n < 2 else 0)"
    )
    steady = f"import os, time; open({str(marker)!r}, 'a').write(os.environ['TM_ROLE'] + '\\n'); time.sleep(60)"
    policy = {"policy": "OnFailure", "scope": "Job", "maxRestarts": 3, "backoffSeconds": 0}
    state, status = harness.run(
        job(
            "restart-job",
            [
                {"name": "steady", "replicas": 2, "command": py(steady), "restartPolicy": policy},
                {"name": "flaky", "command": py(flaky), "restartPolicy": policy},
            ],
            statusPolicy={"failed": "any", "succeeded": {"roles": ["flaky"]}},
        )
    )
    assert state == "succeeded", status["events"][-10:]
    starts = marker.read_text().split()
    assert starts.count("flaky") == 2 and starts.count("steady") == 4  # both steady ones restarted too
    assert len(events(status, "RestartingGroup")) == 1


def test_restart_scope_role_leaves_other_roles_running(harness: Harness, tmp_path) -> None:
    """Mechanism: restartPolicy scope Role (Volcano RestartTask): the failed instance's role
    restarts as a whole, the other roles keep running; past maxRestarts the role fails."""
    marker = tmp_path / "starts"
    record = f"import os, time; open({str(marker)!r}, 'a').write(os.environ['TM_ROLE'] + '\\n'); "
    policy = {"policy": "OnFailure", "scope": "Role", "maxRestarts": 1, "backoffSeconds": 0}
    state, status = harness.run(
        job(
            "restart-role",
            [
                {"name": "other", "command": py(record + "time.sleep(60)")},
                {
                    "name": "group",
                    "replicas": 2,
                    "restartPolicy": policy,
                    "command": py(
                        record + "time.sleep(0.5 if os.environ['TM_REPLICA_INDEX'] == '0' else 60); raise SystemExit(1)"
                    ),
                },
            ],
        )
    )
    assert state == "failed"
    starts = marker.read_text().split()
    assert starts.count("other") == 1 and starts.count("group") == 4  # one restart of both group instances
    assert len(events(status, "RestartingGroup")) == 1


@pytest.mark.parametrize("code, restarted", [(3, True), (4, False)])
def test_restart_only_on_listed_exit_codes(harness: Harness, tmp_path, code: int, restarted: bool) -> None:
    """Mechanism: restartPolicy exitCodes (Volcano exitCode policies): only a failure with a
    listed code restarts; another code fails the instance at once."""
    marker = tmp_path / "tried"
    script = (
        f"import os, sys; p = {str(marker)!r}; sys.exit(0) if os.path.exists(p) else (open(p, 'w'), sys.exit({code}))"
    )
    state, status = harness.run(
        job(
            "codes",
            [
                {
                    "name": "a",
                    "command": py(script),
                    "restartPolicy": {"policy": "OnFailure", "exitCodes": [3], "maxRestarts": 2, "backoffSeconds": 0},
                }
            ],
        )
    )
    assert state == ("succeeded" if restarted else "failed")
    assert status["instances"][0]["restarts"] == int(restarted)


@pytest.mark.parametrize("code, restarted", [(1, False), (137, True)])
def test_kubeflow_exit_code_policy_restarts_after_signals_only(code: int, restarted: bool) -> None:
    """Mechanism: Kubeflow restartPolicy ExitCode: 1-127 are permanent, 128-255 retryable."""
    policy = RestartPolicy(policy="ExitCode", max_restarts=3)
    assert decide(policy, code, 0).restart == restarted
    assert not decide(policy, 0, 0).restart
