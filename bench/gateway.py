"""Benchmark: small tasks through the gateway vs straight to the party, in the same run.

For 1, 3 and 10 parties, each run starts a fresh loopback deployment (real processes, mutual TLS),
creates the run's tasks at the gateway and their legs at the parties (one executor per leg; not
timed; direct and gateway paths get their own tasks, since a party runs each leg once), then times
  * direct:  the caller seals a data transfer request to each party itself and opens the party's
             signed result (the same crypto the gateway does, minus the gateway hop), one task =
             all its legs in parallel;
  * gateway: the initiator sends one data receive request per task to the gateway, which fans out,
             verifies/decrypts, re-encrypts to the initiator, persists, answers; the initiator opens
             every leg.
All tasks of a run are in flight at once. Reports p50/p99 latency per task and throughput (tasks/s),
medians over the runs. Then the front door (1,000 concurrent task flows), 1,000 whole tasks with
sandboxed executors, and a 4 GiB payload each way (``bench/gateway_transfer.py``: a leg's input
initiator -> party, its result party -> initiator, against a direct TLS stream, with the RSS growth
and CPU of gateway, party and initiator). Writes bench/results/gateway.json, .md and .png (the plot
only where matplotlib, the bench extra, is installed).

    .venv/bin/python bench/gateway.py            # every row (the transfer row needs ~24 GiB of disk)
    .venv/bin/python bench/gateway.py --quick    # smaller, for a smoke check
    .venv/bin/python bench/gateway.py --parties none --front 0 --executors 0 --transfer-mb 4096  # only the transfer row

The storm of 10,000 tasks with kills is ``bench/gateway_storm.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from trainmaster.gateway.crypto.envelope import Identity, make_header, seal
from trainmaster.gateway.crypto.gate import EnvelopeGate
from trainmaster.gateway.localdeploy import Deployment
from trainmaster.gateway.models import (
    DataReceive,
    DataTransfer,
    Envelope,
    LegAssignment,
    LegOutcomePayload,
    MessageKind,
    RuleCall,
    TaskCreate,
    TaskRegister,
    TaskResult,
)
from trainmaster.gateway.crypto.provision import load_identity, load_roster
from trainmaster.gateway.crypto.replay import SeenTable
from trainmaster.gateway.net.tls import client_ssl_context, expect

RESULTS = Path(__file__).parent / "results"
CALL = RuleCall(rule="row_count")


async def _post(http: httpx.AsyncClient, url: str, env: Envelope, roster: dict[str, Any]) -> httpx.Response:
    to = roster[env.header.recipient]
    return await http.post(
        url,
        content=env.model_dump_json(),
        headers={"content-type": "application/json"},
        extensions=expect(to.name, to.role),
    )


class Caller:
    """Acts as initiator (gateway path) or, for the direct baseline, as the gateway identity itself."""

    def __init__(self, dep: Deployment, as_name: str, max_connections: int = 400, timeout_s: float = 120):
        cfg = dep.cfg(as_name)
        self.me: Identity = load_identity(cfg)
        self.roster = load_roster(cfg.roster)
        self.gate = EnvelopeGate(self.me, self.roster, SeenTable("sqlite://"), cfg.skew_s)
        self.http = httpx.AsyncClient(
            verify=client_ssl_context(cfg),
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def seal(self, to: str, kind: MessageKind, task_id: str, data_id: str, payload: Any) -> Envelope:
        return seal(
            self.me,
            self.roster[to],
            make_header(self.me.name, to, kind.value, task_id, data_id, 900),
            payload.model_dump(mode="json"),
        )


async def _create_tasks(ini: Caller, dep: Deployment, tasks: list[str], parties: list[str]) -> None:
    sem = asyncio.Semaphore(16)  # executor start-up is CPU-bound; do not stampede two cores

    async def register(task_id: str) -> None:
        req = TaskRegister(
            task_id=task_id, legs=[LegAssignment(data_id=f"m_{p}", party=p, call=CALL) for p in parties], deadline_s=900
        )
        resp = await _post(
            ini.http,
            f"{dep.url('gateway')}/v1/tasks",
            ini.seal("gateway", MessageKind.task_register, task_id, "*", req),
            ini.roster,
        )
        resp.raise_for_status()

    async def one(task_id: str, p: str) -> None:
        async with sem:
            req = TaskCreate(task_id=task_id, party=p, data_id=f"m_{p}", call=CALL, deadline_s=900)
            resp = await _post(
                ini.http,
                f"{dep.url(p)}/v1/tasks",
                ini.seal(p, MessageKind.task_create, task_id, f"m_{p}", req),
                ini.roster,
            )
            resp.raise_for_status()

    await asyncio.gather(*(register(t) for t in tasks))
    await asyncio.gather(*(one(t, p) for t in tasks for p in parties))


async def _direct(gw: Caller, dep: Deployment, task_id: str, parties: list[str]) -> float:
    t0 = time.perf_counter()

    async def leg(p: str) -> None:
        req = DataTransfer(task_id=task_id, data_id=f"m_{p}", call=CALL)
        resp = await _post(
            gw.http,
            f"{dep.url(p)}/v1/transfer",
            gw.seal(p, MessageKind.data_transfer, task_id, f"m_{p}", req),
            gw.roster,
        )
        resp.raise_for_status()
        from trainmaster.gateway.relay.core import TransferPayload

        _s, payload = gw.gate.open(
            Envelope.model_validate_json(resp.content),
            MessageKind.transfer_result,
            {"party"},
            TransferPayload,
            check_peer=False,
        )
        assert payload.ok and payload.attestation is not None

    await asyncio.gather(*(leg(p) for p in parties))
    return time.perf_counter() - t0


async def _through_gateway(ini: Caller, dep: Deployment, task_id: str, parties: list[str]) -> float:
    from trainmaster.gateway.crypto.envelope import verify_attestation

    t0 = time.perf_counter()
    req = DataReceive(task_id=task_id, data_ids=[f"m_{p}" for p in parties])
    resp = await _post(
        ini.http,
        f"{dep.url('gateway')}/v1/receive",
        ini.seal("gateway", MessageKind.data_receive, task_id, "*", req),
        ini.roster,
    )
    resp.raise_for_status()
    for leg in TaskResult.model_validate_json(resp.content).legs:
        _s, out = ini.gate.open(
            leg.envelope, MessageKind.task_result, {"gateway"}, LegOutcomePayload, check_peer=False, once=False
        )
        assert out.outcome.value == "result" and out.attestation is not None, out.detail
        verify_attestation(out.attestation, ini.roster[out.attestation.body.party], task_id, leg.data_id)
    return time.perf_counter() - t0


async def _one_run(dep: Deployment, n_tasks: int, n_seq: int, run: int) -> dict[str, list[float] | float]:
    parties = dep.parties
    ini, gw = Caller(dep, "initiator"), Caller(dep, "gateway")
    tasks = {path: [f"r{run}{path[0]}{i}" for i in range(n_tasks)] for path in ("direct", "gateway")}
    seq_tasks = {path: [f"r{run}{path[0]}s{i}" for i in range(n_seq)] for path in ("direct", "gateway")}
    await _create_tasks(ini, dep, [t for path in tasks for t in tasks[path] + seq_tasks[path]], parties)
    out: dict[str, list[float] | float] = {}
    for name, fn, caller in (("direct", _direct, gw), ("gateway", _through_gateway, ini)):
        t0 = time.perf_counter()
        lat = await asyncio.gather(*(fn(caller, dep, t, parties) for t in tasks[name]))
        out[name] = list(lat)
        out[f"{name}_wall"] = time.perf_counter() - t0
    # One task at a time on warm connections: latency without queueing behind the burst. Direct and
    # gateway alternate per task (and swap order every task) so both see the same background load.
    out["direct_seq"], out["gateway_seq"] = [], []
    for i in range(n_seq):
        paths = [("direct", _direct, gw), ("gateway", _through_gateway, ini)]
        for name, fn, caller in paths if i % 2 == 0 else paths[::-1]:
            out[f"{name}_seq"].append(await fn(caller, dep, seq_tasks[name][i], parties))
    await ini.http.aclose()
    await gw.http.aclose()
    return out


def bench_config(n_parties: int, n_tasks: int, n_seq: int, runs: int) -> dict[str, Any]:
    per_run = []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="tm-gw-bench-") as root:
            parties = [f"p{i}" for i in range(n_parties)]
            dep = Deployment(
                Path(root),
                parties,
                overrides={
                    "gateway": {
                        "party_concurrency": 64,
                        "max_inflight_tasks": 1024,
                        "task_queue_depth": 4,
                        "max_open_legs_per_party": 4096,
                        "max_connections": 4096,
                    },
                    **{
                        p: {
                            "executor_start_timeout_s": 120,
                            "max_executors": 4096,
                            "max_connections": 4096,
                            "privacy_budget": 10**9,
                        }
                        for p in parties
                    },
                },
            ).start_all()
            try:
                per_run.append(asyncio.run(_one_run(dep, n_tasks, n_seq, run)))
            finally:
                dep.stop_all()
    row: dict[str, Any] = {
        "parties": n_parties,
        "concurrent_tasks": n_tasks,
        "legs_per_run": n_tasks * n_parties,
        "runs": runs,
    }
    for path in ("direct", "gateway"):
        row[f"{path}_p50_ms"] = statistics.median(float(np.percentile(r[path], 50)) * 1e3 for r in per_run)
        row[f"{path}_p99_ms"] = statistics.median(float(np.percentile(r[path], 99)) * 1e3 for r in per_run)
        row[f"{path}_tasks_per_s"] = statistics.median(n_tasks / float(r[f"{path}_wall"]) for r in per_run)
        row[f"{path}_seq_p50_ms"] = statistics.median(float(np.percentile(r[f"{path}_seq"], 50)) * 1e3 for r in per_run)
    row["p50_ratio"] = row["gateway_p50_ms"] / row["direct_p50_ms"]
    row["seq_p50_ratio"] = row["gateway_seq_p50_ms"] / row["direct_seq_p50_ms"]
    return row


async def _executor_run(dep: Deployment, n_tasks: int, run: int, footprint: list[dict[str, float]]) -> dict[str, Any]:
    """``n_tasks`` whole tasks per path at once, each with its own sandboxed executor at the party
    (which runs at most ``max_executors``; the rest queue): direct = create the leg at the party, then
    the signed transfer straight to it (it waits for a queued leg's executor); gateway = the data
    receive request instead (the gateway waits for the leg's executor report). Both create the task
    at the gateway first: the party reports every executor there and stops one the gateway refuses. Each task timed from its creation to its checked result."""
    from trainmaster.gateway.relay.core import TransferPayload
    from trainmaster.gateway.crypto.envelope import verify_attestation

    # Queued tasks wait for their turn at the party's executor cap: minutes at the tail, by design.
    ini, gw = Caller(dep, "initiator", 1200, 900), Caller(dep, "gateway", 1200, 900)
    party = dep.parties[0]
    data_id = f"m_{party}"
    errors: list[str] = []

    async def create_leg(task_id: str) -> None:
        req = TaskCreate(task_id=task_id, party=party, data_id=data_id, call=CALL, deadline_s=900)
        resp = await _post(
            ini.http,
            f"{dep.url(party)}/v1/tasks",
            ini.seal(party, MessageKind.task_create, task_id, data_id, req),
            ini.roster,
        )
        if resp.status_code not in (201, 202):
            raise RuntimeError(f"task creation {resp.status_code}: {resp.text[:200]}")

    async def register(task_id: str) -> None:
        """The task at the gateway: on both paths, since the party reports every executor there."""
        reg = TaskRegister(
            task_id=task_id, legs=[LegAssignment(data_id=data_id, party=party, call=CALL)], deadline_s=900
        )
        env = ini.seal("gateway", MessageKind.task_register, task_id, "*", reg)
        resp = await _post(ini.http, f"{dep.url('gateway')}/v1/tasks", env, ini.roster)
        if resp.status_code not in (200, 201):
            raise RuntimeError(f"task register {resp.status_code}: {resp.text[:200]}")

    async def direct(task_id: str) -> float:
        t0 = time.perf_counter()
        await register(task_id)
        await create_leg(task_id)
        req = DataTransfer(task_id=task_id, data_id=data_id, call=CALL)
        resp = await _post(
            gw.http,
            f"{dep.url(party)}/v1/transfer",
            gw.seal(party, MessageKind.data_transfer, task_id, data_id, req),
            gw.roster,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"transfer {resp.status_code}: {resp.text[:200]}")
        _s, payload = gw.gate.open(
            Envelope.model_validate_json(resp.content),
            MessageKind.transfer_result,
            {"party"},
            TransferPayload,
            check_peer=False,
        )
        if not payload.ok or payload.attestation is None:
            raise RuntimeError(f"direct leg failed: {payload.error}")
        return time.perf_counter() - t0

    async def through_gateway(task_id: str) -> float:
        t0 = time.perf_counter()
        await register(task_id)
        await create_leg(task_id)
        req = DataReceive(task_id=task_id, data_ids=[data_id], leg_timeout_s=600)
        resp = await _post(
            ini.http,
            f"{dep.url('gateway')}/v1/receive",
            ini.seal("gateway", MessageKind.data_receive, task_id, "*", req),
            ini.roster,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"receive {resp.status_code}: {resp.text[:200]}")
        for leg in TaskResult.model_validate_json(resp.content).legs:
            _s, out = ini.gate.open(
                leg.envelope, MessageKind.task_result, {"gateway"}, LegOutcomePayload, check_peer=False, once=False
            )
            if out.outcome.value != "result" or out.attestation is None:
                raise RuntimeError(f"gateway leg {out.outcome.value}: {out.detail}")
            verify_attestation(out.attestation, ini.roster[out.attestation.body.party], task_id, leg.data_id)
        return time.perf_counter() - t0

    async def timed(fn: Any, task_id: str) -> float | None:
        try:
            return float(await fn(task_id))
        except Exception as exc:  # counted, and the first few kept to say why
            errors.append(f"{task_id}: {type(exc).__name__}: {exc}"[:300])
            return None

    stop = asyncio.Event()

    async def sample_footprint() -> None:
        """USS/PSS/RSS of the party's live executor processes, a few times during the run."""
        import psutil

        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=2.0)
            except TimeoutError:
                pass
            for proc in psutil.Process(dep.procs[party].pid).children(recursive=True):
                try:
                    if "trainmaster.gateway.executors.worker" in " ".join(proc.cmdline()) and "python" in proc.name():
                        mem = proc.memory_full_info()
                        footprint.append({"uss": mem.uss, "pss": mem.pss, "rss": mem.rss})
                except psutil.Error:
                    continue

    sampler = asyncio.create_task(sample_footprint())
    out: dict[str, Any] = {}
    for name, fn in (("direct", direct), ("gateway", through_gateway)):
        errors.clear()
        t0 = time.perf_counter()
        lat = await asyncio.gather(*(timed(fn, f"x{run}{name[0]}{i}") for i in range(n_tasks)))
        out[f"{name}_wall"] = time.perf_counter() - t0
        out[name] = [x for x in lat if x is not None]
        out[f"{name}_errors"] = len(errors)
        out[f"{name}_error_samples"] = errors[:3]
        print(
            f"executors run {run} {name}: {len(out[name])} ok, {len(errors)} errors, {out[f'{name}_wall']:.0f} s",
            flush=True,
        )
    stop.set()
    await sampler
    await ini.http.aclose()
    await gw.http.aclose()
    return out


def bench_executors(n_tasks: int, cap: int, runs: int) -> dict[str, Any]:
    """1,000 concurrent small tasks with real sandboxed executors, gateway vs direct, same cap."""
    per_run, footprint = [], []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="tm-gw-exec-") as root:
            dep = Deployment(
                Path(root),
                ["p0"],
                overrides={
                    "gateway": {
                        "party_concurrency": 64,
                        "max_inflight_tasks": 4096,
                        "max_open_legs_per_party": 4096,
                        "max_connections": 4096,
                    },
                    "p0": {
                        "executor_start_timeout_s": 300,
                        "max_executors": cap,
                        "max_queued_legs": 4096,
                        "max_connections": 4096,
                        "privacy_budget": 10**9,
                    },
                },
            ).start_all()
            try:
                per_run.append(asyncio.run(_executor_run(dep, n_tasks, run, footprint)))
            finally:
                dep.stop_all()
    row: dict[str, Any] = {"concurrent_tasks": n_tasks, "max_executors": cap, "runs": runs}
    for path in ("direct", "gateway"):
        ok = [r for r in per_run if r[path]]
        row[f"{path}_p50_ms"] = statistics.median(float(np.percentile(r[path], 50)) * 1e3 for r in ok) if ok else None
        row[f"{path}_p99_ms"] = statistics.median(float(np.percentile(r[path], 99)) * 1e3 for r in ok) if ok else None
        row[f"{path}_errors"] = sum(r[f"{path}_errors"] for r in per_run)
        row[f"{path}_error_samples"] = [e for r in per_run for e in r[f"{path}_error_samples"]][:3]
        row[f"{path}_tasks_per_s"] = statistics.median(n_tasks / r[f"{path}_wall"] for r in per_run)
    if row["direct_p50_ms"] and row["gateway_p50_ms"]:
        row["p50_ratio"] = row["gateway_p50_ms"] / row["direct_p50_ms"]
    for key in ("uss", "pss", "rss"):
        row[f"executor_{key}_mb"] = statistics.median(f[key] for f in footprint) / 1e6 if footprint else None
    row["executor_samples"] = len(footprint)
    return row


