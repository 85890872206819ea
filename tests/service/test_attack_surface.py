"""The controller service as an attacker sees it (issue 39), over a real socket: DNS rebinding
(the Host check), cross-site state changes of the REST API (JSON only, no foreign Origin, no
cookie), YAML alias bombs on the dashboard and a YAML body on the REST API, 2**63 and beyond in
every dashboard path and query, 100,000-instance jobs, paged status answers, and the security
headers and offline /docs.

Mechanisms: the controller service's validation ("an invalid job is rejected with a message that
says which field is wrong and why", extended to sizes a server can hold) and status you can query
at any time (controller.md), served safely."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import ThreadedServer
from test_yaml_bombs import alias_bomb
from trainmaster.service.app import ServiceOptions
from trainmaster.service.protect import ServedHosts
from trainmaster.service.quotas import JobQuota

pytestmark = pytest.mark.timeout(180)

BIG = ("9223372036854775808", "18446744073709551616", "99999999999999999999999")  # 2**63, 2**64, 10**23-1


def job(name: str, replicas: list[int] | int = 1) -> dict[str, Any]:
    counts = replicas if isinstance(replicas, list) else [replicas]
    return {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"roles": [{"name": f"r{i}", "replicas": n, "command": ["true"]} for i, n in enumerate(counts)]},
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """No reconcile thread: jobs are stored, never run. Small quotas, one configured name."""
    options = ServiceOptions(
        hosts=ServedHosts.for_listener("127.0.0.1", ["trainmaster.example.internal"]),
        quota=JobQuota(per_job=5_000, per_server=5_040),
    )
    with ThreadedServer(tmp_path_factory.mktemp("attack"), reconcile=False, options=options) as url:
        yield url


def csrf_token(api: str) -> str:
    page = httpx.get(f"{api}/submit", timeout=30).text
    return page.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]


def test_a_rebinding_host_gets_nothing(api: str) -> None:
    """DNS rebinding: a page whose name the attacker points at 127.0.0.1 sends its own name in
    Host; it gets a 400 without the page's CSRF token or any job, while the names the server
    serves (addresses, localhost, its machine's names, --allow-host) get the page."""
    port = api.rsplit(":", 1)[1]
    httpx.post(f"{api}/api/v1/jobs", json=job("listed"), timeout=30).raise_for_status()
    for path in ("/", "/api/v1/jobs", "/submit", "/metrics"):
        reply = httpx.get(f"{api}{path}", headers={"Host": f"rebind.attacker.example:{port}"}, timeout=30)
        assert reply.status_code == 400, (path, reply.status_code)
        assert "csrf-token" not in reply.text and "listed" not in reply.text
        assert "rebinding" in reply.json()["error"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"trainmaster.example.internal:{port}", f"[::1]:{port}"):
        assert httpx.get(f"{api}/", headers={"Host": host}, timeout=30).status_code == 200, host
    assert httpx.get(f"{api}/", headers={"Host": ""}, timeout=30).status_code == 400


def test_rest_state_changes_need_json_and_their_own_origin(api: str) -> None:
    """What a cross-site form or a no-cors fetch can send (a simple content type, or another
    Origin) changes nothing: 415/403 before any route runs; JSON from a client acts."""
    job_id = httpx.post(f"{api}/api/v1/jobs", json=job("csrf-target"), timeout=30).json()["id"]
    for verb in ("cancel", "suspend", "unsuspend", "resume"):
        for content_type in (None, "application/x-www-form-urlencoded", "text/plain", "multipart/form-data; b=x"):
            headers = {"Content-Type": content_type} if content_type else {}
            reply = httpx.post(f"{api}/api/v1/jobs/{job_id}/{verb}", content=b"a=b", headers=headers, timeout=30)
            assert reply.status_code == 415, (verb, content_type, reply.status_code)
        foreign = httpx.post(
            f"{api}/api/v1/jobs/{job_id}/{verb}", json={}, headers={"Origin": "http://127.0.0.1:1"}, timeout=30
        )
        assert foreign.status_code == 403, verb
    assert httpx.request("DELETE", f"{api}/api/v1/jobs/{job_id}", timeout=30).status_code == 415
    status = httpx.get(f"{api}/api/v1/jobs/{job_id}", timeout=30).json()
    assert status["state"] == "pending"
    assert not any(e["reason"] in ("CancelRequested", "Suspended") for e in status["events"]), status["events"]
    same_origin = httpx.post(f"{api}/api/v1/jobs/{job_id}/cancel", json={}, headers={"Origin": api}, timeout=30)
    assert same_origin.status_code == 200 and same_origin.json()["cancelRequested"] is True


def test_rest_api_takes_no_yaml(api: str) -> None:
    """The REST API reads JSON only (no YAML, so no aliases); its JSON is bounded in bytes and depth."""
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\n"
    reply = httpx.post(
        f"{api}/api/v1/jobs", content=bomb.encode(), headers={"Content-Type": "application/yaml"}, timeout=30
    )
    assert reply.status_code == 415


def test_alias_bombs_on_the_dashboard(api: str) -> None:
    """/ui/validate and /ui/submit refuse a 9-level alias bomb (10**9 values) at once, saying
    why; nothing is stored. (Before the bound, six levels took seconds of CPU, nine never end.)"""
    bomb = alias_bomb(9)
    assert len(bomb) < 1024
    token = csrf_token(api)
    before = httpx.get(f"{api}/api/v1/jobs", timeout=30).json()
    for action in ("validate", "submit"):
        started = time.monotonic()
        reply = httpx.post(f"{api}/ui/{action}", data={"document": bomb}, headers={"X-CSRF-Token": token}, timeout=60)
        assert time.monotonic() - started < 10, action
        assert reply.status_code == 200 and "aliases" in reply.text, (action, reply.text[:500])
    assert httpx.get(f"{api}/api/v1/jobs", timeout=30).json() == before
    anchors = (
        "apiVersion: trainmaster/v1\nkind: Job\nmetadata:\n  name: shared-env\nspec:\n  roles:\n"
        "  - name: a\n    command: ['true']\n    env: &env {A: '1', B: '2'}\n"
        "  - name: b\n    command: ['true']\n    env: *env\n"
    )
    ok = httpx.post(f"{api}/ui/validate", data={"document": anchors}, headers={"X-CSRF-Token": token}, timeout=30)
    assert ok.status_code == 200 and "aliases" not in ok.text and 'class="ok' in ok.text


def dashboard_paths(job_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("GET", f"/jobs/{job_id}", {}),
        ("GET", f"/ui/jobs/{job_id}/summary", {}),
        ("GET", f"/ui/jobs/{job_id}/views", {}),
        ("GET", f"/ui/jobs/{job_id}/metrics", {}),
        ("GET", f"/ui/jobs/{job_id}/log", {"params": {"instance": "r0-0"}}),
        ("POST", f"/ui/jobs/{job_id}/cancel", {}),
        ("POST", f"/ui/jobs/{job_id}/resume", {}),
        ("POST", f"/ui/jobs/{job_id}/delete", {}),
        ("POST", f"/ui/jobs/{job_id}/scale", {"data": {"role": "r0", "replicas": "2"}}),
    ]


def test_integers_beyond_the_store_are_4xx_everywhere(api: str) -> None:
    """2**63 and larger in every dashboard path and query, and in the /ui actions (with a valid
    CSRF token, so the route itself runs): 4xx, never SQLite's OverflowError as a 500."""
    token = csrf_token(api)
    real = str(httpx.post(f"{api}/api/v1/jobs", json=job("overflow"), timeout=30).json()["id"])
    for big in BIG:
        for method, path, extra in dashboard_paths(big):
            reply = httpx.request(method, f"{api}{path}", headers={"X-CSRF-Token": token}, timeout=30, **extra)
            assert 400 <= reply.status_code < 500, (method, path, reply.status_code, reply.text[:200])
        for path, params in (
            (f"/ui/jobs/{real}/metrics", {"after": big}),
            (f"/ui/jobs/{real}/log", {"instance": "r0-0", "offset": big}),
            (f"/ui/jobs/{real}/log/stream", {"instance": "r0-0", "offset": big}),
            ("/", {"page": big}),
            ("/ui/jobs/table", {"page": big}),
            (f"/api/v1/jobs/{big}", {}),
            ("/api/v1/jobs/overflow", {"instancesFrom": big}),
        ):
            reply = httpx.get(f"{api}{path}", params=params, timeout=30)
            assert 400 <= reply.status_code < 500, (path, params, reply.status_code, reply.text[:200])
        stream = httpx.get(
            f"{api}/ui/jobs/{real}/log/stream",
            params={"instance": "r0-0"},
            headers={"Last-Event-ID": big},
            timeout=30,
        )
        assert 400 <= stream.status_code < 500
    assert httpx.get(f"{api}/healthz", timeout=30).json()["ok"]


def test_a_100000_instance_job_is_refused_with_its_field_path(api: str) -> None:
    """10 roles x 10,000 replicas: 422 naming spec.roles and the limit, in well under a second of
    work, and nothing stored; on the dashboard too. The server's total is bounded as well (429)."""
    started = time.monotonic()
    reply = httpx.post(f"{api}/api/v1/jobs", json=job("huge", [10_000] * 10), timeout=60)
    assert time.monotonic() - started < 10
    assert reply.status_code == 422, reply.text
    detail = " ".join(reply.json()["details"])
    assert "spec.roles" in detail and "100,000" in detail and "5,000" in detail
    assert all(j["name"] != "huge" for j in httpx.get(f"{api}/api/v1/jobs", timeout=30).json()["items"])
    import yaml

    shown = httpx.post(
        f"{api}/ui/validate",
        data={"document": yaml.safe_dump(job("huge", [10_000] * 10))},
        headers={"X-CSRF-Token": csrf_token(api)},
        timeout=60,
    )
    assert 'data-path="spec.roles"' in shown.text and "100,000" in shown.text
    # 5,000 fit one job; the server holds at most 5,040 in jobs that have not ended
    first = httpx.post(f"{api}/api/v1/jobs", json=job("big-one", 5_000), timeout=60)
    assert first.status_code == 201, first.text
    second = httpx.post(f"{api}/api/v1/jobs", json=job("big-two", 100), timeout=60)
    assert second.status_code == 429 and second.headers["Retry-After"], second.text
    grow = httpx.post(f"{api}/api/v1/jobs/big-one/scale", json={"role": "r0", "replicas": 6_000}, timeout=60)
    assert grow.status_code == 422 and "5,000" in grow.text
    assert httpx.post(f"{api}/api/v1/jobs/big-one/cancel", json={}, timeout=30).status_code == 200


def test_status_answers_page_their_instances(tmp_path: Path) -> None:
    """A job's status lists one page of instances (``instances``/``instancesFrom``) and says how
    many there are; the dashboard's job page shows the first 500 and says so."""
    from trainmaster.store.models import InstanceRow

    server = ThreadedServer(tmp_path, reconcile=False)
    with server as api:
        job_id = httpx.post(f"{api}/api/v1/jobs", json=job("paged", 600), timeout=60).json()["id"]
        with server.controller.sessions() as session:  # the rows a reconcile pass would create
            session.add_all(InstanceRow(job_id=job_id, role="r0", index=i) for i in range(600))
            session.commit()
        page = httpx.get(
            f"{api}/api/v1/jobs/{job_id}", params={"instances": 100, "instancesFrom": 250}, timeout=30
        ).json()
        assert page["instanceCount"] == 600 and page["instancesFrom"] == 250
        assert [i["index"] for i in page["instances"]] == list(range(250, 350))
        default = httpx.get(f"{api}/api/v1/jobs/{job_id}", timeout=30).json()
        assert len(default["instances"]) == 600  # under the default page of 1,000
        assert httpx.get(f"{api}/api/v1/jobs/{job_id}", params={"instances": 10_001}, timeout=30).status_code == 422
        html = httpx.get(f"{api}/jobs/{job_id}", timeout=30).text
        assert html.count('<tr id="inst-') == 500 and "500 of 600 instances shown" in html


def test_every_answer_carries_the_security_headers_and_docs_are_local(api: str) -> None:
    """No framing (X-Frame-Options, CSP frame-ancestors), no sniffing, no referrer, scripts from
    this origin only; /docs is swagger-ui from the package, not a CDN."""
    for path in ("/", "/api/v1/jobs", "/docs", "/openapi.json", "/static/dashboard.js", "/jobs/1"):
        reply = httpx.get(f"{api}{path}", timeout=30)
        assert reply.headers["x-frame-options"] == "DENY", path
        assert "frame-ancestors 'none'" in reply.headers["content-security-policy"], path
        assert "script-src 'self'" in reply.headers["content-security-policy"], path
        assert reply.headers["x-content-type-options"] == "nosniff", path
        assert reply.headers["referrer-policy"] == "no-referrer", path
    refused = httpx.get(f"{api}/", headers={"Host": "evil.example"}, timeout=30)
    assert refused.headers["x-frame-options"] == "DENY"
    docs = httpx.get(f"{api}/docs", timeout=30).text
    assert "http://" not in docs and "https://" not in docs and "cdn" not in docs.lower()
    for asset in (
        "/static/swagger-ui/swagger-ui-bundle.js",
        "/static/swagger-ui/swagger-ui.css",
        "/static/swagger-init.js",
    ):
        assert httpx.get(f"{api}{asset}", timeout=30).status_code == 200, asset
    assert httpx.get(f"{api}/redoc", timeout=30).status_code == 404
