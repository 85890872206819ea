"""Mechanisms: no input makes the controller service answer 5xx. A hypothesis property test
posts job documents generated from the job model's schema and mutated to a real server (uvicorn
on a loopback port), and schemathesis fuzzes every operation of its /openapi.json; after each
request the server still answers."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from api_server import ThreadedServer
from job_strategies import documents

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """No reconcile thread: accepted jobs are stored, never run (generated commands stay data)."""
    with ThreadedServer(tmp_path_factory.mktemp("fuzz"), reconcile=False) as url:
        yield url


def test_generated_and_mutated_jobs_never_get_a_5xx(api: str) -> None:
    client = httpx.Client(base_url=api, timeout=30)
    seen: dict[int, int] = {}

    # no shrinking: against a live server it takes minutes; the failing document is printed as is
    @settings(
        max_examples=600,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )
    @given(document=documents())
    def post(document: Any) -> None:
        reply = client.post("/api/v1/jobs", json=document)
        seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (reply.status_code, reply.text, document)
        if reply.status_code == 422:
            assert reply.json()["details"], reply.text  # every refusal says what is wrong
        assert client.get("/healthz").status_code == 200

    post()
    assert seen.get(422), seen  # the generator reaches the validation, not only the parser
    client.close()


def test_schemathesis_finds_no_server_error(api: str) -> None:
    """Every operation of /openapi.json with schemathesis' generated cases (valid and invalid
    by the schema): never a 5xx, and the server answers after each one. (Driven through each
    operation's hypothesis strategy: schemathesis' pytest plugin does not load under pytest 9.)"""
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
    from schemathesis.checks import not_a_server_error

    operations = [result.ok() for result in schemathesis.openapi.from_url(f"{api}/openapi.json").get_all_operations()]
    assert {"POST /api/v1/jobs", "POST /api/v1/jobs/{ref}/scale", "GET /api/v1/jobs/{ref}/logs"} <= {
        op.label for op in operations
    }
    statuses: dict[str, set[int]] = {}
    for operation in operations:

        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case: Any) -> None:
            response = case.call(base_url=api, timeout=30)
            statuses.setdefault(operation.label, set()).add(response.status_code)
            case.validate_response(response, checks=(not_a_server_error,))
            assert httpx.get(f"{api}/healthz", timeout=10).status_code == 200

        call()
    assert all(code < 500 for codes in statuses.values() for code in codes), statuses
    assert any(code == 422 for code in statuses["POST /api/v1/jobs"]), statuses
