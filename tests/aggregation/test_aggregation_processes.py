"""Real processes: a worker killed mid-reduce, and the ``trainmaster aggregation demo`` CLI."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from trainmaster.aggregation.fabric import Fabric, query
from trainmaster.aggregation.worker import AggregationClient, AggregationError, WorkerConfig

from aggregation_tier import tier_factory  # noqa: E402,F401

pytestmark = pytest.mark.timeout(120)


def _worker(conn, switch, rank, world, transport, victim) -> None:
    # survivors retransmit so rarely that their contributions sit in the forwarding node's
    # slots until the abort frees them; the victim stalls after its first result, so the kill
    # always lands in the middle of its reduction whatever the machine's speed
    cfg = WorkerConfig(
        chunk=1024 if transport == "udp" else 16384,
        timeout=60.0,
        retransmit_timeout=30.0,
        min_retransmit_timeout=30.0,
        max_retransmit_timeout=30.0,
        gap_threshold=10**6,
    )
    client = AggregationClient(switch, 1, rank, world, cfg, transport=transport)
    if rank == victim:
        accept = client._accept

        def stall_after_first(*args, **kwargs):
            accept(*args, **kwargs)
            conn.send("mid-reduce")
            time.sleep(600)

        client._accept = stall_after_first
    try:
        client.join()
        conn.send("joined")
        client.allreduce(np.ones(4_000_000, dtype=np.float32))
        conn.send("finished")
    except AggregationError as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        client.close()


@pytest.mark.parametrize("transport", ["udp", "shm"])
def test_killed_worker_gives_clear_error_and_frees_slots(transport: str) -> None:
    """Worker death: a worker SIGKILLed mid-reduce -> the parameter node sees its process exit
    (it watches the pid the worker's HELLO named; silence would take dead_after = 60 s here),
    aborts the job with a message naming it, the forwarding node frees the job's slots, and
    every surviving worker raises WorkerLostError instead of hanging."""
    ctx = mp.get_context("fork")
    with Fabric(slots=64, dead_after=60.0, transport=transport) as fabric:
        pipes, procs = [], []
        for rank in range(3):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(child, fabric.attach_point(rank), rank, 3, transport, 2))
            p.start()
            pipes.append(parent)
            procs.append(p)
        for pipe in pipes:
            assert pipe.poll(30) and pipe.recv() == "joined"
        assert pipes[2].poll(30) and pipes[2].recv() == "mid-reduce"
        assert query(fabric.ps)["jobs_failed"] == 0
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].join(5)
        for pipe in pipes[:2]:
            assert pipe.poll(40), "a surviving worker hung"
            message = pipe.recv()
            assert message.startswith("WorkerLostError")
            assert "worker 2 (its process exited)" in message
        switch = query(fabric.switches[0])
        assert switch["slots_in_use"] == 0 and switch["released_by_abort"] > 0
        assert query(fabric.ps)["jobs_failed"] == 1
        for p in procs[:2]:
            p.join(5)


def test_silent_worker_is_declared_dead_after_dead_after(tier_factory) -> None:
    """Worker death where its process cannot be watched (another host): liveness falls back
    to silence. A fake worker that names no process joins, sends nothing more; the real
    worker waiting in allreduce gets WorkerLostError naming the silent one."""
    from trainmaster.aggregation.protocol import Header, Kind, encode
    from trainmaster.aggregation.transport import UdpTransport
    from trainmaster.aggregation.worker import WorkerLostError

    tier = tier_factory(dead_after=1.0)
    fake = UdpTransport("remote-worker")
    errors: list[str] = []

    def real() -> None:
        with AggregationClient(tier.attach(0), 5, 0, 2, WorkerConfig(timeout=60.0)) as c:
            try:
                c.allreduce(np.ones(10_000, dtype=np.float32))
            except WorkerLostError as exc:
                errors.append(str(exc))

    try:
        fake.send(encode(Header(Kind.HELLO, 5, bitmap=0b10, fan_in=2)), tier.attach(1))
        t = threading.Thread(target=real)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the waiting worker hung"
        assert errors and "worker 1 (silent" in errors[0]
    finally:
        fake.close()


def test_unreachable_fabric_is_a_clear_timeout() -> None:
    """Every wait has a timeout: with no forwarding node listening, join fails with a message
    naming the address instead of blocking forever."""
    client = AggregationClient(("127.0.0.1", 9), 1, 0, 2, WorkerConfig(timeout=1.0))
    with pytest.raises(AggregationError, match="no WELCOME"):
        client.join()
    client.close()


def test_demo_cli_with_every_fault_is_exact() -> None:
    """The CLI demo: drop, duplicate, reorder, delay, overflow, collisions (two jobs, tiny pool)
    and two levels; exits 0 with every result within its bound, every checkable integer sum
    exact, and a non-zero count for every injected fault."""
    cmd = [
        sys.executable,
        "-m",
        "trainmaster",
        "aggregation",
        "demo",
        "--workers",
        "3",
        "--jobs",
        "2",
        "--elements",
        "60000",
        "--drop",
        "0.02",
        "--duplicate",
        "0.02",
        "--reorder",
        "0.05",
        "--delay",
        "0.02",
        "--overflow",
        "--slots",
        "8",
        "--levels",
        "2",
        "--chunk",
        "2048",
        "--seed",
        "1",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    # the JSON report names each worker's error: keep it in the failure message (once, in the
    # full suite on a loaded machine, this exited 1 with an empty stderr)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-4000:]
    result = json.loads(proc.stdout)
    assert result["ok"] is True
    assert result["integer_sums"]["all_exact"] and result["integer_sums"]["checked"] > 0
    assert 0 < result["float_error"]["max_abs"] <= result["float_error"]["bound"]
    for name in ("packets", "retransmits", "overflow_fallbacks", "collisions", "duplicates_ignored"):
        assert result[name] > 0, name
    assert all(v > 0 for v in result["faults"].values()), result["faults"]
    assert result["slots_in_use_after"] == 0


def test_demo_cli_rejects_bad_options() -> None:
    """User mistakes are a one-line error and exit code 2, not a traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "aggregation",
            "demo",
            "--levels",
            "3",
            "--drop",
            "1.5",
            "--kill",
            "router",
            "--results",
            "int4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "levels must be 1 or 2" in proc.stderr and "Traceback" not in proc.stderr
    assert "kill target must be ps, switch, switch:I or worker:R" in proc.stderr
    assert "--results must be one of exact, int8" in proc.stderr


@pytest.mark.parametrize("lowrank", [False, True])
def test_ddp_comm_hook_matches_gloo_allreduce(lowrank: bool) -> None:
    """DDP communication hook, asynchronous: register_comm_hook sends gradient buckets through
    the fabric from a communication thread that completes a real torch future (the hook returns
    before the bucket is reduced, so communication overlaps backward); in a real 2-process DDP
    run the averaged gradients match gloo's all-reduce of the same local gradients. The low-rank
    hook (trainmaster.aggregation.lowrank) in the same real DDP run: its plain first steps match
    gloo, its compressed steps give every rank the same rank-1 gradient of the compressed layer."""
    import socket
    from pathlib import Path

    script = Path(__file__).with_name("aggregation_ddp_worker.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Fabric(slots=32) as fabric:
        procs = []
        for rank in range(2):
            host, sport = fabric.attach_point(rank)
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TM_AGGREGATION_SWITCH": f"{host}:{sport}",
                "TM_AGGREGATION_JOB": "3",
                "TM_TEST_LOWRANK": "1" if lowrank else "0",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
        assert "max_grad_error" in out
        fields = out.split("max_grad_error", 1)[1].split()
        completed = int(fields[fields.index("completed") + 1])
        # every bucket of the 3 steps (DDP's first bucket is 1 MiB, later ones 1 KB here) was
        # completed by the communication thread, not inside the hook
        assert completed >= 3 + 2, out
        if lowrank:  # 2 steps after the plain ones, every bucket of them through the low-rank path
            assert int(fields[fields.index("compressed_buckets") + 1]) >= 2, out
