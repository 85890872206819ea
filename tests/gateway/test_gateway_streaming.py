"""Streams in both directions through the gateway's stream port: a leg's input (initiator ->
parties) and a stored result (parties -> initiator), chunk by chunk, checked at every hop and end
to end, resumed after kills. Unit checks of the chunk AEAD, then real processes."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from gateway_harness import Deployment
from helpers import wait_until

from trainmaster.gateway.crypto.chunks import HEADER, ChunkOpener, ChunkSealer
from trainmaster.gateway.crypto.envelope import EnvelopeError
from trainmaster.gateway.executors.base import read_commits
from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.rules.registry import load_table, run_call

pytestmark = pytest.mark.timeout(300)
ROWS = 1_000_000  # ~19 MB of predictions as JSON
WEIGHTS = {"w": [0.7], "b": -0.2}
PREDICT = {"features": ["x"], "weights": WEIGHTS}
FAULTS = {"t": "truncate", "r": "reorder", "f": "flip", "m": "misattest", "s": "slow"}


def _sealed(data: bytes, chunk: int, stream_id: str = "s" * 32, key: bytes = b"k" * 32) -> list[bytes]:
    sealer = ChunkSealer(key, stream_id)
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    return [sealer.seal(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _framed(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def _open_all(bodies: list[bytes], total: int, stream_id: str = "s" * 32, first: int = 0, offset: int = 0) -> bytes:
    opener = ChunkOpener(b"k" * 32, stream_id, total, 1000, first, offset)
    out = b"".join(opener.open(b)[0] for b in bodies)
    opener.finish()
    return out


def test_chunk_stream_refuses_truncation_reordering_tampering_and_splicing() -> None:
    """Chunk AEAD (counter nonce; stream id, index and final flag as associated data; announced
    length): every reordering, drop, duplicate, truncation, extension, bit flip or splice is
    refused; a resumed stream opens from a later index; an abort frame carries its reason."""
    data = os.urandom(10_000)
    bodies = _sealed(data, 1000)
    assert _open_all(bodies, len(data)) == data
    assert _open_all(bodies[4:], len(data), first=4, offset=4000) == data[4000:]
    flipped = bodies[3][:-1] + bytes([bodies[3][-1] ^ 1])
    final_cleared = bytes([0]) + bodies[-1][1:]
    cases = {
        "reordered": [bodies[1], bodies[0], *bodies[2:]],
        "dropped": bodies[:4] + bodies[5:],
        "duplicated": bodies[:5] + bodies[4:],
        "truncated": bodies[:-1],
        "extended": [*bodies, bodies[-1]],
        "flipped": bodies[:3] + [flipped] + bodies[4:],
        "final flag cleared": [*bodies[:-1], final_cleared],
        "spliced": _sealed(data, 1000, stream_id="t" * 32),
        "other key": _sealed(data, 1000, key=b"j" * 32),
    }
    for name, bad in cases.items():
        with pytest.raises(EnvelopeError):
            _open_all(bad, len(data))
            pytest.fail(f"{name} stream was accepted")
    with pytest.raises(EnvelopeError, match="announced"):
        _open_all(bodies, len(data) + 1)


def test_abort_frame_is_sealed_like_a_chunk() -> None:
    """Chunk frames cross the stream port outside TLS records, so an abort frame (a reason for
    ending a stream early) is sealed too: its own hop's key at the next index carries the reason;
    one sealed under another key, or replayed at another index, is refused, not believed."""
    sealer = ChunkSealer(b"k" * 32, "s" * 32)
    first = sealer.seal(b"x" * 1000, False)
    abort = sealer.abort("disk full")[4:]

    def opener() -> ChunkOpener:
        o = ChunkOpener(b"k" * 32, "s" * 32, 5000, 1000)
        assert o.aborted(first) is None
        o.open(first)
        return o

    assert opener().aborted(abort) == "disk full"
    forged = ChunkSealer(b"j" * 32, "s" * 32, first_index=1).abort("the gateway is full")[4:]
    with pytest.raises(EnvelopeError, match="does not decrypt"):
        opener().aborted(forged)
    with pytest.raises(EnvelopeError, match="does not decrypt"):
        ChunkOpener(b"k" * 32, "s" * 32, 5000, 1000).aborted(abort)  # index 1's abort at index 0


def _write_parquet(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": np.random.default_rng(0).normal(size=rows)}), path)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """Party a holds ~19 MB worth of predictions; the fault parties hold ~3 MB (three chunks) each."""
    root = tmp_path_factory.mktemp("stream")
    party = {
        "allowed_rules": ["row_count", "predict", "scale_params"],
        "stream_chunk_bytes": 1 << 20,
        "stream_commit_bytes": 1 << 20,
    }
    overrides: dict[str, dict[str, Any]] = {"a": party, "b": party}
    overrides |= {p: {**party, "fault_stream": mode} for p, mode in FAULTS.items()}
    dep = Deployment(root, ["a", "b", *FAULTS], overrides=overrides)
    _write_parquet(root / "data" / "a" / "big.parquet", ROWS)
    for p in FAULTS:
        _write_parquet(root / "data" / p / "big.parquet", 150_000 if p != "s" else 400_000)
    dep.start_all()
    yield dep
    dep.stop_all()


def _expected(dep: Deployment, party: str) -> dict[str, Any]:
    table = load_table(dep.root / "data" / party / "big.parquet")
    return run_call(table, RuleCall(rule="predict", params=PREDICT), allowed=["predict"])


def _commits(dep: Deployment, party: str, task_id: str, data_id: str) -> int:
    """Completed runs of a leg's rule, as its executor committed them."""
    return len(read_commits(Path(dep.cfg(party).state_dir) / "legs" / task_id / data_id / "commit"))


