"""Large results as chunked streams: unit checks of the chunk AEAD and end to end over real processes."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from gateway_harness import Deployment

from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.crypto.envelope import EnvelopeError, b64e
from trainmaster.gateway.rules.registry import load_table, run_call
from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.crypto.chunks import ChunkOpener, ChunkSealer, FrameSplitter, StreamInfo, frame

pytestmark = pytest.mark.timeout(300)
ROWS = 1_000_000  # ~19 MB of predictions as JSON
WEIGHTS = {"w": [0.7], "b": -0.2}


def _sealed(data: bytes, chunk: int, stream_id: str = "s" * 32) -> tuple[StreamInfo, list[bytes]]:
    key = os.urandom(32)
    info = StreamInfo(key=b64e(key), total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), chunk_bytes=chunk)
    sealer = ChunkSealer(key, stream_id)
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    return info, [sealer.seal(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _open_all(info: StreamInfo, bodies: list[bytes], stream_id: str = "s" * 32) -> bytes:
    opener = ChunkOpener(info, stream_id, 1 << 30)
    out = b"".join(opener.open(b)[0] for b in bodies)
    opener.finish()
    return out


def test_chunk_stream_refuses_truncation_reordering_tampering_and_splicing() -> None:
    """Chunk AEAD (counter nonce, msg id + index + final flag as associated data, signed length and
    digest): every reordering, drop, duplicate, truncation, extension, bit flip or splice is refused."""
    data = os.urandom(10_000)
    info, bodies = _sealed(data, 1000)
    assert _open_all(info, bodies) == data
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
        "spliced": _sealed(data, 1000, stream_id="t" * 32)[1],
    }
    for name, bad in cases.items():
        with pytest.raises(EnvelopeError):
            _open_all(info, bad)
            pytest.fail(f"{name} stream was accepted")
    lying = info.model_copy(update={"total_bytes": len(data) + 1})
    with pytest.raises(EnvelopeError, match="signed"):
        _open_all(lying, bodies)
    with pytest.raises(EnvelopeError, match="over the"):
        ChunkOpener(info, "s" * 32, max_total_bytes=100)


def test_frame_splitter_handles_any_cut_and_refuses_partial_or_oversized_frames() -> None:
    """Stream framing: frames come out whole however the bytes are cut; a cut-off frame is refused."""
    wire = b"".join(frame(bytes([i]) * (i * 37)) for i in range(1, 40))
    for step in (1, 7, 4096, len(wire)):
        splitter = FrameSplitter()
        got = [b for i in range(0, len(wire), step) for b in splitter.feed(wire[i : i + step])]
        splitter.close()
        assert got == [bytes([i]) * (i * 37) for i in range(1, 40)]
    splitter = FrameSplitter()
    list(splitter.feed(wire[:-5]))
    with pytest.raises(EnvelopeError, match="truncated"):
        splitter.close()
    with pytest.raises(EnvelopeError, match="cap"):
        list(FrameSplitter(max_frame=10).feed(frame(b"x" * 11)))


def _big_deployment(root: Path, fault: str = "", rows: int = ROWS) -> Deployment:
    import pyarrow as pa
    import pyarrow.parquet as pq

    party = {"allowed_rules": ["row_count", "predict"], "stream_chunk_bytes": 1 << 20}
    if fault:
        party["fault_stream"] = fault
    dep = Deployment(root, ["a", "b"], overrides={"a": party})
    x = np.random.default_rng(0).normal(size=rows)
    pq.write_table(pa.table({"x": x}), root / "data" / "a" / "big.parquet")
    return dep.start_all()


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    d = _big_deployment(tmp_path_factory.mktemp("stream"))
    yield d
    d.stop_all()


def test_large_result_streams_through_the_gateway_equal(big: Deployment) -> None:
    """Large payloads stream in chunks (party -> gateway re-encrypts chunk by chunk -> initiator): a
    ~19 MB result of a Parquet-held data id arrives equal to computing it on the party's file; the
    gateway spools only ciphertext; a small leg of the same task stays inline."""
    expected = run_call(
        load_table(big.root / "data" / "a" / "big.parquet"),
        RuleCall(rule="predict", params={"features": ["x"], "weights": WEIGHTS}),
        allowed=["predict"],
    )
    ini = big.initiator(timeout_s=240)
    out = ini.run_task(
        TaskSpec(
            task_id="big1",
            leg_timeout_s=240,
            legs=[
                LegSpec(data_id="big", party="a", rule="predict", params={"features": ["x"], "weights": WEIGHTS}),
                LegSpec(data_id="m_b", party="b", rule="row_count"),
            ],
        )
    )
    ini.close()
    assert out["legs"]["big"]["outcome"] == "result", out["legs"]["big"]
    assert "result" not in out["legs"]["big"]  # streamed to a file, never held whole
    assert json.loads(Path(out["legs"]["big"]["result_file"]).read_text()) == expected
    assert not list(Path(out["legs"]["big"]["result_file"]).parent.glob("*.part"))
    assert out["legs"]["m_b"]["result"]["rows"] == len(big.splits[1])
    spool = Path(big.cfg("gateway").state_dir) / "results" / "big1" / "big.stream"
    assert spool.stat().st_size > 16 * 1024 * 1024
    with spool.open("rb") as fh:
        head = fh.read(4 << 20)
    assert b'"predictions"' not in head and repr(expected["predictions"][0]).encode() not in head
    assert big.health("gateway")["in_flight_legs"] == 0


def test_gateway_killed_mid_stream_restarts_cleanly(big: Deployment) -> None:
    """Faults, gateway killed mid-stream: kill -9 while it spools a party's stream; after the
    restart no `.part` file is left at the gateway or the initiator, the retrying initiator gets
    the whole result (equal to the direct computation), and the party ran the rule once."""
    import threading

    expected = run_call(
        load_table(big.root / "data" / "a" / "big.parquet"),
        RuleCall(rule="predict", params={"features": ["x"], "weights": WEIGHTS}),
        allowed=["predict"],
    )
    spool = Path(big.cfg("gateway").state_dir) / "results" / "mid1"
    runs_before = big.health("a")["rule_runs"]
    ini = big.initiator(timeout_s=240)
    box: dict = {}
    spec = TaskSpec(
        task_id="mid1",
        leg_timeout_s=240,
        legs=[LegSpec(data_id="big", party="a", rule="predict", params={"features": ["x"], "weights": WEIGHTS})],
    )
    thread = threading.Thread(target=lambda: box.update(out=ini.run_task(spec)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not list(spool.glob("*.part")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(spool.glob("*.part")), "the gateway never started spooling"
    big.kill("gateway")
    big.start("gateway")
    big.wait_ready("gateway")
    thread.join(timeout=200)
    ini.close()
    leg = box["out"]["legs"]["big"]
    assert leg["outcome"] == "result", leg
    assert json.loads(Path(leg["result_file"]).read_text()) == expected
    assert not list(spool.glob("*.part")) and not list((big.root / "results").rglob("*.part"))
    assert big.health("a")["rule_runs"] == runs_before + 1


@pytest.mark.parametrize("damage", ["truncate", "reorder", "flip"])
def test_tampered_stored_stream_is_refused_at_the_initiator(big: Deployment, damage: str) -> None:
    """Gateway -> initiator stream integrity: the spooled chunks truncated, reordered or with a
    flipped bit are refused with a clear error, never returned as a result."""
    ini = big.initiator(timeout_s=240)
    task = f"tam{damage}"
    assert ini.create_task(
        task, [LegSpec(data_id="big", party="a", rule="predict", params={"features": ["x"], "weights": WEIGHTS})]
    )["big"]["ok"]
    ini.receive(task, ["big"], leg_timeout_s=240)  # the gateway now holds the stream
    spool = Path(big.cfg("gateway").state_dir) / "results" / task / "big.stream"
    raw = spool.read_bytes()
    splitter = FrameSplitter()
    frames = [frame(b) for b in splitter.feed(raw)]
    if damage == "truncate":
        frames = frames[:-1]
    elif damage == "reorder":
        frames[0], frames[1] = frames[1], frames[0]
    else:
        frames[2] = frames[2][:100] + bytes([frames[2][100] ^ 0x10]) + frames[2][101:]
    spool.write_bytes(b"".join(frames))
    ini2 = big.initiator(timeout_s=240)  # a fresh run (its own seen table), as after a crash
    out = ini2.receive(task, ["big"], leg_timeout_s=240, parties={"big": "a"})["big"]
    ini.close()
    ini2.close()
    assert out["outcome"] == "rejected" and "result" not in out and "result_file" not in out
    assert "stream" in out["detail"]
    assert not [p for p in (big.root / "results").rglob("*.part")]


@pytest.mark.parametrize("fault", ["truncate", "reorder", "flip"])
def test_party_stream_truncated_reordered_or_tampered_is_refused_by_the_gateway(tmp_path: Path, fault: str) -> None:
    """Party -> gateway stream integrity: a party whose stream is cut short, reordered or flipped gets
    the leg recorded as decrypt_failed/rejected with a clear reason; no spool file is left and the
    task's other leg is unaffected."""
    dep = _big_deployment(tmp_path, fault)
    try:
        ini = dep.initiator(timeout_s=240)
        out = ini.run_task(
            TaskSpec(
                task_id="bad1",
                leg_timeout_s=240,
                legs=[
                    LegSpec(data_id="big", party="a", rule="predict", params={"features": ["x"], "weights": WEIGHTS}),
                    LegSpec(data_id="m_b", party="b", rule="row_count"),
                ],
            )
        )
        ini.close()
        leg = out["legs"]["big"]
        assert leg["outcome"] in ("decrypt_failed", "rejected") and "result" not in leg
        assert "stream" in leg["detail"], leg
        assert out["legs"]["m_b"]["outcome"] == "result"
        assert not [p for p in (Path(dep.cfg("gateway").state_dir) / "results").rglob("*") if p.is_file()]
        assert dep.health("gateway")["in_flight_legs"] == 0
    finally:
        dep.stop_all()


