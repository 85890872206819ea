"""The attack suite of issue #15: one test per numbered item, against real gateway and party
processes over mutual TLS on loopback. Each docstring names the item it covers."""

from __future__ import annotations

import json
import logging
import resource
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from gateway_harness import Deployment

from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.crypto.envelope import b64e, make_header, seal
from trainmaster.gateway.models import Envelope, LegAttestation, LegOutcomePayload, TaskResult
from trainmaster.gateway.crypto.provision import load_identity
from trainmaster.gateway.net.service import RateLimitedLog
from trainmaster.gateway.net.tls import client_ssl_context, expect

pytestmark = pytest.mark.timeout(240)
CAP = 1 << 20


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(
        tmp_path_factory.mktemp("security"),
        ["a", "b", "c", "d"],
        initiators=["initiator", "bob"],
        overrides={
            "gateway": {
                "header_timeout_s": 1.5,
                "body_timeout_s": 3.0,
                "max_body_bytes": CAP,
                "max_open_legs_per_party": 40,
            },
            "a": {"max_body_bytes": CAP},
            "c": {"max_executors": 2, "max_queued_legs": 1, "max_connections": 4},
            "d": {"privacy_budget": 30},
        },
    ).start_all()
    yield d
    d.stop_all()


def _row(p: str) -> LegSpec:
    return LegSpec(data_id=f"m_{p}", party=p, rule="row_count")


def _http(dep: Deployment, as_: str) -> httpx.Client:
    return httpx.Client(verify=client_ssl_context(dep.cfg(as_)), timeout=15)


def _post(dep: Deployment, target: str, path: str, body: Any, as_: str = "initiator") -> httpx.Response:
    with _http(dep, as_) as http:
        return http.post(f"{dep.url(target)}{path}", content=body, headers={"content-type": "application/json"})


def _sealed(
    dep: Deployment, sender: str, recipient: str, kind: str, task_id: str, data_id: str, payload: dict
) -> Envelope:
    me = load_identity(dep.cfg(sender))
    roster = dep.initiator().roster
    return seal(me, roster[recipient], make_header(sender, recipient, kind, task_id, data_id, 60), payload)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, timeout=180)


# ---- item 1 ---------------------------------------------------------------------------------------


def test_item1_a_party_cannot_fetch_report_or_answer_another_partys_leg(dep: Deployment) -> None:
    """Item 1 (leg hijacking), at the gateway: party a cannot report b's leg (its own channel and key:
    409), nor send a report signed by b over its own TLS connection (403: the envelope's sender must
    be the mTLS peer), nor claim a leg under a task id that does not exist (no squatting)."""
    ini = dep.initiator()
    assert all(c["ok"] for c in ini.create_task("hj1", [_row("a"), _row("b")]).values())
    report = {"data_id": "m_b", "address": "unix:/tmp/evil", "call": {"rule": "row_count", "params": {}}}
    own = _sealed(dep, "a", "gateway", "executor_report", "hj1", "m_b", {"task_id": "hj1", **report})
    resp = _post(dep, "gateway", "/v1/executors", own.model_dump_json(), as_="a")
    assert resp.status_code == 409 and "belongs to party 'b'" in resp.json()["detail"]
    forged = _sealed(dep, "b", "gateway", "executor_report", "hj1", "m_b", {"task_id": "hj1", **report})
    resp = _post(dep, "gateway", "/v1/executors", forged.model_dump_json(), as_="a")
    assert resp.status_code == 403 and "TLS connection of 'a'" in resp.json()["detail"]
    future = _sealed(
        dep, "a", "gateway", "executor_report", "future9", "m_a", {"task_id": "future9", **report, "data_id": "m_a"}
    )
    resp = _post(dep, "gateway", "/v1/executors", future.model_dump_json(), as_="a")
    assert resp.status_code == 409 and "no leg" in resp.json()["detail"]
    out = ini.receive("hj1", ["m_a", "m_b"], leg_timeout_s=20)
    ini.close()
    assert {k: (v["outcome"], v["party"]) for k, v in out.items()} == {"m_a": ("result", "a"), "m_b": ("result", "b")}


