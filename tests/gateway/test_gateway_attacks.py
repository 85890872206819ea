"""Attacks against real gateway and party processes: each is refused with a clear error, the
handler is never reached after an authentication failure, and no state changes."""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from cryptography.hazmat.primitives import serialization
from gateway_harness import Deployment
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmaster.gateway.initiator.client import Initiator
from trainmaster.gateway.initiator.taskfile import LegSpec
from trainmaster.gateway.crypto.envelope import Identity, b64d, b64e, make_header, seal
from trainmaster.gateway.models import Envelope
from trainmaster.gateway.crypto.provision import issue_cert, make_ca
from trainmaster.gateway.net.tls import client_ssl_context

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    d = Deployment(tmp_path_factory.mktemp("attacks"), ["a", "b"]).start_all()
    ini = d.initiator()
    created = ini.create_task(
        "t1", [LegSpec(data_id="m_a", party="a", rule="row_count"), LegSpec(data_id="m_b", party="b", rule="row_count")]
    )
    assert all(c["ok"] for c in created.values())
    ini.close()
    yield d
    d.stop_all()


def _state(dep: Deployment) -> dict[str, Any]:
    g, a, b = dep.health("gateway"), dep.health("a"), dep.health("b")
    return {
        "legs": g["legs"],
        "g": g["handled"],
        "a": (a["handled"], a["executors"]),
        "b": (b["handled"], b["executors"]),
    }


def _post(dep: Deployment, target: str, path: str, body: str | bytes, as_: str = "initiator") -> httpx.Response:
    with httpx.Client(verify=client_ssl_context(dep.cfg(as_)), timeout=10) as http:
        return http.post(f"{dep.url(target)}{path}", content=body, headers={"content-type": "application/json"})


def _initiator_env(
    ini: Initiator, recipient: str, kind: str, task_id: str, data_id: str, payload: dict, now: float | None = None
) -> Envelope:
    return seal(
        ini.me, ini.roster[recipient], make_header("initiator", recipient, kind, task_id, data_id, 60, now=now), payload
    )


def test_certificate_from_foreign_ca_is_refused(dep: Deployment, tmp_path: Path) -> None:
    """Mutual TLS: a client certificate from another CA (or none) fails the handshake."""
    before = _state(dep)
    key, cert = issue_cert(*make_ca("evil CA"), "initiator", "initiator")
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    foreign = ssl.create_default_context(cafile=dep.cfg("initiator").ca)
    foreign.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    no_cert = ssl.create_default_context(cafile=dep.cfg("initiator").ca)
    for ctx in (foreign, no_cert):
        with httpx.Client(verify=ctx, timeout=5) as http, pytest.raises(httpx.TransportError):
            http.get(f"{dep.url('gateway')}/v1/health").raise_for_status()
    assert _state(dep) == before


def test_unregistered_party_is_refused(dep: Deployment) -> None:
    """Roster: an identity not in the roster cannot report an executor (403), nothing recorded."""
    before = _state(dep)
    mallory = Identity.generate("mallory")
    roster_gw = dep.initiator().roster["gateway"]
    env = seal(
        mallory,
        roster_gw,
        make_header("mallory", "gateway", "executor_report", "t9", "m_x"),
        {"task_id": "t9", "data_id": "m_x", "address": "unix:/tmp/x", "call": {"rule": "row_count", "params": {}}},
    )
    resp = _post(dep, "gateway", "/v1/executors", env.model_dump_json())
    assert resp.status_code == 403 and "not in the roster" in resp.json()["detail"]
    assert _state(dep) == before


