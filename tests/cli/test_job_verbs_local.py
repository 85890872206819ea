"""Mechanisms: the job verbs (`trainmaster job list|status|logs|wait|cancel|scale|delete`) work without
a server on the store `trainmaster run` wrote (through the facade), and against a real server
with `--server`; user mistakes (unknown job, no store, no server at the URL) exit 2 with
`error:` and no traceback (controller spec, step 7: states and counts a user can query at any
time, with or without a server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from helpers import free_port
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(180)

LINES = "import sys\nfor i in range(5): print('line', i, flush=True)\n"
SLEEPER = "import time; print('up', flush=True); time.sleep(120)"


def write_job(tmp_path: Path, name: str, code: str, replicas: int = 1) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "trainmaster/v1",
                "kind": "Job",
                "metadata": {"name": name},
                "spec": {"roles": [{"name": "w", "replicas": replicas, "command": [sys.executable, "-c", code]}]},
            }
        )
    )
    return path


@pytest.fixture
def env(isolated_home: Path) -> dict[str, str]:
    """The test's Trainmaster home, no store URL and no server named: the local store is used."""
    out = {k: v for k, v in os.environ.items() if k not in ("TRAINMASTER_DB", "TRAINMASTER_SERVER")}
    return {**out, "TRAINMASTER_HOME": str(isolated_home), "COLUMNS": "500"}  # messages unwrapped