def test_large_result_stays_at_its_party_and_streams_through_the_gateway_equal(big: Deployment) -> None:
    """Large payloads, parties -> initiator: a ~19 MB result of a Parquet-held data id stays at its
    party (the gateway records only the party's signed attestation) and crosses the gateway's
    stream port chunk by chunk, re-encrypted, arriving equal to computing it on the party's file;
    the gateway keeps no result bytes; a small leg of the same task stays inline; the rule ran once."""
    ini = big.initiator(timeout_s=240)
    out = ini.run_task(
        TaskSpec(
            task_id="big1",
            leg_timeout_s=240,
            legs=[
                LegSpec(data_id="big", party="a", rule="predict", params=PREDICT),
                LegSpec(data_id="m_b", party="b", rule="row_count"),
            ],
        )
    )
    ini.close()
    leg = out["legs"]["big"]
    assert leg["outcome"] == "result", leg
    assert "result" not in leg and leg["bytes"] > 16 << 20  # to a file, never held whole
    assert json.loads(Path(leg["result_file"]).read_text()) == _expected(big, "a")
    assert not list(Path(leg["result_file"]).parent.glob("*.part"))
    assert out["legs"]["m_b"]["result"]["rows"] == len(big.splits[1])
    gateway_files = [p for p in Path(big.cfg("gateway").state_dir).rglob("*") if p.is_file()]
    assert all(p.stat().st_size < 4 << 20 for p in gateway_files), "the gateway kept result bytes"
    assert _commits(big, "a", "big1", "big") == 1
    assert big.health("gateway")["in_flight_legs"] == 0


def test_input_streams_to_its_party_and_a_stream_rule_streams_back(big: Deployment, tmp_path: Path) -> None:
    """Large payloads, initiator -> parties: a leg's 6 MB input (float32 parameters) crosses the
    gateway chunk by chunk to its party, which checks it against the size and SHA-256 the initiator
    signed at creation; the stream rule reads it and streams its result back, equal to numpy's."""
    params = np.random.default_rng(1).normal(size=1_500_000).astype("<f4")
    source = tmp_path / "model.bin"
    source.write_bytes(params.tobytes())
    ini = big.initiator(timeout_s=240)
    out = ini.run_task(
        TaskSpec(
            task_id="in1",
            leg_timeout_s=240,
            legs=[LegSpec(data_id="big", party="a", rule="scale_params", params={"factor": 0.5}, input=source)],
        )
    )
    ini.close()
    leg = out["legs"]["big"]
    assert leg["outcome"] == "result", leg
    got = np.frombuffer(Path(leg["result_file"]).read_bytes(), dtype="<f4")
    assert np.array_equal(got, params * np.float32(0.5))
    kept = Path(big.cfg("a").state_dir) / "legs" / "in1" / "big" / "input"
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == hashlib.sha256(source.read_bytes()).hexdigest()
    assert _commits(big, "a", "in1", "big") == 1


