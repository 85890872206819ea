"""A party's state and its leg logic: executors (capped, queued past the cap), reports to the
gateway, each leg's one rule run and its record, and the sealed answers to transfers.

A leg created while the gateway cannot be reached keeps reporting in the background until the
task's deadline, and an executor the gateway refuses is stopped at once (item 8). A leg's rule
runs once inside that task's executor (a repeated transfer, after a gateway crash, is answered
from the leg's record, and the executor is stopped as soon as the rule has run), under the data
set's disclosure limits; the result goes back sealed to the gateway with the party's signed
attestation (item 1). Only results of registered rules ever leave; the agent never reads the data.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.chunks import MEDIA_TYPE, ChunkSealer, StreamInfo, frame
from trainmaster.gateway.crypto.envelope import PublicIdentity, attest, b64e
from trainmaster.gateway.executors.base import Executor, ExecutorStartError
from trainmaster.gateway.executors.process import ExecutorHandle
from trainmaster.gateway.models import DataTransfer, Envelope, ExecutorReport, LegAttestation, MessageKind, TaskCreate
from trainmaster.gateway.net.service import ServiceContext, read_envelope, request_peer
from trainmaster.gateway.net.tls import expect
from trainmaster.gateway.party.faults import corrupt
from trainmaster.gateway.rules.privacy import PrivacyLedger, PrivacyRefusal, check_group_sizes, release_cost
from trainmaster.gateway.rules.registry import RuleError, validate_call

M = TypeVar("M", bound=BaseModel)
_BLOCK = 1 << 20


@dataclass(frozen=True)
class LegRecord:
    """A leg's one run at this party: what the rule returned (or why it was refused). A small
    result is kept in memory, a large one (streamed) in a file under the party's state folder."""

    ok: bool
    error: str
    size: int = 0
    sha256: str = ""
    path: Path | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class ReportAttempt:
    """How one executor report to the gateway went: ``ok``, ``refused`` (final) or ``unreachable``."""

    status: str
    why: str = ""


@dataclass
class LegExecutor:
    """A task leg's executor and the creation request that started it (the idempotency check).

    A leg created while the party runs ``max_executors`` executors waits in a queue (``handle`` is
    None until a slot frees); a leg whose rule has run gives its executor (and slot) back at once
    and answers repeated transfers from its record (``released``)."""

    task: TaskCreate
    deadline: float
    handle: Executor | None = None
    report: asyncio.Task[None] | None = None
    """The background job of the leg: its queued start and report, or a report being retried."""
    started: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    slot: bool = False
    released: bool = False

    @property
    def running(self) -> bool:
        """Holds a live executor (what the cap counts)."""
        return self.handle is not None and not self.released and self.handle.alive


