"""Mechanisms: the controller service answers every bad input with a 4xx that names the field
(validation: "an invalid job is rejected with a message that says which field is wrong and
why"), never a 5xx; request size and JSON depth limits (413, chunked bodies included); job paths
confined to the job's folder; frameworks never imported from a job file; the server's backend;
job names unique among active jobs, ids never reused; the last-resort 500 handler."""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from api_server import ThreadedServer
from trainmaster.service.app import ServiceOptions
from trainmaster.spec.paths import PathPolicy

pytestmark = pytest.mark.timeout(120)

JOB: dict[str, Any] = {
    "apiVersion": "trainmaster/v1",
    "kind": "Job",
    "metadata": {"name": "j"},
    "spec": {"roles": [{"name": "w", "command": ["true"]}]},
}


def mutated(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(JOB)
    change(doc)
    return doc


def role(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["spec"]["roles"][0].__setitem__(key, value)


def spec(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["spec"].__setitem__(key, value)


PYTORCH_BAD_RESTART = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {"name": "p"},
    "spec": {
        "pytorchReplicaSpecs": {
            "Master": {
                "restartPolicy": {},
                "template": {"spec": {"containers": [{"name": "pytorch", "command": ["true"]}]}},
            }
        }
    },
}

# The requests of issue 17 that made the server answer 500, and the field each must name.
FORMER_500S: dict[str, tuple[dict[str, Any], str]] = {
    "replicas 10**30": (mutated(role("replicas", 10**30)), "spec.roles[0].replicas"),
    "memory of 5000 digits": (mutated(role("resources", {"memory": "9" * 5000})), "spec.roles[0].resources.memory"),
    "NUL in output.path": (mutated(spec("output", {"path": "out\x00put"})), "spec.output.path"),
    "role name given as a list": (mutated(role("name", ["a"])), "spec.roles[0].name"),
    "preset: []": (mutated(spec("statusPolicy", {"preset": []})), "spec.statusPolicy.preset"),
    "spec given as a string": (mutated(lambda d: d.__setitem__("spec", "x")), "spec"),
    "frameworkParams as a string": (mutated(spec("frameworkParams", "x")), "spec.frameworkParams"),
    "Master.restartPolicy: {}": (PYTORCH_BAD_RESTART, "spec.pytorchReplicaSpecs.Master.restartPolicy"),
    "workingDir of 5000 characters": (mutated(role("workingDir", "a" * 5000)), "spec.roles[0].workingDir"),
    "roles named in a policy as nested lists": (
        mutated(spec("statusPolicy", {"failed": {"roles": [["a"]]}})),
        "spec.statusPolicy.failed",
    ),
    "command: []": (mutated(role("command", [])), "spec.roles[0].command"),
    "name of digits only": (mutated(lambda d: d["metadata"].__setitem__("name", "12345")), "metadata.name"),
    "minAvailable 10**30": (mutated(spec("scheduling", {"minAvailable": 10**30})), "spec.scheduling.minAvailable"),
    "cpu NaN-like huge": (mutated(role("resources", {"cpu": 1e300})), "spec.roles[0].resources.cpu"),
    # issue 38: the converter asked the file system whether the 5000-character directory exists
    "PyTorchJob container workingDir of 5000 characters": (
        {
            **PYTORCH_BAD_RESTART,
            "spec": {
                "pytorchReplicaSpecs": {
                    "Master": {
                        "template": {
                            "spec": {"containers": [{"name": "pytorch", "command": ["true"], "workingDir": "w" * 5000}]}
                        }
                    }
                }
            },
        },
        "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].workingDir",
    ),
}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server that only answers (no reconcile thread): submitted jobs are stored, never run."""
    root = tmp_path_factory.mktemp("api")
    allowed = root / "allowed"
    allowed.mkdir()
    options = ServiceOptions(paths=PathPolicy(allowed_roots=(allowed,)))
    with ThreadedServer(root, reconcile=False, options=options) as url:
        yield url


@pytest.mark.parametrize("case", list(FORMER_500S))
def test_former_500s_are_422_naming_the_field(api: str, case: str) -> None:
    document, field = FORMER_500S[case]
    reply = httpx.post(f"{api}/api/v1/jobs", json=document, timeout=30)
    assert reply.status_code == 422, reply.text
    assert any(d.startswith(field) for d in reply.json()["details"]), reply.json()
    assert httpx.get(f"{api}/healthz", timeout=10).status_code == 200


def test_long_or_huge_job_references_are_4xx(api: str) -> None:
    assert (
        httpx.post(
            f"{api}/api/v1/jobs", json=mutated(lambda d: d["metadata"].__setitem__("name", "ref")), timeout=30
        ).status_code
        == 201
    )
    for path in ("9" * 5000, "9" * 40, "x" * 64, "²", "1²", "٣"):  # found by schemathesis: '²'.isdigit()
        assert 400 <= httpx.get(f"{api}/api/v1/jobs/{path}", timeout=30).status_code < 500
    for path in ("²", "٣"):
        assert httpx.request("DELETE", f"{api}/api/v1/jobs/{path}", json={}, timeout=30).status_code == 404
        assert httpx.post(f"{api}/api/v1/jobs/{path}/cancel", json={}, timeout=30).status_code == 404
    reply = httpx.post(f"{api}/api/v1/jobs/ref/scale", json={"role": "w", "replicas": 10**30}, timeout=30)
    assert reply.status_code == 422 and "replicas" in reply.text
    for params in ({"index": "9" * 40}, {"events": "9" * 40}, {"role": "r" * 500}):
        url = f"{api}/api/v1/jobs/ref" + ("/logs" if "events" not in params else "")
        assert httpx.get(url, params=params, timeout=30).status_code == 422


def test_large_bodies_are_413_announced_or_chunked(api: str) -> None:
    """Request limits: over 1 MiB is refused whether Content-Length says so or a chunked body
    (no Content-Length) streams it; JSON nested deeper than 32 levels is refused too."""
    big = b'{"pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    announced = httpx.post(f"{api}/api/v1/jobs", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert announced.status_code == 413

    def chunks() -> Iterator[bytes]:
        yield b'{"pad": "'
        for _ in range(64):
            yield b"x" * 65536
        yield b'"}'

    chunked = httpx.post(
        f"{api}/api/v1/jobs", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert chunked.status_code == 413 and "over" in chunked.json()["error"]
    body = json.dumps(mutated(spec("frameworkParams", {"x": "DEEP"}))).replace(
        '"DEEP"', "[" * 5000 + '"leaf"' + "]" * 5000
    )
    nested = httpx.post(f"{api}/api/v1/jobs", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert nested.status_code == 413 and "nested" in nested.json()["error"]
    assert httpx.get(f"{api}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "field,value",
    [
        ("output", {"path": "/etc/trainmaster-out"}),
        ("output", {"path": "../../escape"}),
        ("workingDir", "/"),
        ("workingDir", "a/../../b"),
        ("workingDir", "~/x"),
    ],
)
def test_job_paths_may_not_leave_the_job_folder(api: str, field: str, value: Any) -> None:
    """Job paths: absolute paths outside the operator's allow-list and '..' escapes are refused."""
    change = spec(field, value) if field == "output" else role(field, value)
    reply = httpx.post(f"{api}/api/v1/jobs", json=mutated(change), timeout=30)
    assert reply.status_code == 422, reply.text
    assert any(("output.path" if field == "output" else "workingDir") in d for d in reply.json()["details"])


def test_job_paths_relative_to_the_job_folder_or_allowed(api: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Job paths: a relative output.path resolves inside the job's run folder (not the server's
    working directory); an absolute one under an allowed directory is accepted."""
    doc = mutated(spec("output", {"path": "results/model"}))
    doc["metadata"]["name"] = "relative-out"
    reply = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30)
    assert reply.status_code == 201, reply.text
    status = httpx.get(f"{api}/api/v1/jobs/{reply.json()['id']}", timeout=30).json()
    assert status["outputPath"] == str(Path(status["runDir"]) / "results" / "model")
    allowed = next(p for p in Path(status["runDir"]).parents if (p / "allowed").is_dir()) / "allowed"
    doc = mutated(spec("output", {"path": str(allowed / "x")}))
    doc["metadata"]["name"] = "allowed-out"
    assert httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30).status_code == 201


def test_framework_addresses_in_a_job_are_never_imported(api: str, tmp_path: Path) -> None:
    """Framework registry: naming a file or module that is not installed or allow-listed is a 422
    listing the installed frameworks; the file is never executed by the server."""
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    for address in (str(evil), f"{evil}:Framework", "subprocess:Popen"):
        reply = httpx.post(f"{api}/api/v1/jobs", json=mutated(spec("framework", address)), timeout=30)
        assert reply.status_code == 422
        assert any("unknown framework" in d and "installed: command" in d for d in reply.json()["details"])
    assert not marker.exists()


def test_a_backend_the_server_does_not_run_is_refused(api: str) -> None:
    reply = httpx.post(f"{api}/api/v1/jobs", json=mutated(spec("scheduling", {"backend": "ray"})), timeout=30)
    assert reply.status_code == 422 and "spec.scheduling.backend" in reply.json()["details"][0]


def test_names_unique_among_active_jobs(api: str) -> None:
    doc = mutated(lambda d: d["metadata"].__setitem__("name", "once"))
    first = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30)
    assert first.status_code == 201
    second = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30)
    assert second.status_code == 409 and "still active" in second.json()["detail"]


def test_every_problem_reported_at_once(api: str) -> None:
    """Validation reports every problem: invalid replicas and a too-large minAvailable together."""
    doc = mutated(role("replicas", 0))
    doc["spec"]["scheduling"] = {"minAvailable": 5, "queue": "Bad Queue"}
    details = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30).json()["details"]
    fields = {d.split(":")[0] for d in details}
    assert {"spec.roles[0].replicas", "spec.scheduling.minAvailable", "spec.scheduling.queue"} <= fields, details


def test_ids_are_never_reused_and_active_names_free_again(tmp_path: Path) -> None:
    """Store: a deleted job's id is not given to the next job (whose logs would be the old
    job's); once a job ended, its name may be used again."""
    with ThreadedServer(tmp_path, reconcile=True) as url:
        doc = mutated(lambda d: d["metadata"].__setitem__("name", "short"))
        first = httpx.post(f"{url}/api/v1/jobs", json=doc, timeout=30).json()["id"]
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/api/v1/jobs/{first}", timeout=30).json()["state"] != "succeeded":
            assert time.monotonic() < deadline, "job 'short' did not succeed within 60 s"
            time.sleep(0.1)
        assert httpx.request("DELETE", f"{url}/api/v1/jobs/{first}", json={}, timeout=30).status_code == 200
        second = httpx.post(f"{url}/api/v1/jobs", json=doc, timeout=30)
        assert second.status_code == 201 and second.json()["id"] > first


def test_unexpected_errors_are_logged_and_answered_without_internals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last line of defence: an unexpected exception is a 500 whose body says nothing of the
    internals, and its traceback goes to the server's log."""
    server = ThreadedServer(tmp_path, reconcile=False)

    def broken_submit(*_args: Any, **_kwargs: Any) -> list[int]:
        raise RuntimeError("secret-internal-detail")

    # the server stores submits in batches (Trainmaster.submit -> Controller.submit_batch)
    server.controller.submit_batch = broken_submit  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="trainmaster.service"), server as url:
        reply = httpx.post(f"{url}/api/v1/jobs", json=JOB, timeout=30)
        assert reply.status_code == 500 and "secret" not in reply.text
        assert reply.json()["error"].startswith("internal error")
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    assert any("secret-internal-detail" in (r.exc_text or "") or r.exc_info for r in caplog.records)


@pytest.mark.parametrize(
    "body",
    [
        '{"metadata": {"name": "s"}, "spec": {"roles": [{"name": "w", "command": ["\\ud800"]}]}}',
        '{"metadata": {"name": "s"}, "spec": {"roles": [{"name": "w", "command": ["true"], "env": {"\\udfff": "x"}}]}}',
        '{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "s"}, "spec": {"\\ud800": 1}}',
    ],
)
def test_text_no_program_can_take_is_refused_by_path(api: str, body: str) -> None:
    """Lone surrogates (valid JSON escapes, not text): 422 naming the field, never a 500 while
    the answer is encoded, never a job that cannot start."""
    reply = httpx.post(f"{api}/api/v1/jobs", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 422, reply.text
    assert any("lone surrogate" in d and d.startswith("spec.") for d in reply.json()["details"]), reply.json()


def test_foreign_files_are_read_strictly_unless_lenient(api: str) -> None:
    """Strict reading through the API: a typo in a PyTorchJob is a 422 naming its path in the
    submitted file; ?lenient=true accepts the job and lists what was ignored."""
    doc = copy.deepcopy(PYTORCH_BAD_RESTART)
    doc["metadata"]["name"] = "lenient-pt"
    doc["spec"]["pytorchReplicaSpecs"]["Master"] = {
        "replica": 1,
        "template": {"spec": {"containers": [{"name": "pytorch", "command": ["true"]}]}},
    }
    strict = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30)
    assert strict.status_code == 422
    assert "spec.pytorchReplicaSpecs.Master.replica: unknown field (did you mean 'replicas'?)" in strict.text
    lenient = httpx.post(f"{api}/api/v1/jobs", params={"lenient": "true"}, json=doc, timeout=30)
    assert lenient.status_code == 201, lenient.text
    assert any(
        line.startswith("spec.pytorchReplicaSpecs.Master.replica: unknown field, ignored")
        for line in lenient.json()["ignored"]
    )


def test_suspend_and_unsuspend_over_the_api(api: str) -> None:
    """runPolicy.suspend through the API: POST /jobs/{job}/suspend and /unsuspend flip the stored
    flag (the controller holds or starts the job); an unknown job is a 404, never a 500."""
    doc = mutated(lambda d: d["metadata"].__setitem__("name", "held"))
    doc["spec"]["runPolicy"] = {"suspend": True}
    job_id = httpx.post(f"{api}/api/v1/jobs", json=doc, timeout=30).json()["id"]
    again = httpx.post(f"{api}/api/v1/jobs/{job_id}/suspend", json={}, timeout=30)
    assert again.status_code == 200 and again.json() == {"id": job_id, "suspended": True, "changed": False}
    released = httpx.post(f"{api}/api/v1/jobs/{job_id}/unsuspend", json={}, timeout=30)
    assert released.status_code == 200 and released.json()["changed"] is True
    twice = httpx.post(f"{api}/api/v1/jobs/{job_id}/unsuspend", json={}, timeout=30)
    assert twice.json() == {"id": job_id, "suspended": False, "changed": False}  # the stored flag is clear
    assert httpx.post(f"{api}/api/v1/jobs/no-such-job/unsuspend", json={}, timeout=30).status_code == 404


BROWSER = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def test_the_dashboard_finds_jobs_by_name_and_shows_browsers_html_errors(api: str) -> None:
    """Mechanism (the dashboard, REST's sibling): a job's page answers at /jobs/<name>, <id> or
    <uid>, as the CLI takes them (issue 38: /jobs/pytorch-digits answered a JSON validation
    error); a browser whose page request fails (no such job, a reference too long to be one, no
    such page) gets an HTML page with the status and what went wrong, while API clients keep
    their JSON answers."""
    created = httpx.post(
        f"{api}/api/v1/jobs", json=mutated(lambda d: d["metadata"].__setitem__("name", "by-name")), timeout=30
    )
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    uid = httpx.get(f"{api}/api/v1/jobs/{job_id}", timeout=30).json()["uid"]
    for ref in ("by-name", str(job_id), uid):
        page = httpx.get(f"{api}/jobs/{ref}", headers=BROWSER, timeout=30)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), (ref, page.text)
        assert "by-name" in page.text and f"/ui/jobs/{job_id}/summary" in page.text
    for path, status, says in (
        ("/jobs/no-such-job", 404, "no job &#39;no-such-job&#39;"),
        ("/jobs/" + "x" * 64, 422, "at most 63 characters"),
        ("/no/such/page", 404, "Not Found"),
    ):
        page = httpx.get(f"{api}{path}", headers=BROWSER, timeout=30)
        assert page.status_code == status and page.headers["content-type"].startswith("text/html"), page.text
        assert says in page.text and '<a href="/">' in page.text, page.text
        machine = httpx.get(f"{api}{path}", timeout=30)  # no Accept: text/html, as API clients ask
        assert machine.status_code == status and machine.headers["content-type"] == "application/json"
    api_answer = httpx.get(f"{api}/api/v1/jobs/no-such-job", headers=BROWSER, timeout=30)
    assert api_answer.status_code == 404 and api_answer.headers["content-type"] == "application/json"
