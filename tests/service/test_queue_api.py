"""Mechanisms: queues with quota over REST (create, list, show, replace, delete) and "why
pending" (``GET /api/v1/jobs/{ref}/explain``) on a real server: every mistake a 4xx naming the
field (422), unknown queues and jobs 404, conflicts 409; a hypothesis fuzz of queue bodies and
names never gets a 5xx."""

from __future__ import annotations

import json
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from api_server import ThreadedServer

pytestmark = pytest.mark.timeout(180)


def sleeper(name: str, queue: str, cpu: float) -> dict[str, Any]:
    return {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "roles": [{"name": "w", "command": ["sleep", "60"], "resources": {"cpu": cpu}}],
            "scheduling": {"queue": queue},
        },
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """No reconcile thread: jobs stay queued, so explain reads the quota alone."""
    with ThreadedServer(tmp_path_factory.mktemp("queues"), reconcile=False) as url:
        yield httpx.Client(base_url=url, timeout=30)


def test_queue_create_list_show_replace_delete(api: httpx.Client) -> None:
    """Queue objects over REST: 201 then 409 for the same name; list and show with usage; PUT
    replaces (its body's name must be the path's); DELETE, then 404."""
    body = {
        "name": "team-a",
        "cohort": "org",
        "quota": {"cpu": {"nominal": 4, "borrowingLimit": 2}, "memory": {"nominal": "8Gi"}},
    }
    created = api.post("/api/v1/queues", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["quota"]["memory"]["nominal"] == 8 * 2**30
    again = api.post("/api/v1/queues", json=body)
    assert again.status_code == 409 and "exists already" in again.json()["detail"]
    listed = api.get("/api/v1/queues").json()
    (team,) = [q for q in listed if q["name"] == "team-a"]
    assert team["usage"]["cpu"]["used"] == 0 and team["waiting"] == 0 and team["cohort"] == "org"
    shown = api.get("/api/v1/queues/team-a").json()
    assert shown["admittedJobs"] == [] and shown["waitingJobs"] == []
    wrong = api.put("/api/v1/queues/team-b", json=body)
    assert wrong.status_code == 422 and "path names 'team-b'" in wrong.json()["error"]
    body["quota"]["cpu"]["nominal"] = 6
    replaced = api.put("/api/v1/queues/team-a", json=body)
    assert replaced.status_code == 200 and replaced.json()["quota"]["cpu"]["nominal"] == 6
    assert api.request("DELETE", "/api/v1/queues/team-a", json={}).status_code == 200
    missing = api.get("/api/v1/queues/team-a")
    assert missing.status_code == 404 and "trainmaster queue create" in missing.json()["detail"]
    assert api.request("DELETE", "/api/v1/queues/team-a", json={}).status_code == 404


@pytest.mark.parametrize(
    "body, field",
    [
        ({"name": "a", "quota": {}}, "quota"),
        ({"name": "a", "quota": {"cpu": {"nominal": -1}}}, "quota.cpu.nominal"),
        ({"name": "a", "quota": {"tpu": {"nominal": 1}}}, "quota.tpu"),
        ({"name": "a", "quota": {"memory": {"nominal": "lots"}}}, "quota"),
        ({"name": "a", "quota": {"cpu": {"nominal": 1, "borrowingLimit": 1}}}, "need a cohort"),
        ({"name": "Bad Name", "quota": {"cpu": {"nominal": 1}}}, "name"),
        ({"name": "a", "quota": {"cpu": {"nominal": 1}}, "extra": 1}, "extra"),
        ({"name": "a", "weight": "heavy", "quota": {"cpu": {"nominal": 1}}}, "weight"),
        ([], "body"),
    ],
)
def test_invalid_queues_are_refused_naming_the_field(api: httpx.Client, body: Any, field: str) -> None:
    """Validation at the boundary: a bad queue is 422 and its details name the field."""
    reply = api.post("/api/v1/queues", json=body)
    assert reply.status_code == 422, reply.text
    assert any(field in d for d in reply.json()["details"]), reply.json()


def test_explain_says_which_quota_blocks_a_job_and_its_position(api: httpx.Client) -> None:
    """Why pending over REST: the blocking resource and limit with the shortfall, the position in
    the queue, and 404 for jobs that do not exist (odd references included)."""
    assert api.post("/api/v1/queues", json={"name": "small", "quota": {"cpu": {"nominal": 1}}}).status_code == 201
    assert api.post("/api/v1/jobs", json=sleeper("fits", "small", 1)).status_code == 201
    assert api.post("/api/v1/jobs", json=sleeper("too-big", "small", 3)).status_code == 201
    fits = api.get("/api/v1/jobs/fits/explain").json()
    assert fits["pending"] and fits["position"] == 1 and fits["blocking"] == []
    big = api.get("/api/v1/jobs/too-big/explain").json()
    assert big["position"] == 2 and big["waitingInQueue"] == 2
    (block,) = big["blocking"]
    assert (block["resource"], block["limit"], block["shortBy"]) == ("cpu", "queue maximum", 2)
    assert "waiting for quota of queue 'small'" in big["summary"]
    for ref in ("nope", "9" * 40, "²", "1" * 18):
        assert api.get(f"/api/v1/jobs/{ref}/explain").status_code == 404, ref


def test_a_queue_with_jobs_is_not_deleted(api: httpx.Client) -> None:
    """Queue objects: deleting a queue that still holds jobs is a 409 saying how many."""
    api.post("/api/v1/queues", json={"name": "busy", "quota": {"cpu": {"nominal": 1}}})
    api.post("/api/v1/jobs", json=sleeper("waiting", "busy", 1))
    reply = api.request("DELETE", "/api/v1/queues/busy", json={})
    assert reply.status_code == 409 and "1 job(s) not ended" in reply.json()["detail"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
AMOUNT = st.integers(-5, 2**70) | st.floats() | st.text(max_size=12) | st.none() | JSON
QUEUES = st.fixed_dictionaries(
    {"name": st.text(max_size=70) | st.just("q")},
    optional={
        "cohort": st.text(max_size=70) | st.none(),
        "weight": AMOUNT,
        "quota": st.dictionaries(
            st.sampled_from(["cpu", "memory", "gpu", "tpu"]),
            st.fixed_dictionaries({}, optional={"nominal": AMOUNT, "borrowingLimit": AMOUNT, "lendingLimit": AMOUNT})
            | JSON,
            max_size=3,
        )
        | JSON,
    },
)


def test_fuzzed_queue_bodies_and_names_never_get_a_5xx(api: httpx.Client) -> None:
    """No input gives a 500: generated queue bodies (POST, PUT) and names (GET, DELETE, explain)."""

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(body=QUEUES, name=st.text(min_size=1, max_size=80).filter(lambda s: "/" not in s and s not in (".", "..")))
    def send(body: dict[str, Any], name: str) -> None:
        name = quote(name, safe="")
        for method, path, payload in (
            ("POST", "/api/v1/queues", body),
            ("PUT", f"/api/v1/queues/{name}", body),
            ("GET", f"/api/v1/queues/{name}", None),
            ("GET", f"/api/v1/jobs/{name}/explain", None),
            ("DELETE", f"/api/v1/queues/{name}", None),
        ):
            body_json = payload if payload is not None else ({} if method != "GET" else None)
            # json.dumps writes a float's inf and nan as the tokens Infinity and NaN, which are not
            # JSON: the server must refuse them with a 4xx too (httpx's json= cannot send them)
            reply = api.request(
                method,
                path,
                content=None if body_json is None else json.dumps(body_json),
                headers={"content-type": "application/json"},
            )
            assert reply.status_code < 500, (method, path, payload, reply.status_code, reply.text)
        assert api.get("/api/v1/queues").status_code == 200

    send()


def test_dashboard_queue_page_shows_usage_and_waiting_jobs(api: httpx.Client) -> None:
    """Dashboard: /queues shows each queue's usage against its nominal quota and its waiting jobs
    in order, names escaped."""
    api.post(
        "/api/v1/queues",
        json={"name": "shown", "cohort": "org", "quota": {"cpu": {"nominal": 2}, "memory": {"nominal": "1Gi"}}},
    )
    api.post("/api/v1/jobs", json=sleeper("first-in-line", "shown", 1))
    page = api.get("/queues", headers={"accept": "text/html"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "shown" in text and "cohort org" in text and "first-in-line" in text and "1Gi" in text