def test_party_attesting_a_wrong_digest_is_refused_at_the_initiator(tmp_path: Path) -> None:
    """End-to-end digest check (the gateway's relay checks chunks, order, final flag and signed length,
    not the SHA-256): a party that signs a digest of other bytes than it streams gets its leg
    refused at the initiator with a clear reason, final, and no result file or `.part` is left."""
    dep = _big_deployment(tmp_path, "misattest", rows=150_000)  # ~3 MB: three chunks
    try:
        ini = dep.initiator(timeout_s=120)
        out = ini.run_task(
            TaskSpec(
                task_id="mis1",
                leg_timeout_s=120,
                legs=[
                    LegSpec(data_id="big", party="a", rule="predict", params={"features": ["x"], "weights": WEIGHTS})
                ],
            )
        )
        ini.close()
        leg = out["legs"]["big"]
        assert leg["outcome"] == "rejected" and "result_file" not in leg and "result" not in leg, leg
        assert "digest its sender signed" in leg["detail"], leg
        assert not list((dep.root / "results").rglob("*.json*"))
        assert dep.health("gateway")["in_flight_legs"] == 0
    finally:
        dep.stop_all()


def test_stream_is_cut_through_initiator_receives_while_party_uploads(tmp_path: Path) -> None:
    """Cut-through relay: with a party that sends its chunks slowly, the initiator has already
    written result bytes while the gateway is still receiving the party's stream (its spool is
    still a `.part`), so the hops overlap instead of store-and-forward; the result is whole and
    equal, and the gateway has recorded the outcome by the time the initiator has it."""
    import threading

    dep = _big_deployment(tmp_path, "slow")
    try:
        expected = run_call(
            load_table(dep.root / "data" / "a" / "big.parquet"),
            RuleCall(rule="predict", params={"features": ["x"], "weights": WEIGHTS}),
            allowed=["predict"],
        )
        ini = dep.initiator(timeout_s=240)
        box: dict = {}
        spec = TaskSpec(
            task_id="cut1",
            leg_timeout_s=240,
            legs=[LegSpec(data_id="big", party="a", rule="predict", params={"features": ["x"], "weights": WEIGHTS})],
        )
        thread = threading.Thread(target=lambda: box.update(out=ini.run_task(spec)), daemon=True)
        thread.start()
        spool = Path(dep.cfg("gateway").state_dir) / "results" / "cut1" / "big.stream.part"
        mine = dep.root / "results" / "initiator" / "cut1" / "big.json.part"
        overlap = False
        deadline = time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < deadline:
            if mine.exists() and mine.stat().st_size > 0 and spool.exists():
                overlap = True
                break
            time.sleep(0.01)
        thread.join(timeout=200)
        ini.close()
        leg = box["out"]["legs"]["big"]
        assert leg["outcome"] == "result", leg
        assert overlap, "the initiator got no byte before the party's stream had fully reached the gateway"
        assert json.loads(Path(leg["result_file"]).read_text()) == expected
        assert (Path(dep.cfg("gateway").state_dir) / "results" / "cut1" / "big.stream").is_file()
        assert not spool.exists() and dep.health("gateway")["in_flight_legs"] == 0
    finally:
        dep.stop_all()