def tm(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def assert_user_error(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


def test_verbs_read_the_store_of_trainmaster_run(tmp_path: Path, env: dict[str, str]) -> None:
    assert_user_error(tm(env, "job", "list"), "no store at", "trainmaster job run")  # nothing ran yet
    ran = tm(env, "job", "run", str(write_job(tmp_path, "lines", LINES, replicas=2)), "--interval", "0.1")
    assert ran.returncode == 0, ran.stdout + ran.stderr

    listed = json.loads(tm(env, "job", "list", "--json").stdout)
    assert [(j["name"], j["state"]) for j in listed] == [("lines", "succeeded")]
    assert "lines" in tm(env, "job", "list").stdout
    status = json.loads(tm(env, "job", "status", "lines", "--json").stdout)
    assert status["roles"][0]["counts"]["succeeded"] == 2
    assert "succeeded" in tm(env, "job", "status", "lines").stdout
    assert tm(env, "job", "logs", "lines", "--index", "1").stdout.count("line") == 5
    assert tm(env, "job", "logs", "lines", "--tail", "2").stdout == "line 3\nline 4\n"
    assert tm(env, "logs", "lines", "--follow").stdout.count("line") == 5  # the old flat alias; ended: returns
    assert "already ended" in tm(env, "job", "cancel", "lines").stdout
    waited = tm(env, "job", "wait", "lines", "--timeout", "5")
    assert waited.returncode == 0 and "succeeded" in waited.stdout

    assert_user_error(tm(env, "job", "status", "nope"), "no job 'nope'")
    assert_user_error(tm(env, "job", "logs", "lines", "--index", "7"), "no instance")
    assert_user_error(tm(env, "job", "scale", "lines", "w", "3"), "has ended")
    assert tm(env, "job", "delete", "lines").returncode == 0
    assert_user_error(tm(env, "job", "status", "lines"), "no job 'lines'")


def test_scale_and_cancel_a_running_trainmaster_run_without_a_server(tmp_path: Path, env: dict[str, str]) -> None:
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "job",
            "run",
            str(write_job(tmp_path, "slow", SLEEPER)),
            "--interval",
            "0.1",
            "--grace",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(env, "slow", lambda s: s["state"] == "running")
        assert tm(env, "job", "delete", "slow").returncode == 2  # still running: cancel first
        waited = tm(env, "job", "wait", "slow", "--timeout", "0.3")
        assert waited.returncode == 1 and "still running after 0.3 s" in waited.stderr, waited.stderr
        assert "scaled to 2" in tm(env, "job", "scale", "slow", "w", "2").stdout
        _wait_for(env, "slow", lambda s: sum(i["state"] == "running" for i in s["instances"]) == 2)
        cancelled = tm(env, "job", "cancel", "slow")
        assert cancelled.returncode == 0 and "cancellation requested" in cancelled.stdout
        output, _ = run.communicate(timeout=60)  # the run command carries the cancellation out and ends
        assert run.returncode == 1 and "cancelled" in output, output
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    status = json.loads(tm(env, "job", "status", "slow", "--json").stdout)
    assert status["state"] == "cancelled"
    assert [(i["state"], i["reason"]) for i in status["instances"]] == [("stopped", "Stopped")] * 2


def _wait_for(env: dict[str, str], job: str, condition, timeout: float = 60) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        out = tm(env, "job", "status", job, "--json")
        if out.returncode == 0:
            last = json.loads(out.stdout)
            if condition(last):
                return last
        time.sleep(0.3)
    raise AssertionError(f"job {job}: condition not met within {timeout:g} s; last status {last.get('state')}")


def test_the_same_verbs_against_a_real_server(tmp_path: Path, env: dict[str, str]) -> None:
    server = ServerProcess(tmp_path, home=Path(env["TRAINMASTER_HOME"]))
    try:
        remote = {**env, "TRAINMASTER_DB": server.env["TRAINMASTER_DB"]}
        via = ("--server", server.url)
        out = tm(remote, "job", "submit", str(write_job(tmp_path, "lines", LINES, replicas=2)), *via)
        assert out.returncode == 0 and "submitted job lines" in out.stdout, out.stderr
        waited = tm(remote, "job", "wait", "lines", "--timeout", "60", *via)
        assert waited.returncode == 0 and "succeeded" in waited.stdout, waited.stdout + waited.stderr
        assert [j["name"] for j in json.loads(tm(remote, "job", "list", "--json", *via).stdout)] == ["lines"]
        assert tm(remote, "job", "logs", "lines", "--index", "1", *via).stdout.count("line") == 5
        assert tm(remote, "job", "logs", "lines", "--tail", "1", *via).stdout == "line 4\n"  # ?tail=1 on the API
        both = httpx.get(f"{server.url}/api/v1/jobs/lines/logs", params={"tail": 1, "follow": True}, timeout=10)
        assert both.status_code == 422 and "choose one" in both.json()["error"]
        assert_user_error(tm(remote, "job", "status", "nope", *via), "no job 'nope'")
        # TRAINMASTER_SERVER picks the server as --server does
        assert "lines" in tm({**remote, "TRAINMASTER_SERVER": server.url}, "job", "list").stdout
        # the server's store is readable without the server too (same answers)
        assert json.loads(tm(remote, "job", "status", "lines", "--json").stdout)["state"] == "succeeded"
        assert tm(remote, "job", "delete", "lines", *via).returncode == 0
    finally:
        server.stop()


def test_no_server_at_the_url_is_a_clear_error(tmp_path: Path, env: dict[str, str]) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    assert_user_error(tm(env, "job", "status", "x", "--server", nobody), "cannot reach the controller service", nobody)
    assert_user_error(
        tm(env, "job", "submit", str(write_job(tmp_path, "j", LINES)), "--server", nobody),
        "submit needs a running controller service",
        nobody,
        "trainmaster job run",
    )


def test_without_a_terminal_results_headers_and_tables_are_neither_wrapped_nor_cut(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Piped or redirected (a script, a CI log), the CLI prints lines as long as they are: a
    job's JSON result stays one parsable line, its header and status are whole, tables are not
    cut with an ellipsis, and an error is one line (issue 38: rich wrapped or cut all of these
    at 80 columns when there was no terminal)."""
    env = {k: v for k, v in env.items() if k != "COLUMNS"}  # no terminal, no width given: as a pipe is
    name = "a-job-with-a-rather-long-name-that-fills-the-header"
    metrics = {f"a_rather_long_metric_name_{i}": 0.123456789 for i in range(6)}
    code = f"import json, os; open(os.path.join(os.environ['TM_OUTPUT_DIR'], 'metrics.json'), 'w').write({json.dumps(json.dumps(metrics))})"
    ran = tm(env, "job", "run", str(write_job(tmp_path, name, code)), "--interval", "0.1", timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    result = next(line for line in lines if line.startswith("result: "))
    assert json.loads(result.removeprefix("result: ")) == metrics
    header = next(line for line in lines if line.startswith(f"job {name} (id 1) succeeded"))
    assert header.endswith("the job's success condition is met"), header
    status = tm(env, "job", "status", name)
    assert status.stdout.splitlines()[0].startswith(f"job {name} (id 1) succeeded"), status.stdout
    assert "success condition is met" in status.stdout.splitlines()[0] and "…" not in status.stdout
    listed = tm(env, "job", "list")
    assert name in listed.stdout and "…" not in listed.stdout, listed.stdout
    missing = tm(env, "job", "status", "no-such-job-with-a-name-long-enough-to-wrap-the-error-line")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