async def _front_run(dep: Deployment, n_tasks: int, run: int) -> dict[str, Any]:
    """All ``n_tasks`` initiator flows at once, each on its own connection: create a one-leg task at
    the gateway, then a data receive request for it. No party executor is started (that leg's party
    never reports), so each receive answers, after its 1 s leg timeout, a sealed provisional
    ``party_unavailable`` that the initiator opens and checks. What this loads is the gateway's
    front door at 1,000 concurrent tasks: TLS handshakes, connection cap, file descriptors, the
    envelope gate's seen table and the mapping table's SQLite writes; errors are counted, not raised.

    Like the real initiator (``client.Initiator._post_retrying``), a request whose connection broke
    is sent again, freshly sealed (both calls are idempotent): a keep-alive connection the gateway
    closed after its header timeout while this client was too busy to send, for one. Such retries
    are counted apart from errors, which are requests that failed for good or answered wrongly."""
    ini = Caller(dep, "initiator", max_connections=n_tasks + 16)
    errors: list[str] = []
    retries: list[str] = []

    async def post(path: str, kind: MessageKind, task_id: str, payload: Any) -> httpx.Response:
        for attempt in range(3):
            try:
                return await _post(
                    ini.http,
                    f"{dep.url('gateway')}{path}",
                    ini.seal("gateway", kind, task_id, "*", payload),
                    ini.roster,
                )
            except httpx.TransportError as exc:
                if attempt == 2:
                    raise
                retries.append(f"{path}: {type(exc).__name__}")
                await asyncio.sleep(0.25 * 2**attempt)
        raise AssertionError("unreachable")

    async def flow(i: int) -> float | None:
        task_id = f"f{run}x{i}"
        t0 = time.perf_counter()
        try:
            reg = TaskRegister(
                task_id=task_id, legs=[LegAssignment(data_id="m_p0", party="p0", call=CALL)], deadline_s=900
            )
            resp = await post("/v1/tasks", MessageKind.task_register, task_id, reg)
            if resp.status_code not in (200, 201):  # 200: a retried create the gateway had already done
                errors.append(f"create {resp.status_code}: {resp.text[:120]}")
                return None
            req = DataReceive(task_id=task_id, data_ids=["m_p0"], leg_timeout_s=1.0)
            resp = await post("/v1/receive", MessageKind.data_receive, task_id, req)
            if resp.status_code != 200:
                errors.append(f"receive {resp.status_code}: {resp.text[:120]}")
                return None
            (leg,) = TaskResult.model_validate_json(resp.content).legs
            _s, out = ini.gate.open(
                leg.envelope, MessageKind.task_result, {"gateway"}, LegOutcomePayload, check_peer=False, once=False
            )
            if out.outcome.value != "party_unavailable" or out.final:
                errors.append(f"unexpected outcome {out.outcome.value} final={out.final}")
                return None
        except (httpx.HTTPError, OSError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:160])
            return None
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    lat = await asyncio.gather(*(flow(i) for i in range(n_tasks)))
    wall = time.perf_counter() - t0
    await ini.http.aclose()
    ok = [x for x in lat if x is not None]
    return {
        "ok": len(ok),
        "errors": errors,
        "retries": retries,
        "wall_s": wall,
        "p50_s": float(np.percentile(ok, 50)) if ok else float("nan"),
        "p99_s": float(np.percentile(ok, 99)) if ok else float("nan"),
    }


