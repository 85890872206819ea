"""Mechanisms: dependencies between roles with the injected wait step, the address registry,
and the per-role communication service (controller spec, steps 4 and 5)."""

from controller_harness import Harness, events, job, py, server_client_job


def test_clients_wait_for_the_server_address_and_connect(harness: Harness) -> None:
    state, status = harness.run(server_client_job("svc", clients=3))
    assert state == "succeeded", status["events"]
    by_role = {}
    for inst in status["instances"]:
        by_role.setdefault(inst["role"], []).append(inst)
    server = by_role["server"][0]
    # The registry time of the server precedes the moment any client's command started.
    for client in by_role["client"]:
        assert client["state"] == "succeeded"
    with harness.sessions() as session:
        from sqlalchemy import select

        from trainmaster.store.models import InstanceRow

        rows = session.scalars(select(InstanceRow)).all()
        server_running = next(r.running_at for r in rows if r.role == "server")
        for r in rows:
            if r.role == "client":
                assert r.running_at >= server_running
    assert server["address"].startswith("127.0.0.1:")


def test_instances_see_tm_variables(harness: Harness, tmp_path) -> None:
    out = tmp_path / "env"
    out.mkdir()
    code = (
        "import os, json\n"
        f"open('{out}/' + os.environ['TM_ROLE'] + os.environ['TM_REPLICA_INDEX'], 'w').write("
        "json.dumps({k: v for k, v in os.environ.items() if k.startswith('TM_')}))\n"
    )
    state, _ = harness.run(
        job(
            "env",
            [
                {"name": "ps", "ports": 2, "command": py(code + "import time; time.sleep(1)")},
                {"name": "my-worker", "replicas": 2, "command": py(code), "dependsOn": [{"role": "ps"}]},
            ],
        )
    )
    assert state == "succeeded"
    import json

    worker = json.loads((out / "my-worker1").read_text())
    ps = json.loads((out / "ps0").read_text())
    assert worker["TM_JOB_NAME"] == "env" and worker["TM_REPLICA_INDEX"] == "1" and worker["TM_REPLICAS"] == "2"
    assert worker["TM_SERVICE_PS"] == f"127.0.0.1:{ps['TM_PORT']}"
    assert len(ps["TM_PORTS"].split(",")) == 2 and ps["TM_PORTS"].startswith(ps["TM_PORT"])
    assert "TM_OUTPUT_DIR" in worker and "TM_SERVICE_MY_WORKER" not in ps


def test_succeeded_condition_waits_for_completion(harness: Harness, tmp_path) -> None:
    marker = tmp_path / "prepared"
    state, status = harness.run(
        job(
            "stages",
            [
                {"name": "prepare", "command": py(f"import time; time.sleep(0.5); open('{marker}', 'w').write('x')")},
                {
                    "name": "train",
                    "command": py(f"import os; assert os.path.exists('{marker}')"),
                    "dependsOn": [{"role": "prepare", "condition": "Succeeded"}],
                },
            ],
        )
    )
    assert state == "succeeded", status["events"]


def test_dependency_timeout_fails_with_a_clear_reason(harness: Harness) -> None:
    state, status = harness.run(
        job(
            "stuck",
            [
                {"name": "slow", "command": py("import time; time.sleep(30)")},
                {
                    "name": "after",
                    "command": py("print('never')"),
                    "dependsOn": [{"role": "slow", "condition": "Succeeded", "timeoutSeconds": 1}],
                },
            ],
        )
    )
    assert state == "failed"
    after = next(i for i in status["instances"] if i["role"] == "after")
    assert after["reason"] == "DependencyTimeout"
    assert "waited 1s for role 'slow' (Succeeded)" in after["message"]
    slow = next(i for i in status["instances"] if i["role"] == "slow")
    assert slow["state"] == "stopped"  # the job ended: the rest was stopped
    assert events(status, "Failed")


def test_a_dependency_that_already_succeeded_still_counts_as_running(harness: Harness) -> None:
    """The registry keeps a succeeded instance's address, so a late dependent is not stranded."""
    state, status = harness.run(
        job(
            "late",
            [
                {"name": "early", "command": py("pass")},
                {
                    "name": "after",
                    "command": py("import os; assert os.environ['TM_SERVICE_EARLY'].startswith('127.0.0.1:')"),
                    "dependsOn": [{"role": "early", "timeoutSeconds": 20}],
                },
            ],
        )
    )
    assert state == "succeeded", status["events"]


def test_an_attempt_that_runs_and_ends_between_two_passes_keeps_its_running_time(harness: Harness) -> None:
    """Status roll-up and instance times: a dependent instance that passes its wait step, runs
    and exits while no reconcile pass looks is never observed running, yet its record says when
    its command started (as Kubernetes keeps ``startedAt`` of a container that already ended)."""
    import time as clock

    from trainmaster.contract import InstancePhase
    from trainmaster.store.models import InstanceRow

    job_id = harness.submit(
        job(
            "between",
            [
                {"name": "server", "command": py("import time; time.sleep(30)")},
                {"name": "client", "command": py("pass"), "dependsOn": [{"role": "server"}]},
            ],
        )
    )
    harness.controller.step()  # starts both; the server is running, the client in its wait step
    with harness.sessions() as session:
        client = session.query(InstanceRow).filter_by(job_id=job_id, role="client").one()
        client_id = client.handle.instance_id
        assert client.state == "starting" and client.running_at is None
    deadline = clock.monotonic() + 60
    # the node journals its exit (its process gone is not enough: the journal line follows it,
    # and a pass in between would rightly still see the instance running)
    while harness.backend.agent.observe([client_id])[0].phase != InstancePhase.EXITED:
        assert clock.monotonic() < deadline, "the node never journaled the client's exit"
        clock.sleep(0.05)
    harness.controller.step()
    with harness.sessions() as session:
        rows = {r.role: r for r in session.query(InstanceRow).filter_by(job_id=job_id)}
        assert rows["client"].state == "succeeded"
        assert rows["client"].running_at is not None
        assert rows["server"].running_at <= rows["client"].running_at <= rows["client"].ended_at
    harness.controller.cancel(job_id)
    harness.controller.step()