def test_an_input_other_than_the_signed_one_is_refused(big: Deployment, tmp_path: Path) -> None:
    """End to end input integrity: a file that changed after the leg was created (other bytes, same
    size) is refused by the party against the initiator's signed digest; the rule never runs."""
    source = tmp_path / "model.bin"
    source.write_bytes(b"\x00" * 4096)
    ini = big.initiator(timeout_s=60)
    spec = LegSpec(data_id="big", party="a", rule="scale_params", params={"factor": 2.0}, input=source)
    assert ini.create_task("in2", [spec])["big"]["ok"]
    source.write_bytes(b"\x01" * 4096)
    with pytest.raises(Exception, match="SHA-256"):
        ini.send_input("in2", "big", source)
    ini.close()
    assert _commits(big, "a", "in2", "big") == 0


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as exc:  # recorded for the test to inspect
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_gateway_killed_mid_input_resumes_from_the_partys_last_commit(big: Deployment, tmp_path: Path) -> None:
    """Restarts, initiator -> party: the gateway killed -9 while a 64 MB input streams through it;
    the initiator resumes against the restarted gateway from the party's last group commit (not
    from zero), the party checks the whole input's digest, and the rule runs once."""
    params = np.random.default_rng(2).normal(size=16_000_000).astype("<f4")
    source = tmp_path / "model.bin"
    source.write_bytes(params.tobytes())
    ini = big.initiator(timeout_s=60)
    spec = LegSpec(data_id="big", party="a", rule="scale_params", params={"factor": 3.0}, input=source)
    assert ini.create_task("in3", [spec], deadline_s=600)["big"]["ok"]
    arriving = Path(big.cfg("a").state_dir) / "legs" / "in3" / "big" / "input"
    thread, box = _in_background(lambda: ini.send_input("in3", "big", source, deadline=time.time() + 240))
    wait_until(
        lambda: (arriving.exists() and arriving.stat().st_size > 8 << 20) or not thread.is_alive(),
        120,
        "8 MB of the input at the party",
    )
    assert thread.is_alive(), f"the input was sent before the gateway could be killed: {box}"
    big.kill("gateway")
    big.start("gateway")
    big.wait_ready("gateway")
    thread.join(timeout=240)
    assert "error" not in box, box.get("error")
    assert box["value"]["resumed_from"] >= 1 << 20, box["value"]
    got = ini.receive("in3", ["big"], leg_timeout_s=120)["big"]
    ini.close()
    assert got["outcome"] == "result", got
    assert np.array_equal(np.frombuffer(Path(got["result_file"]).read_bytes(), dtype="<f4"), params * np.float32(3.0))
    assert _commits(big, "a", "in3", "big") == 1


@pytest.mark.parametrize("victim", ["gateway", "s"])
def test_killed_mid_fetch_the_initiator_resumes_where_it_broke_off(big: Deployment, victim: str) -> None:
    """Restarts, party -> initiator: the gateway, or the party holding the result, killed -9 while a
    result streams (the party sends slowly); the initiator resumes from what its `.part` file holds
    against the restarted service, ends with the whole, checked result, and the rule ran once."""
    task = f"fetch-{victim}"
    ini = big.initiator(timeout_s=60)
    thread, box = _in_background(
        lambda: ini.run_task(
            TaskSpec(
                task_id=task, leg_timeout_s=60, legs=[LegSpec(data_id="big", party="s", rule="predict", params=PREDICT)]
            )
        )
    )
    part = big.root / "results" / "initiator" / task / "big.json.part"
    wait_until(lambda: part.exists() and part.stat().st_size > 2 << 20, 120, "2 MB of the result at the initiator")
    big.kill(victim)
    time.sleep(0.5)
    big.start(victim)
    big.wait_ready(victim)
    thread.join(timeout=240)
    ini.close()
    assert "error" not in box, box.get("error")
    leg = box["value"]["legs"]["big"]
    assert leg["outcome"] == "result", leg
    assert json.loads(Path(leg["result_file"]).read_text()) == _expected(big, "s")
    assert _commits(big, "s", task, "big") == 1
    fetches = [
        e
        for e in _audit(big, "gateway")
        if e["event"] == "result.fetch" and e.get("task_id") == task and e["offset"] > 0
    ]
    assert fetches, "no fetch resumed past the start"


