"""The party agent: holds data files that never leave it, runs rules in per-task executors.

``POST /v1/tasks`` (from the initiator): validate the data id and rule, start an isolated executor
for the task, report its address to the gateway. ``POST /v1/transfer`` (from the gateway): run the
rule inside that task's executor and return the result sealed to the gateway. Only results of
registered rules ever leave; the data file itself is never read by the agent.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from trainmaster.errors import UserError
from trainmaster.gateway.crypto import EnvelopeError, b64e
from trainmaster.gateway.executor import Executor, ExecutorDied, ExecutorHandle, ExecutorStartError, RuleReply
from trainmaster.gateway.models import DataTransfer, Envelope, ExecutorReport, MessageKind, TaskCreate
from trainmaster.gateway.provision import ServiceConfig
from trainmaster.gateway.rules import RuleError, validate_call
from trainmaster.gateway.service import ServiceContext, install_common, mtls_client
from trainmaster.gateway.stream import MEDIA_TYPE, ChunkSealer, StreamInfo, frame


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
        raise EnvelopeError(409, f"data id {data_id!r} has both a CSV and a Parquet file at this party; "
                                 "the party operator must keep only one")
    return found[0]


async def _corrupt(frames: AsyncIterator[bytes], mode: str) -> AsyncIterator[bytes]:
    """Fault injection only (``fault_stream``): drop the last chunk, swap the first two, or flip a bit."""
    held: list[bytes] = []
    index = -1
    async for f in frames:
        index += 1
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


def build_party_app(cfg: ServiceConfig, data_dir: Path) -> FastAPI:
    if cfg.executor == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise UserError(f"party {cfg.name!r} is configured with executor: ray, but Ray is not installed",
                            details=["install the ray extra (pip install 'trainmaster[ray]') or set executor: subprocess"])
    if cfg.executor == "subprocess" and cfg.isolation == "sandbox":
        from trainmaster.gateway.sandbox import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise UserError(f"party {cfg.name!r}: executor isolation 'sandbox' is not available on this host: {reason}",
                            details=["run the party as root on a host with bubblewrap and cgroup v1 memory/pids "
                                     "(apt-get install -y bubblewrap, or make sandbox-deps)",
                                     "or opt out: set isolation: process in the party's config (or pass "
                                     "--isolation process) to run executors as plain processes, without "
                                     "namespaces, seccomp or cgroup limits"])
    ctx = ServiceContext.load(cfg, f"sqlite:///{Path(cfg.state_dir).resolve() / 'seen.db'}")
    executors: dict[tuple[str, str], Executor] = {}
    gateway = next(p for p in ctx.roster.values() if p.role == "gateway")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.http = mtls_client(cfg)
        yield
        await app.state.http.aclose()
        for h in executors.values():
            h.kill()
        if cfg.executor == "ray":
            import ray

            ray.shutdown()

    app = FastAPI(title=f"trainmaster party {cfg.name}", lifespan=lifespan)
    app.state.ctx = ctx
    install_common(app, cfg.max_body_bytes)

    async def _start_executor(data_file: Path, deadline_s: float, label: str) -> Executor:
        """The configured executor kind; both sit behind the same interface."""
        if cfg.executor == "ray":
            from trainmaster.gateway.rayexec import RayExecutor

            return await RayExecutor.start(data_file, deadline_s, cfg.executor_start_timeout_s, cfg.allowed_rules,
                                           cfg.ray_address)
        return await ExecutorHandle.start(data_file, deadline_s, cfg.executor_start_timeout_s, cfg.executor_memory_mb,
                                          cfg.allowed_rules, cfg.fault_executor_silent, cfg.isolation, label)

    async def _report(task: TaskCreate, address: str, ready: bool, reason: str = "") -> None:
        report = ExecutorReport(task_id=task.task_id, data_id=task.data_id, address=address, call=task.call,
                                ready=ready, reason=reason)
        env = ctx.seal_to(gateway.name, MessageKind.executor_report, task.task_id, task.data_id, report.model_dump(mode="json"))
        resp = await app.state.http.post(f"{gateway.endpoint}/v1/executors", content=env.model_dump_json(),
                                         headers={"content-type": "application/json"}, timeout=15.0)
        if resp.status_code != 200:
            raise HTTPException(502, f"gateway refused the executor report: {resp.text[:300]}")

    @app.post("/v1/tasks", status_code=201)
    async def create_task(env: Envelope) -> dict[str, Any]:
        _sender, task = ctx.gate.open(env, MessageKind.task_create, {"initiator"}, TaskCreate)
        ctx.count(MessageKind.task_create)
        if task.party != cfg.name:
            raise HTTPException(400, f"task creation request is for party {task.party!r}, not {cfg.name!r}")
        data_file = resolve_data_file(data_dir, task.data_id)
        try:
            validate_call(task.call, cfg.allowed_rules)
        except RuleError as exc:
            raise HTTPException(400, str(exc)) from exc
        key = (task.task_id, task.data_id)
        if key in executors and executors[key].alive:
            return {"task_id": task.task_id, "data_id": task.data_id, "address": executors[key].address}
        try:
            handle = await _start_executor(data_file, task.deadline_s, f"{task.task_id}.{task.data_id}")
        except TimeoutError as exc:
            await _report(task, "", ready=False, reason=str(exc))
            raise HTTPException(504, f"executor for task {task.task_id!r} did not come up: {exc}") from exc
        except ExecutorStartError as exc:
            await _report(task, "", ready=False, reason=str(exc))
            raise HTTPException(503, f"executor for task {task.task_id!r} could not start: {exc}") from exc
        executors[key] = handle
        await _report(task, handle.address, ready=True)
        return {"task_id": task.task_id, "data_id": task.data_id, "address": handle.address}

    def _stream(req: DataTransfer, reply: RuleReply) -> StreamingResponse:
        """A large result as a signed opening plus AES-GCM chunks, read off the executor as sent."""
        key = os.urandom(32)
        info = StreamInfo(key=b64e(key), total_bytes=reply.size, sha256=reply.sha256, chunk_bytes=cfg.stream_chunk_bytes)
        opening = ctx.seal_to(gateway.name, MessageKind.transfer_result, req.task_id, req.data_id,
                              {"ok": True, "result": None, "error": "", "stream": info.model_dump()})
        sealer = ChunkSealer(key, opening.header.msg_id)

        async def body() -> AsyncIterator[bytes]:
            try:
                yield frame(opening.model_dump_json().encode())
                async for piece, last in reply.chunks(cfg.stream_chunk_bytes):
                    yield frame(sealer.seal(piece, last))
            finally:
                reply.close()

        frames = _corrupt(body(), cfg.fault_stream) if cfg.fault_stream else body()
        return StreamingResponse(frames, media_type=MEDIA_TYPE)

    @app.post("/v1/transfer", response_model=Envelope)
    async def transfer(env: Envelope) -> Any:
        _sender, req = ctx.gate.open(env, MessageKind.data_transfer, {"gateway"}, DataTransfer)
        ctx.count(MessageKind.data_transfer)
        handle = executors.get((req.task_id, req.data_id))
        if handle is None or not handle.alive:
            raise HTTPException(404, f"no live executor for task {req.task_id!r}, data id {req.data_id!r}")
        if cfg.fault_delay_s:
            await asyncio.sleep(cfg.fault_delay_s)
        try:
            validate_call(req.call, cfg.allowed_rules)
        except RuleError as exc:
            raise HTTPException(400, str(exc)) from exc
        try:
            reply = await handle.call(req.call, timeout_s=max(1.0, env.header.expires_at - ctx.clock()))
            if reply.ok and reply.size > cfg.stream_chunk_bytes:
                return _stream(req, reply)
            try:
                result = json.loads(await reply.read_all()) if reply.ok else None
            finally:
                reply.close()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            why = str(exc) if isinstance(exc, ExecutorDied) else type(exc).__name__
            raise HTTPException(503, f"executor for task {req.task_id!r} failed: {why}") from exc
        payload = {"ok": reply.ok, "result": result, "error": reply.error}
        return ctx.seal_to(gateway.name, MessageKind.transfer_result, req.task_id, req.data_id, payload)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"name": cfg.name, "role": "party", "executors": sum(h.alive for h in executors.values()),
                "handled": dict(ctx.handled), "rejected": dict(ctx.gate.rejected)}

    return app
