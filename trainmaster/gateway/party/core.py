"""A party's state and its leg logic: executors (capped, queued past the cap), reports to the
gateway, each leg's one rule run and its record, and the sealed answers to transfers.

Every leg is a row in the party's own database before the party acknowledges it
(:mod:`.records`), so a party killed -9 comes back knowing its legs: a leg whose rule has not run
gets a new executor and is reported to the gateway again; a leg whose run the executor committed
(``executors.base``: the commit line) is adopted, not run again; a run that never committed had
not happened, and runs. A leg created while the gateway cannot be reached keeps reporting in the
background until the task's deadline, and an executor the gateway refuses is stopped at once
(item 8). A transfer, even repeated (a gateway restart), gets the leg's one record, under the data
set's disclosure limits; the result goes back sealed to the gateway with the party's signed
attestation (item 1): inline, or, past ``stream_chunk_bytes``, kept at the party and fetched
through the stream port. Only results of registered rules ever leave; the agent never reads the
data.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import Request
from pydantic import BaseModel

from trainmaster.gateway.audit.log import SELF, AuditLog, Requester
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.envelope import PublicIdentity, attest
from trainmaster.gateway.executors.base import Executor, ExecutorStartError, LegFiles, read_commits
from trainmaster.gateway.executors.process import ExecutorHandle
from trainmaster.gateway.models import DataTransfer, Envelope, ExecutorReport, LegAttestation, MessageKind, TaskCreate
from trainmaster.gateway.net.service import ServiceContext, read_envelope, request_peer
from trainmaster.gateway.net.tls import expect
from trainmaster.gateway.party.data import resolve_data_file
from trainmaster.gateway.party.records import PartyLeg, PartyRecords
from trainmaster.gateway.rules.privacy import PrivacyLedger, PrivacyRefusal, check_group_sizes, release_cost
from trainmaster.gateway.rules.registry import RuleError, validate_call

M = TypeVar("M", bound=BaseModel)
GROUP_CHECKED_RULES = ("histogram", "summary_stats", "train", "score")
SWEEP_EVERY_S = 30.0
AUDIT_SYNC_S = 1.0
START_RETRY_DELAY_S = 0.5
"""The pause after a failed executor start; it doubles after each one, up to :data:`START_RETRY_MAX_DELAY_S`."""
START_RETRY_MAX_DELAY_S = 10.0
START_WAIT_GROWTH_MAX = 8
"""Each start attempt waits twice as long for readiness as the last, up to this many times
``executor_start_timeout_s``: on a starved machine an executor that was nearly up when killed
would only start its imports over."""
MIN_START_WINDOW_S = 1.0
"""A start attempt is made only with at least this long left before the report margin."""


@dataclass(frozen=True)
class ReportAttempt:
    """How one executor report to the gateway went: ``ok``, ``refused`` (final) or ``unreachable``."""

    status: str
    why: str = ""


@dataclass
class LegExecutor:
    """A task leg's live executor (in memory; the leg itself is a row in :mod:`.records`).

    A leg created while the party runs ``max_executors`` executors waits in a queue (``handle`` is
    None until a slot frees); a leg whose rule has run gives its executor (and slot) back at once
    (``released``)."""

    task: TaskCreate
    deadline: float
    handle: Executor | None = None
    report: asyncio.Task[None] | None = None
    """The background job of the leg: its queued start and report, or a report being retried."""
    started: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    slot: bool = False
    released: bool = False
    attempts: int = 0
    """Executor starts tried for this leg (by this party process)."""
    last_error: str = ""
    """Why the last start attempt failed."""

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
        self.records = PartyRecords(f"sqlite:///{state / 'legs.db'}")
        self.audit = AuditLog(state / "audit.log", self.ctx.me)
        self.legs_root = state / "legs"
        self.executors: dict[tuple[str, str], LegExecutor] = {}
        self.slots = asyncio.Semaphore(cfg.max_executors)
        """One per running executor: a leg past the cap waits for one (queued), not refused."""
        self.runs: dict[tuple[str, str], asyncio.Future[PartyLeg]] = {}
        self.uploading: set[tuple[str, str]] = set()
        """Legs whose input is arriving right now (one stream at a time per leg)."""
        self.counters = {
            "rule_runs": 0,
            "report_retries": 0,
            "start_retries": 0,
            "recovered_legs": 0,
            "adopted_runs": 0,
        }
        self.gateway: PublicIdentity = next(p for p in self.ctx.roster.values() if p.role == "gateway")
        self.http: httpx.AsyncClient | None = None
        """Set while the app runs (its lifespan opens and closes it)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # -- requests ---------------------------------------------------------------------------

    async def open(
        self, request: Request, kind: MessageKind, roles: set[str], model: type[M]
    ) -> tuple[Envelope, Requester, M]:
        """The request's envelope through the gate: the envelope, its authenticated sender, its payload."""
        env = await read_envelope(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
        return (env, *self.open_envelope(env, kind, roles, model, request_peer(request)))

    def open_envelope(
        self, env: Envelope, kind: MessageKind, roles: set[str], model: type[M], peer: Any
    ) -> tuple[Requester, M]:
        sender, payload = self.ctx.gate.open(env, kind, roles, model, peer=peer)
        self.ctx.count(kind)
        return Requester(sender.name, sender.role, env.header.msg_id, env.signature), payload

    def files(self, task: TaskCreate) -> LegFiles:
        folder = self.legs_root / task.task_id / task.data_id
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return LegFiles(
            task.task_id,
            task.data_id,
            folder / "result",
            folder / "commit",
            folder / "input" if task.input is not None else None,
        )

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A background job kept until it ends (the loop holds only weak references)."""
        job = asyncio.ensure_future(coro)
        self._background.add(job)
        job.add_done_callback(self._background.discard)
        return job

    # -- executors --------------------------------------------------------------------------

    async def start_executor(
        self, data_file: Path, deadline_s: float, label: str, wait_s: float, silent: bool = False
    ) -> Executor:
        """The configured executor kind (both sit behind the same interface), given ``wait_s`` to
        report ready; ``silent`` is fault injection (it never reports)."""
        cfg = self.cfg
        if cfg.executor == "ray":
            from trainmaster.gateway.executors.rayactor import RayExecutor

            return await RayExecutor.start(
                data_file,
                deadline_s,
                wait_s,
                cfg.allowed_rules,
                cfg.ray_address,
                isolation=cfg.isolation,
                memory_mb=cfg.executor_memory_mb,
                label=label,
            )
        return await ExecutorHandle.start(
            data_file,
            deadline_s,
            wait_s,
            cfg.executor_memory_mb,
            cfg.allowed_rules,
            silent,
            cfg.isolation,
            label,
            max_result_bytes=cfg.max_result_bytes,
        )

    def release(self, leg: LegExecutor) -> None:
        """Stop the leg's executor and give its slot to the next queued leg (its record stays)."""
        leg.released = True
        if leg.handle is not None:
            leg.handle.kill()
        if leg.slot:
            leg.slot = False
            self.slots.release()

    def drop_executor(self, key: tuple[str, str]) -> None:
        """Stop a leg's executor and background job (the leg's row and files stay)."""
        leg = self.executors.pop(key, None)
        self.runs.pop(key, None)
        if leg is not None:
            self.release(leg)
            if leg.report is not None and leg.report is not asyncio.current_task():
                leg.report.cancel()

    def forget(self, key: tuple[str, str]) -> None:
        """Drop a leg altogether: its executor, row and files (refused by the gateway, or expired)."""
        self.drop_executor(key)
        self.records.delete(*key)
        shutil.rmtree(self.legs_root / key[0] / key[1], ignore_errors=True)

    def refused(self, key: tuple[str, str]) -> None:
        """The gateway refused the leg's executor report: its executor stops. A leg whose rule has
        not run is dropped (the gateway will never ask for it); one whose rule has run keeps its
        record and files: the gateway refuses a late report (a restarted party's, delivered after
        the leg was already run and recorded) because the leg is finished, and its result stays
        fetchable and counted."""
        record = self.records.get(*key)
        if record is not None and record.state == "done":
            self.drop_executor(key)
        else:
            self.forget(key)

    def expire(self, key: tuple[str, str], leg: LegExecutor) -> None:
        """At the task's deadline: the leg can no longer run; its executor stops (a stored result
        stays fetchable for ``result_retention_s``)."""
        if self.executors.get(key) is leg:
            self.drop_executor(key)
            record = self.records.get(*key)
            if record is not None and record.state != "done":
                self.records.finish_run(*key, ok=False, error="the task's deadline passed before its rule ran")
                self.audit.append("leg.expire", SELF, task_id=key[0], data_id=key[1])

    def schedule(self, leg: PartyLeg) -> LegExecutor:
        """A leg whose rule has not run: queue its executor start (and report), expire it at its deadline."""
        key = leg.key
        data_file = resolve_data_file(self.data_dir, leg.task.data_id)
        held = self.executors[key] = LegExecutor(leg.task, leg.deadline_at)
        held.report = self.spawn(self.start_queued(key, held, data_file))
        asyncio.get_running_loop().call_later(max(0.0, leg.deadline_at - time.time()), self.expire, key, held)
        return held

    async def start_queued(self, key: tuple[str, str], leg: LegExecutor, data_file: Path) -> None:
        """A leg's executor start in the background: wait for a slot (queued past the cap, until
        the deadline) unless it holds one, start its executor (retried, :meth:`start_retrying`),
        report it."""
        task = leg.task
        if not leg.slot:
            try:
                await asyncio.wait_for(self.slots.acquire(), timeout=max(0.0, leg.deadline - time.time()))
            except TimeoutError:
                self.drop_executor(key)
                return
            leg.slot = True
        handle = await self.start_retrying(key, leg, data_file)
        if handle is None:
            return
        leg.handle = handle
        leg.started.set_result(None)
        attempt = await self.report_once(task, handle.address, ready=True)
        if attempt.status == "refused":
            self.refused(key)
        elif attempt.status == "unreachable":
            await self.report_until_deadline(key, task, handle.address, leg.deadline)

    def start_window(self, leg: LegExecutor) -> float:
        """Seconds left for executor starts: until the task's deadline less a margin (a fifth of
        the task's time, at most 10 s) for the last attempt's own set-up and kill and the failure
        report, which must reach the gateway before the gateway ends the leg itself (with a vaguer
        reason)."""
        return leg.deadline - time.time() - min(10.0, 0.2 * leg.task.deadline_s)

    async def start_attempt(self, leg: LegExecutor, data_file: Path) -> Executor:
        """One executor start for the leg, given ``executor_start_timeout_s`` times 2^(attempts
        before), at most :data:`START_WAIT_GROWTH_MAX` times that and what the window leaves."""
        leg.attempts += 1
        growth = min(2 ** (leg.attempts - 1), START_WAIT_GROWTH_MAX)
        wait_s = max(MIN_START_WINDOW_S, min(self.cfg.executor_start_timeout_s * growth, self.start_window(leg)))
        task = leg.task
        return await self.start_executor(
            data_file,
            max(1.0, leg.deadline - time.time()),
            f"{task.task_id}.{task.data_id}",
            wait_s,
            silent=leg.attempts <= self.cfg.fault_executor_silent_starts,
        )

    async def start_retrying(self, key: tuple[str, str], leg: LegExecutor, data_file: Path) -> Executor | None:
        """The leg's executor, started again after each start that failed or did not report ready
        in time (a starved machine, a transient sandbox error), with backoff, until the start window
        closes (:meth:`start_window`); then the leg ends with the attempts and the last error
        (:meth:`failed_start`) and None is returned.

        Never twice: an attempt that did not come up is killed before the next one starts, and a
        rule runs only in the executor the leg keeps (``leg.handle``), which is set only for the
        attempt that reported ready; the rule's commit line counts its runs."""
        task, delay = leg.task, START_RETRY_DELAY_S
        while True:
            if leg.attempts:  # the last attempt failed: another, if one still fits
                if self.start_window(leg) - delay < MIN_START_WINDOW_S:
                    break
                self.counters["start_retries"] += 1
                self.audit.append(
                    "executor.retry",
                    SELF,
                    task_id=task.task_id,
                    data_id=task.data_id,
                    attempt=leg.attempts + 1,
                    detail=leg.last_error[:300],
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, START_RETRY_MAX_DELAY_S)
            try:
                return await self.start_attempt(leg, data_file)
            except (TimeoutError, ExecutorStartError) as exc:
                leg.last_error = str(exc) or type(exc).__name__
        reason = (
            f"executor did not come up in {leg.attempts} attempts before the task's deadline "
            f"(retried with backoff); last: {leg.last_error}"
        )
        leg.started.set_exception(TimeoutError(reason))
        leg.started.exception()  # retrieved here; a waiting transfer sees it too
        self.failed_start(key, task, reason, leg.deadline)
        return None

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

    def failed_start(self, key: tuple[str, str], task: TaskCreate, reason: str, deadline: float) -> None:
        """A leg whose executor did not come up: its executor and slot go, its row keeps the reason
        (``start_failed``) while the failure report to the gateway is retried, so a party killed
        meanwhile resends it after its restart (:meth:`recover`); once the gateway took it, the leg
        is forgotten (a new creation request for it starts over)."""
        self.drop_executor(key)
        self.records.fail_start(*key, reason)
        self.spawn(self.report_failure(task, reason, deadline))

    async def report_failure(self, task: TaskCreate, reason: str, deadline: float) -> None:
        """Report an executor that did not come up, retried while the gateway is unreachable,
        until the task's deadline: the gateway then ends the leg with the reason at once. Sent
        once, a report lost while the gateway restarted left the gateway waiting for the leg until
        the task's deadline (two legs of a 10,000-task storm with gateway kills, an hour each).
        The report is pending in the leg's row (``start_failed``) until it is delivered."""
        delay = 0.5
        while (await self.report_once(task, "", ready=False, reason=reason)).status == "unreachable":
            if time.time() + delay >= deadline:
                break
            self.counters["report_retries"] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        key = (task.task_id, task.data_id)
        record = self.records.get(*key)
        if record is not None and record.state == "start_failed" and key not in self.executors:
            self.forget(key)

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
                self.refused(key)
                return
            delay = min(delay * 2, 10.0)
        self.drop_executor(key)

    # -- the one run ------------------------------------------------------------------------

    def refusal(self, record: PartyLeg) -> str | None:
        """Why a run of this leg's rule is refused before it starts (budget, parameters), if it is."""
        try:
            params = validate_call(record.task.call, self.cfg.allowed_rules)
            self.ledger.charge(
                record.task.task_id,
                record.task.data_id,
                release_cost(record.task.call.rule, params, 1024),
                self.cfg.privacy_budget,
            )
        except (RuleError, PrivacyRefusal) as exc:
            return str(exc)
        return None

    def group_size_refusal(self, record: PartyLeg, files: LegFiles, size: int) -> str | None:
        """A JSON aggregate below the minimum group size is refused (not trimmed)."""
        if record.task.call.rule not in GROUP_CHECKED_RULES or size > self.cfg.stream_chunk_bytes:
            return None
        try:
            check_group_sizes(record.task.call.rule, json.loads(files.result.read_bytes()), self.cfg.min_group_size)
        except PrivacyRefusal as exc:
            return str(exc)
        return None

    async def run_once(self, record: PartyLeg, leg: LegExecutor, requester: Requester, timeout_s: float) -> PartyLeg:
        """Run the leg's rule and record it: charged against the data set's budget first, journaled
        as running, run by the executor into the leg's files (its commit line proves it ran), checked
        against the minimum group size, recorded; a refusal is recorded the same way."""
        key = record.key
        task = record.task
        why = self.refusal(record)
        if why is None and task.input is not None and not record.input_done:
            why = "the leg's input has not arrived whole"
        if why is not None:
            self.records.finish_run(*key, ok=False, error=why)
            self.audit.append(
                "rule.refused", requester, task_id=key[0], data_id=key[1], rule=task.call.rule, detail=why
            )
            return self._record(key)
        if self.cfg.fault_delay_s:
            await asyncio.sleep(self.cfg.fault_delay_s)
        files = self.files(task)
        self.records.start_run(*key)
        self.counters["rule_runs"] += 1
        assert leg.handle is not None  # the transfer waited for a queued leg's executor
        try:
            reply = await leg.handle.call(task.call, files, timeout_s=timeout_s)
        except Exception as exc:  # the executor died, timed out or answered garbage: recorded, never a 500
            adopted = self.adopt(record, files)
            if adopted is not None:
                return adopted
            why = str(exc) if str(exc) else type(exc).__name__
            if isinstance(exc, TimeoutError):
                why = f"the rule did not finish within {timeout_s:.0f}s"
            self.records.finish_run(*key, ok=False, error=f"executor failed: {why}")
            self.audit.append("rule.failed", requester, task_id=key[0], data_id=key[1], rule=task.call.rule, detail=why)
            return self._record(key)
        if not reply.ok:
            self.records.finish_run(*key, ok=False, error=reply.error)
        elif (refused := self.group_size_refusal(record, files, reply.size)) is not None:
            self.records.finish_run(*key, ok=False, error=refused)
        else:
            self.records.finish_run(*key, ok=True, size=reply.size, sha256=reply.sha256)
        done = self._record(key)
        self.audit.append(
            "rule.run",
            requester,
            task_id=key[0],
            data_id=key[1],
            rule=task.call.rule,
            initiator=record.requester,
            ok=done.ok,
            size=done.size,
            sha256=done.sha256,
            detail=done.error,
        )
        return done

    def adopt(self, record: PartyLeg, files: LegFiles) -> PartyLeg | None:
        """A run its executor committed (the commit line) but the party never recorded: record it."""
        commits = read_commits(files.commit)
        if not commits:
            return None
        last = commits[-1]
        try:
            size = files.result.stat().st_size
        except FileNotFoundError:
            return None
        if size != int(last["size"]):
            return None
        refused = self.group_size_refusal(record, files, size)
        if refused is not None:
            self.records.finish_run(*record.key, ok=False, error=refused)
        else:
            self.records.finish_run(*record.key, ok=True, size=size, sha256=str(last["sha256"]))
        self.counters["adopted_runs"] += 1
        self.audit.append("rule.adopted", SELF, task_id=record.key[0], data_id=record.key[1], size=size)
        return self._record(record.key)

    def _record(self, key: tuple[str, str]) -> PartyLeg:
        record = self.records.get(*key)
        assert record is not None
        return record

    def attestation(self, req: DataTransfer, record: PartyLeg, sha256: str | None = None) -> dict[str, Any]:
        body = LegAttestation(
            task_id=req.task_id,
            data_id=req.data_id,
            party=self.cfg.name,
            sha256=sha256 or record.sha256,
            size=record.size,
        )
        return attest(self.ctx.me, body).model_dump(mode="json")

    # -- restart ----------------------------------------------------------------------------

    def recover(self) -> None:
        """At start: resume every leg whose rule has not run to a record before its deadline. A run
        the executor committed is adopted; one it did not is undone (the rule runs when asked)."""
        for record in self.records.unfinished():
            if record.state == "start_failed":  # its failure report had not reached the gateway
                self.spawn(self.report_failure(record.task, record.error, record.deadline_at))
                self.counters["recovered_legs"] += 1
                self.audit.append(
                    "leg.recover", SELF, task_id=record.key[0], data_id=record.key[1], how="report_failure"
                )
                continue
            files = self.files(record.task)
            how = "rerun"
            if record.state == "running":
                adopted = self.adopt(record, files)
                if adopted is not None:
                    self.counters["recovered_legs"] += 1
                    continue
                self.records.reset(*record.key)
            try:
                self.schedule(self._record(record.key))
            except Exception as exc:  # its data file is gone: the leg fails clearly
                self.records.finish_run(*record.key, ok=False, error=f"the party could not resume this leg: {exc}")
                how = "failed"
            self.counters["recovered_legs"] += 1
            self.audit.append("leg.recover", SELF, task_id=record.key[0], data_id=record.key[1], how=how)

    async def sweep(self) -> None:
        """Every second: the audit log's group commit; every ``SWEEP_EVERY_S``: remove legs past
        their deadline plus ``result_retention_s`` (their rows and files)."""
        swept = time.monotonic()
        while True:
            await asyncio.sleep(AUDIT_SYNC_S)
            self.audit.sync()
            if time.monotonic() - swept < SWEEP_EVERY_S:
                continue
            swept = time.monotonic()
            for key in self.records.older_than(time.time() - self.cfg.result_retention_s):
                if key not in self.executors:
                    self.forget(key)

    async def shutdown(self) -> None:
        """Stop every executor (the lifespan's end), and Ray's sandboxes before Ray itself."""
        for job in list(self._background):
            job.cancel()
        for leg in self.executors.values():
            if leg.report is not None:
                leg.report.cancel()
        if self.http is not None:
            await self.http.aclose()
        for leg in self.executors.values():
            if leg.handle is not None:
                leg.handle.kill()
        self.audit.close()
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


def result_file(agent: PartyAgent, task_id: str, data_id: str) -> Path:
    return agent.legs_root / task_id / data_id / "result"