class PartyAgent:
    """One party's state while it serves (made by :func:`trainmaster.gateway.party.app.build_party_app`)."""

    def __init__(self, cfg: ServiceConfig, data_dir: Path):
        self.cfg, self.data_dir = cfg, data_dir
        state = Path(cfg.state_dir).resolve()
        self.ctx = ServiceContext.load(cfg, f"sqlite:///{state / 'seen.db'}")
        self.ledger = PrivacyLedger(f"sqlite:///{state / 'privacy.db'}")
        self.legs_root = state / "legs"
        shutil.rmtree(self.legs_root, ignore_errors=True)  # records of a previous run: their executors are gone
        self.executors: dict[tuple[str, str], LegExecutor] = {}
        self.slots = asyncio.Semaphore(cfg.max_executors)
        """One per running executor: a leg past the cap waits for one (queued), not refused."""
        self.runs: dict[tuple[str, str], asyncio.Future[LegRecord]] = {}
        self.counters = {"rule_runs": 0, "report_retries": 0}
        self.gateway: PublicIdentity = next(p for p in self.ctx.roster.values() if p.role == "gateway")
        self.http: httpx.AsyncClient | None = None
        """Set while the app runs (its lifespan opens and closes it)."""

    async def open(self, request: Request, kind: MessageKind, roles: set[str], model: type[M]) -> tuple[Envelope, M]:
        """The request's envelope through the gate, and its payload."""
        env = await read_envelope(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
        _sender, payload = self.ctx.gate.open(env, kind, roles, model, peer=request_peer(request))
        self.ctx.count(kind)
        return env, payload

    async def start_executor(self, data_file: Path, deadline_s: float, label: str) -> Executor:
        """The configured executor kind; both sit behind the same interface."""
        cfg = self.cfg
        if cfg.executor == "ray":
            from trainmaster.gateway.executors.rayactor import RayExecutor

            return await RayExecutor.start(
                data_file,
                deadline_s,
                cfg.executor_start_timeout_s,
                cfg.allowed_rules,
                cfg.ray_address,
                isolation=cfg.isolation,
                memory_mb=cfg.executor_memory_mb,
                label=label,
            )
        return await ExecutorHandle.start(
            data_file,
            deadline_s,
            cfg.executor_start_timeout_s,
            cfg.executor_memory_mb,
            cfg.allowed_rules,
            cfg.fault_executor_silent,
            cfg.isolation,
            label,
        )

    def release(self, leg: LegExecutor) -> None:
        """Stop the leg's executor and give its slot to the next queued leg (its record stays)."""
        leg.released = True
        if leg.handle is not None:
            leg.handle.kill()
        if leg.slot:
            leg.slot = False
            self.slots.release()

    def forget(self, key: tuple[str, str]) -> None:
        """Stop a leg's executor and drop its record (refused by the gateway, or past its deadline)."""
        leg = self.executors.pop(key, None)
        self.runs.pop(key, None)
        if leg is not None:
            self.release(leg)
            if leg.report is not None and leg.report is not asyncio.current_task():
                leg.report.cancel()
        shutil.rmtree(self.legs_root / key[0] / key[1], ignore_errors=True)

    def expire(self, key: tuple[str, str], leg: LegExecutor) -> None:
        """At the task's deadline: the leg can no longer run or be fetched; forget it and its record."""
        if self.executors.get(key) is leg:
            self.forget(key)

    async def start_queued(self, key: tuple[str, str], leg: LegExecutor, data_file: Path) -> None:
        """A queued leg: wait for a slot (until the deadline), start its executor, report it."""
        task = leg.task
        try:
            await asyncio.wait_for(self.slots.acquire(), timeout=max(0.0, leg.deadline - time.time()))
        except TimeoutError:
            self.forget(key)
            return
        leg.slot = True
        try:
            leg.handle = await self.start_executor(
                data_file, max(1.0, leg.deadline - time.time()), f"{task.task_id}.{task.data_id}"
            )
        except (TimeoutError, ExecutorStartError) as exc:
            leg.started.set_exception(exc)
            leg.started.exception()  # retrieved here; a waiting transfer sees it too
            await self.report_once(task, "", ready=False, reason=str(exc))
            self.forget(key)
            return
        leg.started.set_result(None)
        attempt = await self.report_once(task, leg.handle.address, ready=True)
        if attempt.status == "refused":
            self.forget(key)
        elif attempt.status == "unreachable":
            await self.report_until_deadline(key, task, leg.handle.address, leg.deadline)

    async def report_once(self, task: TaskCreate, address: str, ready: bool, reason: str = "") -> ReportAttempt:
        """One executor report to the gateway."""
        assert self.http is not None, "the party app is not running"
        report = ExecutorReport(
            task_id=task.task_id, data_id=task.data_id, address=address, call=task.call, ready=ready, reason=reason
        )
        env = self.ctx.seal_to(
            self.gateway.name, MessageKind.executor_report, task.task_id, task.data_id, report.model_dump(mode="json")
        )
        try:
            resp = await self.http.post(
                f"{self.gateway.endpoint}/v1/executors",
                content=env.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=15.0,
                extensions=expect(self.gateway.name, "gateway"),
            )
        except httpx.HTTPError as exc:
            return ReportAttempt("unreachable", f"gateway unreachable: {type(exc).__name__}")
        if resp.status_code == 200:
            return ReportAttempt("ok")
        if resp.status_code in (429, 503) or resp.status_code >= 500:
            return ReportAttempt("unreachable", f"gateway busy ({resp.status_code})")
        return ReportAttempt("refused", f"gateway refused the executor report ({resp.status_code}): {resp.text[:300]}")

    async def report_until_deadline(
        self, key: tuple[str, str], task: TaskCreate, address: str, deadline: float
    ) -> None:
        """Retry the report with backoff while the gateway is unreachable, until the task's deadline
        (then the executor is stopped: its leg can no longer run)."""
        delay = 0.5
        while time.time() + delay < deadline:
            await asyncio.sleep(delay)
            self.counters["report_retries"] += 1
            attempt = await self.report_once(task, address, ready=True)
            if attempt.status == "ok":
                return
            if attempt.status == "refused":
                break
            delay = min(delay * 2, 10.0)
        self.forget(key)

    async def run_once(self, key: tuple[str, str], req: DataTransfer, leg: LegExecutor, timeout_s: float) -> LegRecord:
        """Run the leg's rule and keep its result: charged against the data set's budget first,
        checked against the minimum group size after; a refusal is recorded the same way."""
        cfg = self.cfg
        folder = self.legs_root / key[0] / key[1]
        try:
            params = validate_call(req.call, cfg.allowed_rules)
            self.ledger.charge(req.task_id, req.data_id, release_cost(req.call.rule, params, 1024), cfg.privacy_budget)
        except (RuleError, PrivacyRefusal) as exc:
            return LegRecord(False, str(exc))
        if cfg.fault_delay_s:
            await asyncio.sleep(cfg.fault_delay_s)
        self.counters["rule_runs"] += 1
        assert leg.handle is not None  # the transfer waited for a queued leg's executor
        reply = await leg.handle.call(req.call, timeout_s=timeout_s)
        path, data = None, None
        digest = hashlib.sha256()
        try:
            if not reply.ok:
                return LegRecord(False, reply.error)
            if reply.size <= cfg.stream_chunk_bytes:
                data = await reply.read_all()
                digest.update(data)
            else:
                folder.mkdir(parents=True, exist_ok=True)
                path, part = folder / "result.json", folder / "result.json.part"
                with part.open("wb") as fh:
                    async for piece, _last in reply.chunks(_BLOCK):
                        digest.update(piece)
                        fh.write(piece)
                os.replace(part, path)
        finally:
            reply.close()
        if digest.hexdigest() != reply.sha256:
            if path is not None:
                path.unlink(missing_ok=True)
            return LegRecord(False, "executor result does not match its own digest")
        if data is not None and req.call.rule in ("histogram", "summary_stats", "train", "score"):
            try:
                check_group_sizes(req.call.rule, json.loads(data), cfg.min_group_size)
            except PrivacyRefusal as exc:
                return LegRecord(False, str(exc))
        return LegRecord(True, "", reply.size, reply.sha256, path, data)

    def attestation(self, req: DataTransfer, record: LegRecord, sha256: str | None = None) -> dict[str, Any]:
        body = LegAttestation(
            task_id=req.task_id,
            data_id=req.data_id,
            party=self.cfg.name,
            sha256=sha256 or record.sha256,
            size=record.size,
        )
        return attest(self.ctx.me, body).model_dump(mode="json")

    def stream(self, req: DataTransfer, record: LegRecord) -> StreamingResponse:
        """A large result as a signed opening plus AES-GCM chunks, read from the leg's record."""
        assert record.path is not None
        cfg = self.cfg
        key = os.urandom(32)
        sha256 = record.sha256
        if cfg.fault_stream == "misattest":  # fault injection: sign a digest of other bytes than those streamed
            sha256 = hashlib.sha256(sha256.encode()).hexdigest()
        info = StreamInfo(key=b64e(key), total_bytes=record.size, sha256=sha256, chunk_bytes=cfg.stream_chunk_bytes)
        opening = self.ctx.seal_to(
            self.gateway.name,
            MessageKind.transfer_result,
            req.task_id,
            req.data_id,
            {
                "ok": True,
                "error": "",
                "stream": info.model_dump(),
                "attestation": self.attestation(req, record, sha256),
            },
        )
        sealer = ChunkSealer(key, opening.header.msg_id)
        path = record.path

        async def body() -> AsyncIterator[bytes]:
            yield frame(opening.model_dump_json().encode())
            with path.open("rb") as fh:
                left = record.size
                while True:
                    piece = await asyncio.to_thread(fh.read, min(cfg.stream_chunk_bytes, left)) if left else b""
                    left -= len(piece)
                    parts = sealer.seal_frame(piece, left == 0)
                    if cfg.fault_stream not in ("", "misattest"):  # fault injection works on whole frames
                        yield b"".join(parts)
                    else:  # two HTTP chunks: joining would copy every byte once more
                        yield parts[0]
                        yield parts[1]
                    if left == 0:
                        return

        frames = corrupt(body(), cfg.fault_stream) if cfg.fault_stream not in ("", "misattest") else body()
        return StreamingResponse(frames, media_type=MEDIA_TYPE)

    async def shutdown(self) -> None:
        """Stop every executor (the lifespan's end), and Ray's sandboxes before Ray itself."""
        for leg in self.executors.values():
            if leg.report is not None:
                leg.report.cancel()
        if self.http is not None:
            await self.http.aclose()
        for leg in self.executors.values():
            if leg.handle is not None:
                leg.handle.kill()
        if self.cfg.executor == "ray":
            import ray

            from trainmaster.gateway.executors.rayactor import STOP_TIMEOUT_S, RayExecutor

            handles = (leg.handle for leg in self.executors.values())
            stops = [h.stopping for h in handles if isinstance(h, RayExecutor)]
            if pending := [t for t in stops if t is not None]:  # sandboxes end before Ray does
                await asyncio.wait(pending, timeout=STOP_TIMEOUT_S + 1)
            ray.shutdown()


def agent_of(request: Request) -> PartyAgent:
    """The running party's :class:`PartyAgent` (route modules reach it through their request)."""
    agent: PartyAgent = request.app.state.agent
    return agent