def bench_front(n_tasks: int, runs: int) -> dict[str, Any]:
    """``n_tasks`` concurrent task flows against the gateway's front door (see :func:`_front_run`),
    medians over ``runs`` fresh deployments."""
    import psutil

    per_run = []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="tm-gw-front-") as root:
            dep = Deployment(
                Path(root),
                ["p0"],
                overrides={
                    "gateway": {"max_inflight_tasks": 4096, "max_open_legs_per_party": 8192, "max_connections": 4096}
                },
            ).start_all()
            try:
                gw = psutil.Process(dep.procs["gateway"].pid)
                out = asyncio.run(_front_run(dep, n_tasks, run))
                out["gateway_fds_after"] = gw.num_fds()
                per_run.append(out)
            finally:
                dep.stop_all()
    errors = [e for r in per_run for e in r["errors"]]
    retries = [e for r in per_run for e in r["retries"]]
    return {
        "concurrent_tasks": n_tasks,
        "runs": runs,
        "errors": len(errors),
        "first_errors": errors[:5],
        "retries": len(retries),
        "first_retries": retries[:5],
        "p50_ms": statistics.median(r["p50_s"] for r in per_run) * 1e3,
        "p99_ms": statistics.median(r["p99_s"] for r in per_run) * 1e3,
        "tasks_per_s": statistics.median(n_tasks / r["wall_s"] for r in per_run),
        "leg_timeout_ms": 1000.0,
    }