def _audit(dep: Deployment, who: str) -> list[dict[str, Any]]:
    lines = (Path(dep.cfg(who).state_dir) / "audit.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_tampered_stored_result_is_refused_at_the_initiator(big: Deployment) -> None:
    """End-to-end digest check: a stored result whose bytes changed at the party after it was
    attested is refused at the initiator with a clear reason, final, and no result file is left."""
    ini = big.initiator(timeout_s=240)
    assert ini.create_task("tam2", [LegSpec(data_id="big", party="a", rule="predict", params=PREDICT)])["big"]["ok"]
    first = ini.receive("tam2", ["big"], leg_timeout_s=240)["big"]
    assert first["outcome"] == "result"
    stored = Path(big.cfg("a").state_dir) / "legs" / "tam2" / "big" / "result"
    raw = bytearray(stored.read_bytes())
    raw[5 << 20] ^= 0x10
    stored.write_bytes(bytes(raw))
    Path(first["result_file"]).unlink()
    ini2 = big.initiator(timeout_s=240)  # a fresh run (its own seen table), as after a crash
    out = ini2.receive("tam2", ["big"], leg_timeout_s=240, parties={"big": "a"})["big"]
    ini.close()
    ini2.close()
    assert out["outcome"] == "rejected" and "result" not in out and "result_file" not in out
    assert "digest its party signed" in out["detail"], out
    assert not [p for p in (big.root / "results").rglob("tam2/*")]


@pytest.mark.parametrize("party", ["t", "r", "f"])
def test_party_stream_truncated_reordered_or_tampered_is_refused_at_the_gateway(big: Deployment, party: str) -> None:
    """Party -> gateway stream integrity: a party whose stream is cut short, reordered or flipped is
    refused by the gateway's chunk checks, which end the initiator's stream with the reason (a
    stream that just stops is resumed, as after a crash, until the initiator gives up); no result
    file is left and the task's other leg is unaffected."""
    ini = big.initiator(timeout_s=60, stream_retry_s=5.0)
    task = f"bad-{party}"
    out = ini.run_task(
        TaskSpec(
            task_id=task,
            leg_timeout_s=60,
            legs=[
                LegSpec(data_id="big", party=party, rule="predict", params=PREDICT),
                LegSpec(data_id="m_b", party="b", rule="row_count"),
            ],
        )
    )
    ini.close()
    leg = out["legs"]["big"]
    assert leg["outcome"] == "rejected" and "result" not in leg and "result_file" not in leg, leg
    assert "stream" in leg["detail"], leg
    assert out["legs"]["m_b"]["outcome"] == "result"
    assert not list((big.root / "results" / "initiator" / task).glob("big*"))
    assert big.health("gateway")["in_flight_legs"] == 0


def test_party_attesting_a_wrong_digest_is_refused_at_the_initiator(big: Deployment) -> None:
    """End-to-end digest check (the gateway checks chunks, order, final flag and length, not the
    SHA-256): a party that signs a digest of other bytes than it stores gets its leg refused at the
    initiator with a clear reason, final, and no result file or `.part` is left."""
    ini = big.initiator(timeout_s=120)
    out = ini.run_task(
        TaskSpec(
            task_id="mis1", leg_timeout_s=120, legs=[LegSpec(data_id="big", party="m", rule="predict", params=PREDICT)]
        )
    )
    ini.close()
    leg = out["legs"]["big"]
    assert leg["outcome"] == "rejected" and "result_file" not in leg and "result" not in leg, leg
    assert "digest its party signed" in leg["detail"], leg
    assert not list((big.root / "results" / "initiator" / "mis1").glob("*"))


def test_chunk_frames_beside_tls_records_on_one_connection(tmp_path: Path) -> None:
    """The stream port's framing: request and status frames in TLS records, sealed chunk frames on
    the bare connection beside them. Chunk frames sent right behind a TLS record arrive in the same
    socket read and must be taken from what TLS left unread; a TLS status after the chunks must
    still decrypt; the chunk bytes never appear on the wire in the clear; bytes flipped in a chunk
    frame on the wire fail its tag."""
    import socket

    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.crypto.provision import init_deployment
    from trainmaster.gateway.crypto.tlsid import dns_name
    from trainmaster.gateway.net.streams import ChunkReader, StreamSocket
    from trainmaster.gateway.net.tls import client_ssl_context, server_ssl_context

    configs = init_deployment(tmp_path / "d", ["a"], port_base=20000)
    server_ctx = server_ssl_context(load_config(configs["gateway"]))
    client_ctx = client_ssl_context(load_config(configs["initiator"]))
    data = os.urandom(5000)

    def run(tamper: bool) -> tuple[bytes | str, dict[str, Any], bytes]:
        left, right = socket.socketpair()
        left.settimeout(30)
        right.settimeout(30)
        wire = bytearray()
        box: dict[str, Any] = {}

        def serve() -> None:
            conn = StreamSocket.handshake(right, server_ctx, server_side=True)
            conn.send_json({"status": 200, "stream": "s" * 32})
            sealer = ChunkSealer(b"k" * 32, "s" * 32)
            frames = b"".join(
                _framed(sealer.seal(data[i : i + 1000], i + 1000 >= len(data))) for i in range(0, len(data), 1000)
            )
            wire.extend(frames)
            if tamper:
                frames = frames[:-1] + bytes([frames[-1] ^ 1])
            conn.send_chunk(frames)
            box["status"] = conn.recv_json()
            conn.close()

        server = threading.Thread(target=serve)
        server.start()
        client = StreamSocket.handshake(
            left, client_ctx, server_side=False, server_hostname=dns_name("gateway", "gateway")
        )
        time.sleep(0.2)  # the status record and the chunk frames behind it arrive in one read
        assert client.recv_json()["status"] == 200
        reader = ChunkReader(client, ChunkOpener(b"k" * 32, "s" * 32, len(data), 1000))
        out, got = bytearray(1000), b""
        try:
            while True:
                view, last = reader.next_into(out)
                got += bytes(view)
                if last:
                    break
            reader.opener.finish()
            result: bytes | str = got
        except EnvelopeError as exc:
            result = exc.reason
        client.send_json({"status": 200, "bytes": len(got)})
        server.join(timeout=30)
        client.close()
        return result, box["status"], bytes(wire)

    got, status, wire = run(tamper=False)
    assert got == data and status == {"status": 200, "bytes": len(data)}
    assert data[:64] not in wire and data[-64:] not in wire
    refused, _status, _wire = run(tamper=True)
    assert isinstance(refused, str) and "does not decrypt" in refused


def test_stream_connections_have_nagles_algorithm_off_on_both_ends(tmp_path: Path) -> None:
    """The stream port's connections (gateway, parties, initiator) set ``TCP_NODELAY`` on both
    ends: each frame already leaves in one ``sendall``, and a small frame (a request, a status)
    sent while the last is unacknowledged would otherwise wait for the peer's delayed ACK (up to
    40 ms). Fails where either end keeps Nagle's algorithm on."""
    import socket

    from trainmaster.gateway.config import load_config
    from trainmaster.gateway.crypto.provision import init_deployment
    from trainmaster.gateway.crypto.tlsid import dns_name
    from trainmaster.gateway.net.streams import StreamServer, connect
    from trainmaster.gateway.net.tls import client_ssl_context, server_ssl_context

    configs = init_deployment(tmp_path / "d", ["a"], port_base=20000)
    server_side: list[int] = []

    def handler(conn: Any, _peer: Any) -> None:
        server_side.append(conn.raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        conn.send_json({"status": 200})

    server = StreamServer(
        server_ssl_context(load_config(configs["gateway"])),
        "127.0.0.1",
        0,
        handler,
        max_streams=2,
        timeout_s=10,
        handshake_timeout_s=10,
    ).start()
    try:
        client = connect(
            client_ssl_context(load_config(configs["initiator"])),
            f"127.0.0.1:{server.port}",
            dns_name("gateway", "gateway"),
            10,
            "the gateway",
        )
        assert client.recv_json()["status"] == 200
        assert client.raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        client.close()
    finally:
        server.close()
    assert server_side and all(server_side), server_side