def test_item1_the_initiator_believes_only_the_assigned_partys_signature(dep: Deployment) -> None:
    """Item 1 (leg hijacking), at the initiator: even an outcome the gateway itself signs is refused
    unless the result's attestation is signed by the party this initiator assigned the leg to, for
    exactly this task and data id; the party printed is the signed one."""
    ini = dep.initiator()
    ini.create_task("hj2", [_row("b")])
    good = ini.receive("hj2", ["m_b"], leg_timeout_s=20)["m_b"]
    assert good["outcome"] == "result" and good["party"] == "b"
    gw, a = load_identity(dep.cfg("gateway")), load_identity(dep.cfg("a"))
    text = json.dumps({"rows": 999})
    import hashlib

    from trainmaster.gateway.crypto.envelope import attest

    def forged(signer: Any, task_id: str = "hj2", data_id: str = "m_b", party_field: str = "b") -> Envelope:
        att = attest(
            signer,
            LegAttestation(
                task_id=task_id,
                data_id=data_id,
                party=signer.name,
                sha256=hashlib.sha256(text.encode()).hexdigest(),
                size=len(text),
            ),
        )
        body = LegOutcomePayload(
            task_id="hj2", data_id="m_b", party=party_field, outcome="result", result_text=text, attestation=att
        )
        return seal(
            gw,
            ini.roster["initiator"],
            make_header("gateway", "initiator", "task_result", "hj2", "m_b", 60),
            body.model_dump(mode="json"),
        )

    from trainmaster.gateway.crypto.envelope import EnvelopeError

    with pytest.raises(EnvelopeError, match="expected 'b'"):
        ini._verify_leg("hj2", "m_b", forged(a))  # a's data presented as b's leg
    b = load_identity(dep.cfg("b"))
    with pytest.raises(EnvelopeError, match="expected 'b' for \\(hj2, m_b\\)"):
        ini._verify_leg("hj2", "m_b", forged(b, task_id="other"))  # b's answer to another leg, replayed
    ini.close()


# ---- item 2 ---------------------------------------------------------------------------------------


def test_item2_task_ids_are_never_reused_and_retries_are_idempotent_only_with_the_same_body(
    dep: Deployment, tmp_path: Path
) -> None:
    """Item 2 (task id reuse): a retried create with the same body is idempotent (the same results
    again), another body under a used id is refused with 409 and a clear message, also from the
    CLI (exit 2, no traceback), so stale results are never returned for a new task."""
    ini = dep.initiator()
    first = ini.run_task(TaskSpec(task_id="reuse1", legs=[_row("a")]))
    assert first["legs"]["m_a"]["outcome"] == "result"
    assert ini.register_task("reuse1", [_row("a")]).created is False  # same body: a retry
    again = ini.run_task(TaskSpec(task_id="reuse1", legs=[_row("a")]))
    assert again["legs"]["m_a"]["result"] == first["legs"]["m_a"]["result"]
    from trainmaster.errors import UserError

    with pytest.raises(UserError, match="never reused"):
        ini.register_task("reuse1", [LegSpec(data_id="m_a", party="a", rule="summary_stats")])
    ini.close()
    task = tmp_path / "task.yaml"
    task.write_text("task_id: reuse1\nlegs:\n  - {data_id: m_b, party: b, rule: row_count}\n")
    out = _cli("task", "run", "--config", str(dep.configs["initiator"]), str(task))
    assert out.returncode == 2 and "never reused" in out.stderr and "Traceback" not in out.stderr


