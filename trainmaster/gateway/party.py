"""The party agent: holds data files that never leave it, runs rules in per-task executors.

``POST /v1/tasks`` (from the initiator): validate the data id and rule, start an isolated executor
for the task (at most ``max_executors`` at once: past that the leg queues, bounded by
``max_queued_legs``, and starts when a slot frees), report its address to the gateway; while the
gateway cannot be reached the report is retried in the background until the task's deadline, and
an executor the gateway refuses is stopped at once (item 8). ``POST /v1/transfer`` (from the
gateway): run the rule once per leg inside that task's executor (a repeated transfer, after a
gateway crash, is answered from the leg's record: the rule never runs twice, and the executor
is stopped as soon as the rule has run), under the data set's
disclosure limits, and return the result sealed to the gateway with the party's signed
attestation (item 1). Only results of registered rules ever leave; the agent never reads the data.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, TypeVar

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from trainmaster.errors import UserError
from trainmaster.gateway.crypto import EnvelopeError, attest, b64e
from trainmaster.gateway.executor import Executor, ExecutorDied, ExecutorHandle, ExecutorStartError
from trainmaster.gateway.models import DataTransfer, ExecutorReport, LegAttestation, MessageKind, TaskCreate
from trainmaster.gateway.privacy import PrivacyLedger, PrivacyRefusal, check_group_sizes, release_cost
from trainmaster.gateway.provision import ServiceConfig
from trainmaster.gateway.rules import RuleError, validate_call
from trainmaster.gateway.service import ServiceContext, expect, install_common, mtls_client, read_envelope, request_peer
from trainmaster.gateway.stream import MEDIA_TYPE, ChunkSealer, StreamInfo, frame

M = TypeVar("M", bound=BaseModel)
_BLOCK = 1 << 20


DATA_SUFFIXES = (".csv", ".parquet")


def resolve_data_file(data_dir: Path, data_id: str) -> Path:
    """The data id's file (``<data_id>.csv`` or ``.parquet``) inside ``data_dir``.

    Anything that would escape the directory is refused; two files for one data id are ambiguous
    and refused too, so a party never silently serves the wrong one.
    """
    root = data_dir.resolve()
    found = []
    for suffix in DATA_SUFFIXES:
        candidate = (root / f"{data_id}{suffix}").resolve()
        if candidate.parent == root and candidate.is_file():
            found.append(candidate)
    if not found:
        raise EnvelopeError(404, f"data id {data_id!r} is not held by this party")
    if len(found) > 1:
        raise EnvelopeError(
            409,
            f"data id {data_id!r} has both a CSV and a Parquet file at this party; "
            "the party operator must keep only one",
        )
    return found[0]


async def _corrupt(frames: AsyncIterator[bytes], mode: str) -> AsyncIterator[bytes]:
    """Fault injection only (``fault_stream``): drop the last chunk, swap the first two, flip a bit,
    or send slowly (a pause before every chunk: a party on a slow link)."""
    held: list[bytes] = []
    index = -1
    async for f in frames:
        index += 1
        if mode == "slow" and index:
            await asyncio.sleep(0.1)
        if mode == "reorder" and index == 1:
            held.append(f)
            continue
        if mode == "flip" and index == 1:
            f = f[:-1] + bytes([f[-1] ^ 1])
        if mode == "truncate":
            if held:
                yield held.pop()
            held.append(f)
            continue
        yield f
        if mode == "reorder" and held and index == 2:
            yield held.pop()


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


def build_party_app(cfg: ServiceConfig, data_dir: Path) -> FastAPI:
    if cfg.executor == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise UserError(
                f"party {cfg.name!r} is configured with executor: ray, but Ray is not installed",
                details=["install the ray extra (pip install 'trainmaster[ray]') or set executor: subprocess"],
            )
    if cfg.isolation == "sandbox" and (cfg.executor == "subprocess" or not cfg.ray_address):
        # A local Ray's actors start their sandboxes on this host too (remote nodes are checked there).
        from trainmaster.gateway.sandbox import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise UserError(
                f"party {cfg.name!r}: executor isolation 'sandbox' is not available on this host: {reason}",
                details=[
                    "run the party as root on a host with bubblewrap and cgroup v1 memory/pids "
                    "(apt-get install -y bubblewrap, or make sandbox-deps)",
                    "or opt out: set isolation: process in the party's config (or pass "
                    "--isolation process) to run executors as plain processes, without "
                    "namespaces, seccomp or cgroup limits",
                ],
            )
    state = Path(cfg.state_dir).resolve()
    ctx = ServiceContext.load(cfg, f"sqlite:///{state / 'seen.db'}")
    ledger = PrivacyLedger(f"sqlite:///{state / 'privacy.db'}")
    legs_root = state / "legs"
    shutil.rmtree(legs_root, ignore_errors=True)  # records of a previous run: their executors are gone
    executors: dict[tuple[str, str], LegExecutor] = {}
    slots = asyncio.Semaphore(cfg.max_executors)
    """One per running executor: a leg past the cap waits for one (queued), not refused."""
    runs: dict[tuple[str, str], asyncio.Future[LegRecord]] = {}
    counters = {"rule_runs": 0, "report_retries": 0}
    gateway = next(p for p in ctx.roster.values() if p.role == "gateway")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.http = mtls_client(cfg)
        yield
        for leg in executors.values():
            if leg.report is not None:
                leg.report.cancel()
        await app.state.http.aclose()
        for leg in executors.values():
            if leg.handle is not None:
                leg.handle.kill()
        if cfg.executor == "ray":
            import ray

            from trainmaster.gateway.rayexec import STOP_TIMEOUT_S, RayExecutor

            stops = [h.stopping for h in (leg.handle for leg in executors.values()) if isinstance(h, RayExecutor)]
            if pending := [t for t in stops if t is not None]:  # sandboxes end before Ray does
                await asyncio.wait(pending, timeout=STOP_TIMEOUT_S + 1)
            ray.shutdown()

    app = FastAPI(title=f"trainmaster party {cfg.name}", lifespan=lifespan)
    app.state.ctx = ctx
    install_common(app, cfg.max_body_bytes)

    async def _open(request: Request, kind: MessageKind, roles: set[str], model: type[M]) -> tuple[Any, M]:
        env = await read_envelope(request, cfg.max_body_bytes, cfg.body_timeout_s)
        sender, payload = ctx.gate.open(env, kind, roles, model, peer=request_peer(request))
        ctx.count(kind)
        return env, payload

    async def _start_executor(data_file: Path, deadline_s: float, label: str) -> Executor:
        """The configured executor kind; both sit behind the same interface."""
        if cfg.executor == "ray":
            from trainmaster.gateway.rayexec import RayExecutor

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

    def _release(leg: LegExecutor) -> None:
        """Stop the leg's executor and give its slot to the next queued leg (its record stays)."""
        leg.released = True
        if leg.handle is not None:
            leg.handle.kill()
        if leg.slot:
            leg.slot = False
            slots.release()

    def _forget(key: tuple[str, str]) -> None:
        """Stop a leg's executor and drop its record (refused by the gateway, or past its deadline)."""
        leg = executors.pop(key, None)
        runs.pop(key, None)
        if leg is not None:
            _release(leg)
            if leg.report is not None and leg.report is not asyncio.current_task():
                leg.report.cancel()
        shutil.rmtree(legs_root / key[0] / key[1], ignore_errors=True)

    def _expire(key: tuple[str, str], leg: LegExecutor) -> None:
        """At the task's deadline: the leg can no longer run or be fetched; forget it and its record."""
        if executors.get(key) is leg:
            _forget(key)

    async def _start_queued(key: tuple[str, str], leg: LegExecutor, data_file: Path) -> None:
        """A queued leg: wait for a slot (until the deadline), start its executor, report it."""
        task = leg.task
        try:
            await asyncio.wait_for(slots.acquire(), timeout=max(0.0, leg.deadline - time.time()))
        except TimeoutError:
            _forget(key)
            return
        leg.slot = True
        try:
            leg.handle = await _start_executor(
                data_file, max(1.0, leg.deadline - time.time()), f"{task.task_id}.{task.data_id}"
            )
        except (TimeoutError, ExecutorStartError) as exc:
            leg.started.set_exception(exc)
            leg.started.exception()  # retrieved here; a waiting transfer sees it too
            await _report_once(task, "", ready=False, reason=str(exc))
            _forget(key)
            return
        leg.started.set_result(None)
        attempt = await _report_once(task, leg.handle.address, ready=True)
        if attempt.status == "refused":
            _forget(key)
        elif attempt.status == "unreachable":
            await _report_until_deadline(key, task, leg.handle.address, leg.deadline)

    async def _report_once(task: TaskCreate, address: str, ready: bool, reason: str = "") -> ReportAttempt:
        """One executor report to the gateway."""
        report = ExecutorReport(
            task_id=task.task_id, data_id=task.data_id, address=address, call=task.call, ready=ready, reason=reason
        )
        env = ctx.seal_to(
            gateway.name, MessageKind.executor_report, task.task_id, task.data_id, report.model_dump(mode="json")
        )
        try:
            resp = await app.state.http.post(
                f"{gateway.endpoint}/v1/executors",
                content=env.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=15.0,
                extensions=expect(gateway.name, "gateway"),
            )
        except httpx.HTTPError as exc:
            return ReportAttempt("unreachable", f"gateway unreachable: {type(exc).__name__}")
        if resp.status_code == 200:
            return ReportAttempt("ok")
        if resp.status_code in (429, 503) or resp.status_code >= 500:
            return ReportAttempt("unreachable", f"gateway busy ({resp.status_code})")
        return ReportAttempt("refused", f"gateway refused the executor report ({resp.status_code}): {resp.text[:300]}")

    async def _report_until_deadline(key: tuple[str, str], task: TaskCreate, address: str, deadline: float) -> None:
        """Retry the report with backoff while the gateway is unreachable, until the task's deadline
        (then the executor is stopped: its leg can no longer run)."""
        delay = 0.5
        while time.time() + delay < deadline:
            await asyncio.sleep(delay)
            counters["report_retries"] += 1
            attempt = await _report_once(task, address, ready=True)
            if attempt.status == "ok":
                return
            if attempt.status == "refused":
                break
            delay = min(delay * 2, 10.0)
        _forget(key)

    @app.post("/v1/tasks", status_code=201)
    async def create_task(request: Request) -> JSONResponse:
        _env, task = await _open(request, MessageKind.task_create, {"initiator"}, TaskCreate)
        if task.party != cfg.name:
            raise HTTPException(400, f"task creation request is for party {task.party!r}, not {cfg.name!r}")
        data_file = resolve_data_file(data_dir, task.data_id)
        try:
            validate_call(task.call, cfg.allowed_rules)
        except RuleError as exc:
            raise HTTPException(400, str(exc)) from exc
        key = (task.task_id, task.data_id)
        now = time.time()
        for k in [
            k
            for k, leg in executors.items()
            if now >= leg.deadline or (leg.handle is not None and not leg.released and not leg.handle.alive)
        ]:
            _forget(k)
        if key in executors:
            if executors[key].task != task:
                raise HTTPException(
                    409,
                    f"leg ({task.task_id}, {task.data_id}) was created with another request; "
                    "task ids are never reused: choose a new task id",
                )
            known = executors[key]
            state = "queued" if known.handle is None else "pending"
            pending = known.report is not None and not known.report.done()
            return JSONResponse(
                {"task_id": task.task_id, "data_id": task.data_id, "report": state if pending else "done"},
                status_code=202 if pending else 201,
            )
        deadline = time.time() + task.deadline_s
        if slots.locked():  # every slot taken: queue the leg (bounded), never fail it
            queued = sum(1 for leg in executors.values() if leg.handle is None)
            if queued >= cfg.max_queued_legs:
                raise HTTPException(
                    503,
                    f"party {cfg.name!r} already runs {cfg.max_executors} executors (its cap, max_executors) and "
                    f"queues {queued} legs (max_queued_legs); retry later",
                    headers={"Retry-After": "5"},
                )
            leg = executors[key] = LegExecutor(task, deadline)
            leg.report = asyncio.create_task(_start_queued(key, leg, data_file))
            asyncio.get_running_loop().call_later(task.deadline_s, _expire, key, leg)
            return JSONResponse(
                {
                    "task_id": task.task_id,
                    "data_id": task.data_id,
                    "report": "queued",
                    "detail": f"all {cfg.max_executors} executor slots are busy; the leg starts when one frees",
                },
                status_code=202,
            )
        await slots.acquire()  # free now: does not wait
        try:
            handle = await _start_executor(data_file, task.deadline_s, f"{task.task_id}.{task.data_id}")
        except TimeoutError as exc:
            slots.release()
            await _report_once(task, "", ready=False, reason=str(exc))
            raise HTTPException(504, f"executor for task {task.task_id!r} did not come up: {exc}") from exc
        except ExecutorStartError as exc:
            slots.release()
            await _report_once(task, "", ready=False, reason=str(exc))
            raise HTTPException(503, f"executor for task {task.task_id!r} could not start: {exc}") from exc
        except BaseException:
            slots.release()
            raise
        leg = executors[key] = LegExecutor(task, deadline, handle, slot=True)
        leg.started.set_result(None)
        asyncio.get_running_loop().call_later(task.deadline_s, _expire, key, leg)
        attempt = await _report_once(task, handle.address, ready=True)
        if attempt.status == "refused":
            _forget(key)
            raise HTTPException(409, attempt.why)
        if attempt.status == "unreachable":
            leg.report = asyncio.create_task(_report_until_deadline(key, task, handle.address, deadline))
            return JSONResponse(
                {
                    "task_id": task.task_id,
                    "data_id": task.data_id,
                    "report": "pending",
                    "detail": f"{attempt.why}; the party keeps reporting until the task's deadline",
                },
                status_code=202,
            )
        return JSONResponse({"task_id": task.task_id, "data_id": task.data_id, "report": "done"}, status_code=201)

    async def _run_once(key: tuple[str, str], req: DataTransfer, leg: LegExecutor, timeout_s: float) -> LegRecord:
        """Run the leg's rule and keep its result: charged against the data set's budget first,
        checked against the minimum group size after; a refusal is recorded the same way."""
        folder = legs_root / key[0] / key[1]
        try:
            params = validate_call(req.call, cfg.allowed_rules)
            ledger.charge(req.task_id, req.data_id, release_cost(req.call.rule, params, 1024), cfg.privacy_budget)
        except (RuleError, PrivacyRefusal) as exc:
            return LegRecord(False, str(exc))
        if cfg.fault_delay_s:
            await asyncio.sleep(cfg.fault_delay_s)
        counters["rule_runs"] += 1
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

    def _attestation(req: DataTransfer, record: LegRecord, sha256: str | None = None) -> dict[str, Any]:
        body = LegAttestation(
            task_id=req.task_id, data_id=req.data_id, party=cfg.name, sha256=sha256 or record.sha256, size=record.size
        )
        return attest(ctx.me, body).model_dump(mode="json")

    def _stream(req: DataTransfer, record: LegRecord) -> StreamingResponse:
        """A large result as a signed opening plus AES-GCM chunks, read from the leg's record."""
        assert record.path is not None
        key = os.urandom(32)
        sha256 = record.sha256
        if cfg.fault_stream == "misattest":  # fault injection: sign a digest of other bytes than those streamed
            sha256 = hashlib.sha256(sha256.encode()).hexdigest()
        info = StreamInfo(key=b64e(key), total_bytes=record.size, sha256=sha256, chunk_bytes=cfg.stream_chunk_bytes)
        opening = ctx.seal_to(
            gateway.name,
            MessageKind.transfer_result,
            req.task_id,
            req.data_id,
            {"ok": True, "error": "", "stream": info.model_dump(), "attestation": _attestation(req, record, sha256)},
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

        frames = _corrupt(body(), cfg.fault_stream) if cfg.fault_stream not in ("", "misattest") else body()
        return StreamingResponse(frames, media_type=MEDIA_TYPE)

    @app.post("/v1/transfer")
    async def transfer(request: Request) -> Any:
        env, req = await _open(request, MessageKind.data_transfer, {"gateway"}, DataTransfer)
        key = (req.task_id, req.data_id)
        leg = executors.get(key)
        if leg is None:
            raise HTTPException(404, f"no live executor for task {req.task_id!r}, data id {req.data_id!r}")
        if req.call != leg.task.call:
            raise HTTPException(400, "the transfer names another rule call than the leg was created with")
        timeout_s = max(1.0, env.header.expires_at - ctx.clock())
        if not leg.started.done():  # queued for an executor slot: wait for it, within the request's life
            try:
                await asyncio.wait_for(asyncio.shield(leg.started), timeout=timeout_s)
            except TimeoutError as exc:
                if leg.started.done():  # the executor's own start timed out
                    raise HTTPException(503, f"executor for task {req.task_id!r} did not come up: {exc}") from exc
                raise HTTPException(
                    503, f"leg ({req.task_id}, {req.data_id}) is still queued for an executor slot; retry later"
                ) from None
            except (OSError, ExecutorStartError) as exc:
                raise HTTPException(503, f"executor for task {req.task_id!r} could not start: {exc}") from exc
        run = runs.get(key)
        if run is None and not leg.running:
            raise HTTPException(404, f"no live executor for task {req.task_id!r}, data id {req.data_id!r}")
        if run is None:  # the first delivery runs the rule; a repeated one waits for (or reads) its record
            timeout_s = max(1.0, env.header.expires_at - ctx.clock())
            run = runs[key] = asyncio.ensure_future(_run_once(key, req, leg, timeout_s))
        try:
            record = await asyncio.shield(run)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            runs.pop(key, None)  # the executor failed: nothing was released, a retry may run it again
            why = str(exc) if isinstance(exc, ExecutorDied) else type(exc).__name__
            raise HTTPException(503, f"executor for task {req.task_id!r} failed: {why}") from exc
        if not leg.released:  # its rule ran: the executor's slot goes to the next queued leg now
            _release(leg)
        if not record.ok:
            return ctx.seal_to(
                gateway.name,
                MessageKind.transfer_result,
                req.task_id,
                req.data_id,
                {"ok": False, "error": record.error},
            )
        if record.data is None:
            return _stream(req, record)
        payload = {
            "ok": True,
            "result_text": record.data.decode(),
            "error": "",
            "attestation": _attestation(req, record),
        }
        return ctx.seal_to(gateway.name, MessageKind.transfer_result, req.task_id, req.data_id, payload)

    @app.get("/v1/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness for every member; the counters only for the operator identity (item 8)."""
        out: dict[str, Any] = {"name": cfg.name, "role": "party", "ok": True}
        peer = request_peer(request)
        if peer is not None and peer.role == "operator":
            out.update(
                executors=sum(leg.running for leg in executors.values()),
                queued_legs=sum(leg.handle is None for leg in executors.values()),
                handled=dict(ctx.handled),
                rejected=dict(ctx.gate.rejected),
                **counters,
            )
        return out

    return app