def test_party_cannot_take_over_another_partys_leg(dep: Deployment) -> None:
    """Leg ownership: party a reporting an executor for party b's leg is refused (409)."""
    before = _state(dep)
    from trainmaster.gateway.crypto.provision import load_identity

    a = load_identity(dep.cfg("a"))
    gw = dep.initiator().roster["gateway"]
    env = seal(
        a,
        gw,
        make_header("a", "gateway", "executor_report", "t1", "m_b"),
        {"task_id": "t1", "data_id": "m_b", "address": "unix:/tmp/evil", "call": {"rule": "row_count", "params": {}}},
    )
    resp = _post(dep, "gateway", "/v1/executors", env.model_dump_json(), as_="a")
    assert resp.status_code == 409 and "belongs to party 'b'" in resp.json()["detail"]
    after = _state(dep)
    assert after["legs"] == before["legs"] and after["a"] == before["a"] and after["b"] == before["b"]


def test_replay_inside_and_outside_window_is_refused(dep: Deployment) -> None:
    """Replay protection over the wire: the same receive request twice -> 409; an old one -> 401."""
    ini = dep.initiator()
    env = _initiator_env(ini, "gateway", "data_receive", "t1", "*", {"task_id": "t1", "data_ids": ["m_a"]})
    assert _post(dep, "gateway", "/v1/receive", env.model_dump_json()).status_code == 200
    before = _state(dep)
    again = _post(dep, "gateway", "/v1/receive", env.model_dump_json())
    assert again.status_code == 409 and "replayed" in again.json()["detail"]
    old = _initiator_env(
        ini, "gateway", "data_receive", "t1", "*", {"task_id": "t1", "data_ids": ["m_a"]}, now=time.time() - 3600
    )
    stale = _post(dep, "gateway", "/v1/receive", old.model_dump_json())
    assert stale.status_code == 401 and "expired" in stale.json()["detail"]
    assert _state(dep) == before


@pytest.mark.parametrize("field", ["task_id", "issued_at", "eph_pub", "nonce", "ciphertext", "signature"])
def test_flipped_bit_is_refused_before_the_handler(dep: Deployment, field: str) -> None:
    """Integrity over the wire: one flipped bit in an envelope field -> 4xx, handler never reached."""
    ini = dep.initiator()
    d = _initiator_env(ini, "gateway", "data_receive", "t1", "*", {"task_id": "t1", "data_ids": ["m_a"]}).model_dump(
        mode="json"
    )
    if field == "task_id":
        d["header"]["task_id"] = "t0"
    elif field == "issued_at":
        d["header"]["issued_at"] += 0.001
    else:
        raw = bytearray(b64d(d[field]))
        raw[3] ^= 0x10
        d[field] = b64e(bytes(raw))
    before = _state(dep)
    resp = _post(dep, "gateway", "/v1/receive", Envelope.model_validate(d).model_dump_json())
    assert resp.status_code == 401 and "bad signature" in resp.json()["detail"]
    assert _state(dep) == before


def test_stripped_signature_is_refused(dep: Deployment) -> None:
    """Strict request models: an envelope without a signature is a 422 and changes nothing."""
    d = _initiator_env(
        dep.initiator(), "gateway", "data_receive", "t1", "*", {"task_id": "t1", "data_ids": ["m_a"]}
    ).model_dump(mode="json")
    del d["signature"]
    before = _state(dep)
    import json

    assert _post(dep, "gateway", "/v1/receive", json.dumps(d)).status_code == 422
    assert _state(dep) == before


@pytest.mark.parametrize("data_id,status", [("..%2Fa%2Fm_a", 400), ("../a/m_a", 400), ("m_a", 404)])
def test_path_traversal_in_data_id_is_refused(dep: Deployment, data_id: str, status: int) -> None:
    """Data ids never name a path: traversal is refused by the model, foreign data ids by the party."""
    ini = dep.initiator()
    header_id = data_id if status == 404 else "m_b"
    env = _initiator_env(
        ini,
        "b",
        "task_create",
        "t2",
        header_id,
        {"task_id": "t2", "party": "b", "data_id": data_id, "call": {"rule": "row_count", "params": {}}},
    )
    before = _state(dep)
    resp = _post(dep, "b", "/v1/tasks", env.model_dump_json())
    assert resp.status_code == status, resp.text
    assert _state(dep)["b"][1] == before["b"][1] and _state(dep)["legs"] == before["legs"]