def test_a_task_file_run_again_says_it_shows_the_earlier_runs_results_or_refuses_with_fresh(
    dep: Deployment, tmp_path: Path
) -> None:
    """Task id used before (issue 36): running a task file whose task_id an earlier run created
    never silently shows that run's stored results: stderr and the report's `earlier_run` say so
    and when it ran (nothing runs again); with --fresh the CLI refuses (exit 2, one message)."""
    task = tmp_path / "task.yaml"
    task.write_text("task_id: again1\nlegs:\n  - {data_id: m_a, party: a, rule: row_count}\n")
    first = _cli("task", "run", "--config", str(dep.configs["initiator"]), str(task))
    assert first.returncode == 0 and "earlier run" not in first.stderr, first.stderr
    assert "earlier_run" not in json.loads(first.stdout)
    second = _cli("task", "run", "--config", str(dep.configs["initiator"]), str(task))
    assert second.returncode == 0, second.stderr
    assert "was created by an earlier run at" in second.stderr and "stored results" in second.stderr
    report = json.loads(second.stdout)
    assert report["earlier_run"]["created_at"] and report["legs"] == json.loads(first.stdout)["legs"]
    fresh = _cli("task", "run", "--fresh", "--config", str(dep.configs["initiator"]), str(task))
    assert fresh.returncode == 2 and "was used before" in fresh.stderr and "Traceback" not in fresh.stderr
    assert fresh.stdout == ""


# ---- item 3 ---------------------------------------------------------------------------------------