def _load(result: dict[str, Any], meta: dict[str, Any]) -> str:
    """The load average range a result was measured under (kept with it: rows carried over from
    earlier runs keep their own)."""
    low, high = result.get("load", [meta["load_min"], meta["load_max"]])
    return f"{low:.0f}-{high:.0f}"


def write_results(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    transfer: dict[str, Any] | None = None,
    front: dict[str, Any] | None = None,
    executors: dict[str, Any] | None = None,
) -> None:
    RESULTS.mkdir(exist_ok=True)
    rows = sorted(rows, key=lambda r: r["parties"])
    (RESULTS / "gateway.json").write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "transfer": transfer, "front_door": front, "executors": executors}, indent=2
        )
    )
    runs = sorted({r["runs"] for r in rows})
    lines = [
        f"Gateway vs direct-to-party, small tasks (`row_count`), medians of {'/'.join(map(str, runs))} runs per row; "
        "measured on a 2-core machine, so noisy "
        f"(1-minute load average sampled during the run of these rows, this benchmark's own processes included: "
        f"{meta['small_load'][0]:.0f}-{meta['small_load'][1]:.0f}). "
        "Command: `.venv/bin/python bench/gateway.py`",
        "",
        "Burst: all tasks in flight at once (latency includes queueing and cold TLS handshakes). "
        "One-at-a-time: sequential tasks on warm connections (30 / 20 / 8 per run), direct and gateway "
        "alternating task by task so both see the same background load; each path has its own tasks (a party "
        "runs each leg once).",
        "",
        "| parties | concurrent tasks | runs | burst p50 ms direct / gateway | ratio | burst p99 ms direct / gateway | tasks/s direct / gateway | one-at-a-time p50 ms direct / gateway | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['parties']} | {r['concurrent_tasks']} | {r['runs']} | {r['direct_p50_ms']:.0f} / {r['gateway_p50_ms']:.0f} | "
            f"{r['p50_ratio']:.2f}x | {r['direct_p99_ms']:.0f} / {r['gateway_p99_ms']:.0f} | "
            f"{r['direct_tasks_per_s']:.1f} / {r['gateway_tasks_per_s']:.1f} | "
            f"{r['direct_seq_p50_ms']:.1f} / {r['gateway_seq_p50_ms']:.1f} | {r['seq_p50_ratio']:.2f}x |"
        )
    burst_ok = [str(r["parties"]) for r in rows if r["p50_ratio"] <= 1.5]
    seq_ok = [str(r["parties"]) for r in rows if r["seq_p50_ratio"] <= 1.5]
    seq_not = [str(r["parties"]) for r in rows if r["seq_p50_ratio"] > 1.5]
    lines += [
        "",
        f"Goal p50 <= 1.5x direct: burst met for parties = {', '.join(burst_ok) or 'none'}; one-at-a-time met "
        f"for parties = {', '.join(seq_ok) or 'none'}"
        + (f", NOT met for parties = {', '.join(seq_not)}" if seq_not else "")
        + " (one benchmark run on a noisy machine; see docs/gateway.md).",
    ]
    if transfer:
        t = transfer
        lines += [
            "",
            f"Transfer each way: a {t['size_mb'] / 1024:.1f} GiB leg input (float32 parameters) sent initiator -> "
            "gateway -> party (`Initiator.send_input`), and the `scale_params` rule's result of the same size fetched "
            "party -> gateway -> initiator (`Initiator.fetch_result`), 1 MiB AES-GCM chunks re-encrypted at the "
            "gateway (the stream port: mutual TLS for the requests and statuses, the sealed chunk frames beside its "
            "records), each timed until the receiver holds the checked, "
            "fsynced file; against the same bytes over one direct mutual-TLS stream into a fsynced file, in the same "
            "run, dirty pages written back before every timed transfer; the download twice: with the stored result "
            "out of the party's page cache (`download`, as a sandboxed executor's memory cgroup leaves a model-sized "
            "result) and in it (`download, cached`), the same state for both paths; "
            f"median of {t['runs']} run(s); RSS growth = peak minus the RSS before the transfer, sampled every 10 ms "
            f"with psutil (initiator = the benchmark process); the input's SHA-256 ({t['prehash_s']:.1f} s) is "
            f"computed before the upload is timed; 1-minute load average during that run: {_load(t, meta)}. "
            f"Command: `{t.get('command', '')}`",
            "",
            "| way | gateway s / MB/s | direct TLS s / MB/s | ratio (goal >= 0.8) | RSS growth MB gateway / party / initiator (goal <= 64) | CPU ms per MB gateway / party / initiator |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for way in ("upload", "download", "download_cached"):
            if way not in t:
                continue
            w = t[way]
            lines.append(
                f"| {way.replace('_', ', ')} | {w['gateway_s']:.2f} / {w['gateway_mb_per_s']:.0f} | {w['direct_s']:.2f} / "
                f"{w['direct_mb_per_s']:.0f} | {w['ratio']:.2f}x | {w['gateway_rss_growth_mb']:.0f} / "
                f"{w['party_rss_growth_mb']:.0f} / {w['initiator_rss_growth_mb']:.0f} | "
                f"{w['gateway_cpu_ms_per_mb']:.2f} / {w['party_cpu_ms_per_mb']:.2f} / {w['initiator_cpu_ms_per_mb']:.2f} |"
            )
    if front:
        lines += [
            "",
            f"Front door: {front['concurrent_tasks']} concurrent task flows, each on its own mutual-TLS connection "
            "(create a one-leg task at the gateway, then a data receive request whose leg's party never reports, "
            f"so it answers a sealed provisional `party_unavailable` after its {front['leg_timeout_ms']:.0f} ms leg "
            "timeout); no party executors, so there is no direct path to compare with; "
            f"median of {front['runs']} run(s); 1-minute load average during that run: {_load(front, meta)}.",
            "",
            "| concurrent tasks | errors | requests retried (broken connection) | p50 ms | p99 ms | tasks/s |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {front['concurrent_tasks']} | {front['errors']} | {front.get('retries', 0)} | {front['p50_ms']:.0f} | "
            f"{front['p99_ms']:.0f} | {front['tasks_per_s']:.1f} |",
        ]
    if executors:
        e = executors
        fmt = lambda v, spec=".0f": "-" if v is None else format(v, spec)  # noqa: E731
        lines += [
            "",
            f"Whole tasks with real executors: {e['concurrent_tasks']} concurrent one-leg `row_count` tasks per path, "
            f"each with its own sandboxed executor at the party, which runs at most {e['max_executors']} at once "
            "(`max_executors`; the rest queue and start as executors are released, each as soon as its leg's rule "
            "ran); both paths create the task at the gateway (the party reports every executor there) and the leg at "
            "the party; then direct = the signed transfer straight to the party, gateway = the data receive request "
            "at the gateway; each task timed from its "
            f"creation to its checked result; median of {e['runs']} run(s); executor memory sampled with psutil "
            "(USS: pages only that process holds; PSS: shared pages split among their sharers); "
            f"1-minute load average during that run: {_load(e, meta)}.",
            "",
            "| concurrent tasks | cap | p50 ms direct / gateway | ratio (goal <= 1.5) | p99 ms direct / gateway | "
            "errors direct / gateway | tasks/s direct / gateway | executor USS / PSS / RSS MB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {e['concurrent_tasks']} | {e['max_executors']} | {fmt(e['direct_p50_ms'])} / {fmt(e['gateway_p50_ms'])} | "
            f"{fmt(e.get('p50_ratio'), '.2f')}x | {fmt(e['direct_p99_ms'])} / {fmt(e['gateway_p99_ms'])} | "
            f"{e['direct_errors']} / {e['gateway_errors']} | {e['direct_tasks_per_s']:.1f} / {e['gateway_tasks_per_s']:.1f} | "
            f"{fmt(e['executor_uss_mb'], '.1f')} / {fmt(e['executor_pss_mb'], '.1f')} / {fmt(e['executor_rss_mb'], '.1f')} |",
        ]
    (RESULTS / "gateway.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    _plot(rows, transfer)


def _plot(rows: list[dict[str, Any]], transfer: dict[str, Any] | None) -> None:
    """bench/results/gateway.png: the p50 ratios per party count, and the transfer throughput each
    way; without matplotlib (the bench extra) one line says so and the results stand without it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing (pip install 'trainmaster[bench]'): no plot, the tables above stand", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(rows))
    left.bar(x - 0.2, [r["p50_ratio"] for r in rows], 0.4, label="burst")
    left.bar(x + 0.2, [r["seq_p50_ratio"] for r in rows], 0.4, label="one at a time")
    left.axhline(1.5, color="red", linestyle="--", label="goal <= 1.5x")
    left.set_xticks(x, [f"{r['parties']} party(ies)\n{r['concurrent_tasks']} tasks" for r in rows])
    left.set_ylabel("p50 gateway / direct")
    left.set_title("small tasks")
    left.legend()
    if transfer:
        ways = tuple(w for w in ("upload", "download", "download_cached") if w in transfer)
        xs = np.arange(len(ways))
        right.bar(xs - 0.2, [transfer[w]["direct_mb_per_s"] for w in ways], 0.4, color="gray", label="direct TLS")
        right.bar(xs + 0.2, [transfer[w]["gateway_mb_per_s"] for w in ways], 0.4, color="tab:blue", label="via gateway")
        right.set_xticks(xs, [f"{w.replace('_', ', ')}\n{transfer[w]['ratio']:.2f}x" for w in ways])
        right.set_ylabel("MB/s")
        right.set_title(f"{transfer['size_mb'] / 1024:.1f} GiB each way (goal >= 0.8x)")
        right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "gateway.png", dpi=100)
    plt.close(fig)


def _sample_load(into: list[float]) -> None:
    while True:
        time.sleep(10)
        into.append(os.getloadavg()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tasks and runs (smoke check)")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument(
        "--parties",
        default="1,3,10",
        help="which party counts to run ('none': no small-task rows); "
        "other rows already in bench/results/gateway.json are kept (results are written after every row)",
    )
    ap.add_argument(
        "--transfer-mb", type=int, default=4096, help="size of the payload sent each way (0: skip that row; quick 256)"
    )
    ap.add_argument("--transfer-runs", type=int, default=1, help="runs of the transfer row")
    ap.add_argument(
        "--workdir",
        default=None,
        help="folder for the transfer row's files (needs about 6x its size free; default /tmp)",
    )
    ap.add_argument(
        "--front",
        type=int,
        default=1000,
        help="concurrent task flows against the gateway's front door (0: skip that row)",
    )
    ap.add_argument("--front-runs", type=int, default=None, help="runs of the front-door row (default 3, quick 1)")
    ap.add_argument(
        "--executors",
        type=int,
        default=None,
        help="concurrent whole tasks per path with real sandboxed executors, gateway vs direct "
        "(default 1000, quick 100; 0: skip)",
    )
    ap.add_argument("--executor-cap", type=int, default=16, help="the party's max_executors in that row")
    ap.add_argument("--executor-runs", type=int, default=1, help="runs of the executor row")
    a = ap.parse_args()
    runs = a.runs or 3
    # Concurrent tasks per path (direct and gateway each get their own, one executor per leg): bounded by
    # this machine's memory (an executor is a Python process of ~50 MB), not by the gateway.
    sizes = {1: (40 if a.quick else 100, 30), 3: (14 if a.quick else 30, 20), 10: (4 if a.quick else 8, 8)}
    # (1,000 concurrent tasks would need 2,000 executor processes here: not on this shared machine.)
    wanted = [] if a.parties == "none" else [int(x) for x in a.parties.split(",")]
    loads = [os.getloadavg()[0]]
    threading.Thread(target=_sample_load, args=(loads,), daemon=True).start()
    meta = {
        "quick": a.quick,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "note": "shared 2-core machine with other busy jobs: numbers are noisy",
        "rule": CALL.rule,
    }
    existing = RESULTS / "gateway.json"
    old = json.loads(existing.read_text()) if existing.exists() else {}
    rows = [r for r in (old.get("rows", []) if a.parties != "1,3,10" else []) if r["parties"] not in wanted]
    old_meta = old.get("meta", {})
    kept_load = old_meta.get("small_load", [old_meta.get("load_min", 0.0), old_meta.get("load_max", 0.0)])
    transfer = old.get("transfer")
    front = old.get("front_door")
    executors = old.get("executors")

    def save() -> None:
        meta.update(load_min=min(loads), load_max=max(loads))
        # Small-task rows carried over from an earlier run keep that run's load figures.
        meta["small_load"] = [min(loads), max(loads)] if wanted else kept_load
        write_results(rows, meta, transfer, front, executors)

    for n_parties in wanted:
        n_tasks, n_seq = sizes[n_parties]
        rows.append(bench_config(n_parties, n_tasks, n_seq, runs))
        print(json.dumps(rows[-1]), flush=True)
        save()
    if a.front:
        mark = len(loads)
        front = bench_front(a.front, a.front_runs or (1 if a.quick else 3))
        front["load"] = [min(loads[mark - 1 :]), max(loads[mark - 1 :])]
        print(json.dumps(front), flush=True)
        save()
    n_exec = a.executors if a.executors is not None else (100 if a.quick else 1000)
    if n_exec:
        mark = len(loads)
        executors = bench_executors(n_exec, a.executor_cap, a.executor_runs)
        executors["load"] = [min(loads[mark - 1 :]), max(loads[mark - 1 :])]
        print(json.dumps(executors), flush=True)
        save()
    size = 256 if a.quick and a.transfer_mb == 4096 else a.transfer_mb
    if size:
        from gateway_transfer import bench_transfer

        mark = len(loads)
        transfer = bench_transfer(size, a.transfer_runs, a.workdir)
        transfer["load"] = [min(loads[mark - 1 :]), max(loads[mark - 1 :])]
        transfer["command"] = " ".join(["python bench/gateway.py", *sys.argv[1:]])
        print(json.dumps(transfer), flush=True)
    save()


if __name__ == "__main__":
    main()