@pytest.mark.parametrize(
    "call",
    [
        {"rule": "exec", "params": {"source": "import os"}},
        {"rule": "summary_stats", "params": {"code": "__import__('os').system('id')"}},
        {"rule": "summary_stats", "params": {}, "code": "x"},
    ],
)
def test_unregistered_rule_or_inline_code_is_refused(dep: Deployment, call: dict) -> None:
    """Rule registry at the party: unknown rules and any code-carrying field -> 400, no executor."""
    ini = dep.initiator()
    env = _initiator_env(
        ini, "a", "task_create", "t3", "m_a", {"task_id": "t3", "party": "a", "data_id": "m_a", "call": call}
    )
    before = _state(dep)
    resp = _post(dep, "a", "/v1/tasks", env.model_dump_json())
    assert resp.status_code == 400 and resp.json()["detail"]
    after = _state(dep)
    assert after["a"][1] == before["a"][1] and after["legs"] == before["legs"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=12,
)
HEADERISH = st.fixed_dictionaries(
    {
        "header": st.dictionaries(
            st.sampled_from(
                ["v", "msg_id", "kind", "task_id", "data_id", "sender", "recipient", "issued_at", "expires_at"]
            ),
            JSON,
        ),
        "eph_pub": JSON,
        "nonce": JSON,
        "ciphertext": JSON,
        "signature": JSON,
    }
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(JSON, HEADERISH),
    path=st.sampled_from(
        [("gateway", "/v1/receive"), ("gateway", "/v1/executors"), ("a", "/v1/tasks"), ("a", "/v1/transfer")]
    ),
)
def test_malformed_requests_get_4xx_and_change_nothing(dep: Deployment, body: Any, path: tuple[str, str]) -> None:
    """Malformed requests (generated from the envelope schema's shape) get 4xx and change nothing."""
    import json

    before = _state(dep)
    resp = _post(dep, path[0], path[1], json.dumps(body))
    assert 400 <= resp.status_code < 500
    assert _state(dep) == before


def _impostor_app(a: Identity, gw_pub: Any) -> FastAPI:
    """Sits on b's port with b's TLS certificate but answers with party a's signed result."""
    fake = FastAPI()

    @fake.post("/v1/transfer")
    async def transfer(request: Request) -> dict[str, Any]:
        h = Envelope.model_validate_json(await request.body()).header
        return seal(
            a,
            gw_pub,
            make_header("a", "gateway", "transfer_result", h.task_id, h.data_id),
            {"ok": True, "result_text": '{"rows":1}'},
        ).model_dump(mode="json")

    return fake


def test_zz_result_signed_by_another_party_is_rejected(dep: Deployment) -> None:
    """Party a answering party b's leg: a result envelope signed by a for b's leg is refused at the
    gateway (outcome `rejected`); runs last because it replaces b with an impostor on b's port."""
    import uvicorn

    from trainmaster.gateway.crypto.provision import load_identity

    dep.kill("b")
    fake = _impostor_app(load_identity(dep.cfg("a")), dep.initiator().roster["gateway"])
    cfg = dep.cfg("b")
    server = uvicorn.Server(
        uvicorn.Config(
            fake,
            host=cfg.host,
            port=cfg.port,
            ssl_keyfile=cfg.key,
            ssl_certfile=cfg.cert,
            ssl_ca_certs=cfg.ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED,
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        ini = dep.initiator()
        out = ini.receive("t1", ["m_b"], leg_timeout_s=10, parties={"m_b": "b"})
        ini.close()
        assert out["m_b"]["outcome"] == "rejected"
        assert "signed by 'a'" in out["m_b"]["detail"]
        assert "result" not in out["m_b"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