def test_item3_chunked_bodies_are_capped_while_streaming_at_gateway_and_party(dep: Deployment) -> None:
    """Item 3 (chunked body cap): a chunked POST without Content-Length, twice the cap, is refused
    with 413 at the gateway and at a party, counted as it arrives (not buffered whole)."""

    def chunks() -> Iterator[bytes]:
        yield b'{"header":{"v":1,"x":"'
        for _ in range(2 * CAP // 65536):
            yield b"A" * 65536
        yield b'"}}'

    for target, path in (("gateway", "/v1/receive"), ("a", "/v1/tasks")):
        with _http(dep, "initiator") as http:
            resp = http.post(f"{dep.url(target)}{path}", content=chunks(), headers={"content-type": "application/json"})
        assert resp.status_code == 413 and "cap" in resp.json()["detail"], (target, resp.text)


# ---- item 4 ---------------------------------------------------------------------------------------


def _raw_tls(dep: Deployment, target: str, as_: str = "initiator") -> ssl.SSLSocket:
    ctx = client_ssl_context(dep.cfg(as_))
    cfg = dep.cfg(target)
    sock = socket.create_connection((cfg.host, cfg.port), timeout=15)
    return ctx.wrap_socket(sock, server_hostname=expect(target, cfg.role)["sni_hostname"])


def _closed_within(sock: ssl.SSLSocket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while data := sock.recv(4096):
            if b"408" in data or b"400" in data:
                continue
        return True
    except (TimeoutError, socket.timeout):
        return False
    except (ssl.SSLError, ConnectionError):
        return True


def test_item4_stalled_connections_time_out_and_connections_are_capped(dep: Deployment) -> None:
    """Item 4 (connection hygiene): an authenticated connection that stalls inside its headers is
    closed after the header timeout, one that stalls inside its body after the body timeout, and a
    party past its connection cap answers 503 instead of taking more work."""
    stalled = _raw_tls(dep, "gateway")
    stalled.sendall(b"POST /v1/receive HTTP/1.1\r\nhost: gateway\r\ncontent-type: appl")
    assert _closed_within(stalled, 10.0)
    slow_body = _raw_tls(dep, "gateway")
    slow_body.sendall(
        b"POST /v1/receive HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b'transfer-encoding: chunked\r\n\r\n5\r\n{"a":\r\n'
    )
    slow_body.settimeout(12)
    answer = b""
    while b"did not arrive" not in answer and (data := slow_body.recv(4096)):
        answer += data
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer
    idle = [_raw_tls(dep, "c") for _ in range(4)]
    try:
        with _http(dep, "operator") as http:
            resp = http.get(f"{dep.url('c')}/v1/health")
        assert resp.status_code == 503
    finally:
        for s in idle:
            s.close()


def test_item4_repeated_log_lines_are_rate_limited() -> None:
    """Item 4 (log flooding): the same error logged 10,000 times (as when file descriptors run out)
    passes the filter 5 times per window, then once more with the count of those suppressed."""
    now = [0.0]
    flt = RateLimitedLog(per_window=5, window_s=10.0, clock=lambda: now[0])
    logger = logging.getLogger("test-flood")
    rec = lambda: logger.makeRecord(
        "asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource", (), None
    )  # noqa: E731
    passed = sum(flt.filter(rec()) for _ in range(10_000))
    assert passed == 5
    now[0] = 11.0
    last = rec()
    assert flt.filter(last) and "9995 similar message(s) suppressed" in last.getMessage()


def test_item4_open_files_limit_is_raised_to_serve_the_connection_cap() -> None:
    """Item 4 (file descriptors at 1,000 concurrent tasks): a service raises its soft open-files
    limit to what its connection cap needs; where the hard limit is lower it raises to the hard
    limit and warns once, naming both limits and the way out."""
    probe = (
        "import logging, resource, sys\n"
        "from trainmaster.gateway.net.service import ensure_fd_limit\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format='%(message)s')\n"
        "hard = int(sys.argv[1])\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))\n"
        "print('soft', ensure_fd_limit(1000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2256:
        pytest.skip(f"this host's hard open-files limit ({hard}) is below what the test needs")
    roomy = subprocess.run([sys.executable, "-c", probe, "4096"], capture_output=True, text=True, timeout=60)
    assert roomy.returncode == 0, roomy.stderr
    assert roomy.stdout.strip() == "soft 2256 2256"  # 1,000 connections x 2 + 256 spare
    tight = subprocess.run([sys.executable, "-c", probe, "500"], capture_output=True, text=True, timeout=60)
    assert tight.returncode == 0, tight.stderr
    assert "soft 500 500" in tight.stdout
    assert "open-files limit 500" in tight.stdout and "max_connections=1000" in tight.stdout


# ---- item 5 ---------------------------------------------------------------------------------------


def test_item5_a_party_runs_at_most_its_cap_of_executors(dep: Deployment) -> None:
    """Item 5 (executor cap): party c allows 2 executors at once and queues 1 leg more; the third
    task creation is queued (202, no third executor), a fourth gets 503 with a clear reason. When
    a leg's rule has run its executor is released at once, and the queued leg starts in its slot
    and runs to a result."""
    ini = dep.initiator()
    specs = [LegSpec(data_id="m_c", party="c", rule="row_count")]
    created = [ini.create_task(f"cap{i}", specs)["m_c"] for i in range(4)]
    assert [c["ok"] for c in created] == [True, True, True, False]
    assert created[2]["status"] == 202 and "slots are busy" in created[2]["detail"]
    assert created[3]["status"] == 503 and "max_executors" in created[3]["detail"]
    assert "max_queued_legs" in created[3]["detail"]
    health = dep.health("c")
    assert health["executors"] == 2 and health["queued_legs"] == 1
    first = ini.receive("cap0", ["m_c"], 30)["m_c"]
    assert first["outcome"] == "result", first
    queued = ini.receive("cap2", ["m_c"], 30)["m_c"]  # waits for the report of the leg's executor
    ini.close()
    assert queued["outcome"] == "result", queued
    health = dep.health("c")
    assert health["queued_legs"] == 0 and health["executors"] == 1  # cap1's; cap0's and cap2's released


# ---- item 6 ---------------------------------------------------------------------------------------


def test_item6_certificates_carry_one_identity_and_role(dep: Deployment) -> None:
    """Item 6 (certificates per identity and role): each certificate names one identity and role;
    servers carry serverAuth+clientAuth and their hosts, initiators and the operator clientAuth only
    and no host; an initiator's certificate cannot serve TLS, and a party's cannot pass for the
    gateway (the client checks the name it expects)."""
    for name, serving in (("gateway", True), ("a", True), ("initiator", False), ("bob", False), ("operator", False)):
        cert = x509.load_pem_x509_certificate(Path(dep.cfg(name).cert).read_bytes())
        eku = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        role = dep.cfg(name).role
        assert san.get_values_for_type(x509.DNSName)[0] == f"{name}.{role}.trainmaster.invalid"
        assert (ExtendedKeyUsageOID.SERVER_AUTH in eku) == serving and ExtendedKeyUsageOID.CLIENT_AUTH in eku
        assert bool(san.get_values_for_type(x509.IPAddress)) == serving
        assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature

    def handshake(server_as: str, expect_name: str, expect_role: str) -> None:
        srv_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=dep.cfg(server_as).ca)
        srv_ctx.load_cert_chain(dep.cfg(server_as).cert, dep.cfg(server_as).key)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def accept() -> None:
            conn, _ = listener.accept()
            try:
                srv_ctx.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):
                conn.close()

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                client_ssl_context(dep.cfg("initiator")).wrap_socket(
                    raw, server_hostname=expect(expect_name, expect_role)["sni_hostname"]
                ).close()
        finally:
            t.join(timeout=10)
            listener.close()

    handshake("gateway", "gateway", "gateway")  # the real gateway certificate passes
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake("a", "gateway", "gateway")  # party a posing as the gateway
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake("bob", "bob", "initiator")  # a client-only certificate cannot serve


def test_item6_the_server_checks_the_clients_role_and_name(dep: Deployment) -> None:
    """Item 6, server side: the initiator's signed request over party a's TLS connection, and a
    party's report over the operator's connection, are refused (403) before any handler runs."""
    ini = dep.initiator()
    env = _sealed(
        dep,
        "initiator",
        "gateway",
        "task_register",
        "role1",
        "*",
        {"task_id": "role1", "legs": [{"data_id": "m_a", "party": "a", "call": {"rule": "row_count", "params": {}}}]},
    )
    resp = _post(dep, "gateway", "/v1/tasks", env.model_dump_json(), as_="a")
    assert resp.status_code == 403 and "TLS connection of 'a' (role party)" in resp.json()["detail"]
    rep = _sealed(
        dep,
        "a",
        "gateway",
        "executor_report",
        "role1",
        "m_a",
        {"task_id": "role1", "data_id": "m_a", "address": "x", "call": {"rule": "row_count", "params": {}}},
    )
    resp = _post(dep, "gateway", "/v1/executors", rep.model_dump_json(), as_="operator")
    assert resp.status_code == 403 and "role operator" in resp.json()["detail"]
    assert ini.register_task("role1", [_row("a")]).created is True  # nothing was created by the refused request
    ini.close()


# ---- item 7 ---------------------------------------------------------------------------------------


def test_item7_the_whole_leg_outcome_is_signed_and_nan_timestamps_are_refused(dep: Deployment) -> None:
    """Item 7 (sign the whole outcome): a proxy that flips a bit in a leg's sealed outcome, or moves
    one leg's outcome under another data id, is caught at the initiator (no result); the outcome,
    detail and party exist only inside the signature. NaN/inf timestamps are refused as such (422
    naming the field), not as a replay."""
    ini = dep.initiator()
    ini.create_task("sig1", [_row("a"), _row("b")])
    ini.receive("sig1", ["m_a", "m_b"], leg_timeout_s=20)
    env = _sealed(
        dep, "initiator", "gateway", "data_receive", "sig1", "*", {"task_id": "sig1", "data_ids": ["m_a", "m_b"]}
    )
    raw = TaskResult.model_validate_json(_post(dep, "gateway", "/v1/receive", env.model_dump_json()).content)
    assert set(raw.legs[0].model_dump()) == {"data_id", "envelope"}  # nothing about the outcome in the clear
    a_env, b_env = raw.legs[0].envelope, raw.legs[1].envelope
    flipped = a_env.model_dump(mode="json")
    flipped["ciphertext"] = (
        flipped["ciphertext"][:10] + ("A" if flipped["ciphertext"][10] != "A" else "B") + flipped["ciphertext"][11:]
    )
    from trainmaster.gateway.crypto.envelope import EnvelopeError

    fresh = dep.initiator()  # its own seen table
    fresh.assigned["sig1"] = {"m_a": "a", "m_b": "b"}
    with pytest.raises(EnvelopeError, match="bad signature"):
        fresh._verify_leg("sig1", "m_a", Envelope.model_validate(flipped))
    with pytest.raises(EnvelopeError, match="another task leg"):
        fresh._verify_leg("sig1", "m_b", a_env)
    assert fresh._verify_leg("sig1", "m_b", b_env)["party"] == "b"
    fresh.close()
    ini.close()
    for field in ("issued_at", "expires_at"):
        body = env.model_dump_json().replace(f'"{field}":{getattr(env.header, field)}', f'"{field}":NaN')
        resp = _post(dep, "gateway", "/v1/receive", body)
        assert resp.status_code == 422 and field in resp.json()["detail"] and "finite" in resp.json()["detail"], (
            resp.text
        )
        body = env.model_dump_json().replace(f'"{field}":{getattr(env.header, field)}', f'"{field}":1e999')
        assert _post(dep, "gateway", "/v1/receive", body).status_code == 422


# ---- item 8 ---------------------------------------------------------------------------------------


def test_item8_bounded_legs_cleanup_on_failed_report_and_counters_only_for_the_operator(dep: Deployment) -> None:
    """Item 8: legs per party are bounded at task creation (429 past the cap); a party whose report
    the gateway refuses (task never created there) stops that executor at once (409, executor count
    unchanged), so a later, proper creation can route the leg; `/v1/health` shows counters only
    to the operator identity."""
    ini = dep.initiator()
    many = [LegSpec(data_id=f"x{i}", party="b", rule="row_count") for i in range(41)]
    with pytest.raises(Exception, match="cap of 40"):
        ini.register_task("many1", many)
    before = dep.health("a")["executors"]
    created = ini.create_leg("orphan1", _row("a"))  # never created at the gateway
    assert created["status"] == 409 and "no leg" in created["detail"]
    assert dep.health("a")["executors"] == before
    assert ini.run_task(TaskSpec(task_id="orphan1", legs=[_row("a")]))["legs"]["m_a"]["outcome"] == "result"
    ini.close()
    with _http(dep, "initiator") as http:
        public = http.get(f"{dep.url('gateway')}/v1/health").json()
    assert public == {"name": "gateway", "role": "gateway", "ok": True}
    assert {"legs", "handled", "rejected"} <= set(dep.health("gateway"))


# ---- item 9 ---------------------------------------------------------------------------------------


def test_item9_tasks_belong_to_their_initiator_and_several_work_at_once(dep: Deployment) -> None:
    """Item 9 (ownership): two initiators run tasks at the same time, each result sealed to its own
    key; one cannot read, fetch or cancel the other's task (403), and its results do not open with
    the other's key."""
    box: dict[str, Any] = {}

    def run(name: str) -> None:
        ini = dep.initiator(name=name)
        box[name] = ini.run_task(TaskSpec(task_id=f"own-{name}", legs=[_row("a"), _row("b")]))
        ini.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in ("initiator", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for name in ("initiator", "bob"):
        assert {k: v["outcome"] for k, v in box[name]["legs"].items()} == {"m_a": "result", "m_b": "result"}, box[name]
    bob, alice = dep.initiator(name="bob"), dep.initiator()
    from trainmaster.errors import UserError

    with pytest.raises(UserError, match="belongs to another initiator"):
        alice.receive("own-bob", ["m_a"], leg_timeout_s=5)
    with pytest.raises(UserError, match="belongs to another initiator"):
        alice.cancel("own-bob")
    env = _sealed(dep, "bob", "gateway", "data_receive", "own-bob", "*", {"task_id": "own-bob", "data_ids": ["m_a"]})
    raw = TaskResult.model_validate_json(_post(dep, "gateway", "/v1/receive", env.model_dump_json(), as_="bob").content)
    from trainmaster.gateway.crypto.envelope import EnvelopeError, decrypt

    with pytest.raises(EnvelopeError):
        decrypt(raw.legs[0].envelope, alice.me)
    assert decrypt(raw.legs[0].envelope, bob.me)["party"] == "a"
    bob.register_task("own-cancel", [_row("b")])
    assert bob.cancel("own-cancel") == ["m_b"]
    bob.close()
    alice.close()


# ---- item 10 --------------------------------------------------------------------------------------


def test_item10_fine_histograms_and_exhausted_budgets_are_refused(dep: Deployment) -> None:
    """Item 10 (disclosure limits): a histogram with 10,001 edges (one row per bin) is refused for
    bins under the minimum group size; on party d (budget 30 values per data set) two summaries of
    two columns (14 values each) pass and a third is refused: budget exhausted, with the numbers.
    Party d has the 30-value budget."""
    ini = dep.initiator()
    edges = [i * 0.01 for i in range(10_001)]
    out = ini.run_task(
        TaskSpec(
            task_id="fine1",
            legs=[
                LegSpec(data_id="m_a", party="a", rule="histogram", params={"column": "mean_radius", "edges": edges})
            ],
        )
    )
    leg = out["legs"]["m_a"]
    assert leg["outcome"] == "rejected" and "minimum group size" in leg["detail"] and "result" not in leg
    spec = LegSpec(data_id="m_d", party="d", rule="summary_stats", params={"columns": ["mean_radius", "label"]})
    results = [ini.run_task(TaskSpec(task_id=f"budget{i}", legs=[spec]))["legs"]["m_d"] for i in range(3)]
    ini.close()
    assert [r["outcome"] for r in results] == ["result", "result", "rejected"]
    assert "privacy budget of data set 'm_d' exhausted" in results[2]["detail"] and "28 of 30" in results[2]["detail"]


# ---- item 11 --------------------------------------------------------------------------------------


def test_item11_zero_key_and_deep_json_are_4xx_not_500(dep: Deployment) -> None:
    """Item 11 (the 500s): a correctly signed envelope with an all-zero ephemeral public key is a 400
    and a JSON document nested 100,000 deep a 422, at the gateway and at a party."""
    from trainmaster.gateway.crypto.envelope import _signed_bytes, canonical_header

    me = load_identity(dep.cfg("initiator"))
    for target in ("gateway", "a"):
        d = _sealed(
            dep,
            "initiator",
            target,
            "data_receive" if target == "gateway" else "task_create",
            "z1",
            "*" if target == "gateway" else "m_a",
            {"task_id": "z1", "data_ids": ["m_a"]}
            if target == "gateway"
            else {"task_id": "z1", "party": "a", "data_id": "m_a", "call": {"rule": "row_count", "params": {}}},
        )
        zero = bytes(32)
        from trainmaster.gateway.crypto.envelope import b64d

        sig = me.sign_key.sign(_signed_bytes(canonical_header(d.header), zero, b64d(d.nonce), b64d(d.ciphertext)))
        bad = d.model_copy(update={"eph_pub": b64e(zero), "signature": b64e(sig)})
        resp = _post(dep, target, "/v1/receive" if target == "gateway" else "/v1/tasks", bad.model_dump_json())
        assert resp.status_code == 400 and "low-order" in resp.json()["detail"], resp.text
        deep = "[" * 100_000 + "]" * 100_000
        resp = _post(dep, target, "/v1/receive" if target == "gateway" else "/v1/tasks", deep)
        assert resp.status_code == 422 and "recursion" in resp.json()["detail"], resp.text
