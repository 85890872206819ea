"""The initiator: creates a task at the gateway and its legs at the parties, then fetches every
result via the gateway.

Every leg's outcome comes back sealed to this initiator and signed by the gateway as a whole
(item 7); a result must also carry the attestation of the very party this initiator assigned the
leg to, over the result's digest (item 1), and the party printed is the one that signed. Calls
that fail because a service is down or busy are retried with backoff until the task's deadline,
with one line per retry on stderr instead of a traceback. A streamed result goes to a file, a
chunk at a time, so memory stays bounded whatever its size.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import httpx
from pydantic import BaseModel

from trainmaster.errors import UserError
from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.crypto.envelope import EnvelopeError, make_header, seal, verify_attestation
from trainmaster.gateway.initiator import resultlink
from trainmaster.gateway.crypto.gate import EnvelopeGate
from trainmaster.gateway.models import (
    DataReceive,
    LegAssignment,
    LegOutcomePayload,
    MessageKind,
    ResultFetch,
    RuleCall,
    TaskCancel,
    TaskCreate,
    TaskRegister,
    TaskResult,
)
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.provision import load_identity, load_roster
from trainmaster.gateway.crypto.replay import SeenTable
from trainmaster.gateway.net.tls import client_ssl_context, expect
from trainmaster.gateway.crypto.chunks import MEDIA_TYPE as STREAM_MEDIA_TYPE
from trainmaster.gateway.crypto.chunks import ChunkOpener, StreamInfo
from trainmaster.gateway.crypto.tlsid import dns_name

RETRY_STATUSES = (429, 502, 503, 504)


class Initiator:
    def __init__(
        self,
        cfg: ServiceConfig,
        timeout_s: float = 60.0,
        results_dir: str | Path | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg
        self.me = load_identity(cfg)
        self.roster = load_roster(cfg.roster)
        self.gateway = next(p for p in self.roster.values() if p.role == "gateway")
        self.gate = EnvelopeGate(self.me, self.roster, SeenTable("sqlite://"), cfg.skew_s)
        self.ssl_context = client_ssl_context(cfg)
        self.timeout_s = timeout_s
        self.http = httpx.Client(verify=self.ssl_context, timeout=timeout_s)
        self.results_dir = Path(results_dir) if results_dir else Path(cfg.state_dir) / "results"
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.assigned: dict[str, dict[str, str]] = {}
        """task id -> data id -> the party this initiator assigned it to (what results are checked against)."""

    def close(self) -> None:
        self.http.close()

    def _post(
        self,
        name: str,
        path: str,
        kind: MessageKind,
        task_id: str,
        data_id: str,
        payload: BaseModel,
        ttl_s: float = 120.0,
    ) -> httpx.Response:
        peer = self.roster[name]
        header = make_header(self.me.name, name, kind.value, task_id, data_id, ttl_s)
        env = seal(self.me, peer, header, payload.model_dump(mode="json"))
        return self.http.post(
            f"{peer.endpoint}{path}",
            content=env.model_dump_json(),
            headers={"content-type": "application/json"},
            extensions=expect(name, peer.role),
        )

    def _post_retrying(
        self,
        name: str,
        path: str,
        kind: MessageKind,
        task_id: str,
        data_id: str,
        payload: BaseModel,
        deadline: float,
        what: str,
        retry_statuses: tuple[int, ...] = RETRY_STATUSES,
    ) -> httpx.Response:
        """POST (a fresh envelope each time), retrying while ``name`` is unreachable or busy, with
        exponential backoff, until ``deadline`` (epoch seconds); one stderr line per retry."""
        delay, attempt = 0.25, 0
        while True:
            attempt += 1
            try:
                resp = self._post(name, path, kind, task_id, data_id, payload)
                if resp.status_code not in retry_statuses:
                    return resp
                why = f"busy ({resp.status_code})"
            except httpx.TransportError as exc:
                why = f"unreachable ({type(exc).__name__})"
            left = deadline - time.time()
            if left <= delay:
                raise UserError(
                    f"{what}: {name} at {self.roster[name].endpoint} stayed {why} until the task's "
                    f"deadline ({attempt} attempts)",
                    details=[f"is the {self.roster[name].role} running?"],
                    exit_code=3,
                )
            self.log(f"{what}: {name} {why}; retrying in {delay:.1f}s (attempt {attempt}, {left:.0f}s to the deadline)")
            time.sleep(delay)
            delay = min(delay * 2, 8.0)

    def register_task(
        self, task_id: str, legs: list[LegSpec], deadline_s: float = 300.0, deadline: float | None = None
    ) -> bool:
        """Create the task at the gateway (owner: this initiator); True if new, False for a retry of
        the same task. A task id used before for anything else is refused (exit 2)."""
        req = TaskRegister(
            task_id=task_id,
            legs=[
                LegAssignment(data_id=leg.data_id, party=leg.party, call=RuleCall(rule=leg.rule, params=leg.params))
                for leg in legs
            ],
            deadline_s=deadline_s,
        )
        resp = self._post_retrying(
            self.gateway.name,
            "/v1/tasks",
            MessageKind.task_register,
            task_id,
            "*",
            req,
            deadline or time.time() + deadline_s,
            f"creating task {task_id!r} at the gateway",
            retry_statuses=(502, 503, 504),
        )  # 429 here is a cap on open legs: say so
        if resp.status_code not in (200, 201):
            raise UserError(f"the gateway refused task {task_id!r} ({resp.status_code}): {_detail(resp)}")
        self.assigned[task_id] = {leg.data_id: leg.party for leg in legs}
        return resp.status_code == 201

    def create_leg(
        self, task_id: str, leg: LegSpec, deadline_s: float = 300.0, retry_until: float | None = None
    ) -> dict[str, Any]:
        """Ask the leg's party to start its executor; 201 (reported) and 202 (report pending) are ok.
        With ``retry_until`` (epoch seconds) an unreachable or busy party is retried until then."""
        party = self.roster.get(leg.party)
        if party is None or party.role != "party" or not party.endpoint:
            raise UserError(f"party {leg.party!r} is not in the roster")
        req = TaskCreate(
            task_id=task_id,
            party=leg.party,
            data_id=leg.data_id,
            call=RuleCall(rule=leg.rule, params=leg.params),
            deadline_s=deadline_s,
        )
        try:
            if retry_until is None:
                resp = self._post(party.name, "/v1/tasks", MessageKind.task_create, task_id, leg.data_id, req)
            else:
                resp = self._post_retrying(
                    party.name,
                    "/v1/tasks",
                    MessageKind.task_create,
                    task_id,
                    leg.data_id,
                    req,
                    retry_until,
                    f"creating leg {leg.data_id!r} at party {leg.party!r}",
                    retry_statuses=(503,),
                )  # busy (executor cap); a 504 is an outcome
        except httpx.TransportError as exc:
            return {"ok": False, "status": 0, "detail": f"party {leg.party!r} unreachable: {type(exc).__name__}"}
        except UserError as exc:
            return {"ok": False, "status": 0, "detail": exc.message}
        return {"ok": resp.status_code in (201, 202), "status": resp.status_code, "detail": _detail(resp)}

    def create_task(self, task_id: str, legs: list[LegSpec], deadline_s: float = 300.0) -> dict[str, dict[str, Any]]:
        """Create the task at the gateway, then every leg at its party."""
        self.register_task(task_id, legs, deadline_s)
        return {leg.data_id: self.create_leg(task_id, leg, deadline_s) for leg in legs}

    def cancel(self, task_id: str) -> list[str]:
        resp = self._post(
            self.gateway.name, "/v1/cancel", MessageKind.task_cancel, task_id, "*", TaskCancel(task_id=task_id)
        )
        if resp.status_code != 200:
            raise UserError(f"the gateway refused to cancel task {task_id!r} ({resp.status_code}): {_detail(resp)}")
        return list(resp.json()["cancelled"])

    def receive(
        self,
        task_id: str,
        data_ids: list[str],
        leg_timeout_s: float = 30.0,
        calls: dict[str, RuleCall] | None = None,
        deadline: float | None = None,
        parties: dict[str, str] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Fetch and verify results via the gateway; retries while it is down or busy (until ``deadline``).

        ``parties`` (data id -> party) is needed only by an initiator that did not create the task
        in this run (after a crash): results are checked against the party each leg was assigned to.
        """
        if parties:
            self.assigned.setdefault(task_id, {}).update(parties)
        req = DataReceive(task_id=task_id, data_ids=data_ids, leg_timeout_s=leg_timeout_s, calls=calls or {})
        resp = self._post_retrying(
            self.gateway.name,
            "/v1/receive",
            MessageKind.data_receive,
            task_id,
            "*",
            req,
            deadline or time.time() + leg_timeout_s + 60,
            f"fetching results of task {task_id!r}",
        )
        if resp.status_code != 200:
            raise UserError(f"gateway refused the data receive request ({resp.status_code}): {_detail(resp)}")
        result = TaskResult.model_validate_json(resp.content)
        out: dict[str, dict[str, Any]] = {}
        for leg in result.legs:
            try:
                out[leg.data_id] = self._verify_leg(task_id, leg.data_id, leg.envelope)
            except EnvelopeError as exc:
                out[leg.data_id] = {
                    "party": None,
                    "outcome": "rejected",
                    "final": True,
                    "detail": f"result refused at the initiator: {exc.reason}",
                }
            except (httpx.HTTPError, resultlink.ResultLinkError) as exc:
                out[leg.data_id] = {
                    "party": None,
                    "outcome": "rejected",
                    "final": False,
                    "detail": f"result stream could not be fetched: {type(exc).__name__}",
                }
        return out

    def _verify_leg(self, task_id: str, data_id: str, envelope: Any) -> dict[str, Any]:
        """One leg's outcome, believed only as far as signatures go (items 1 and 7)."""
        _s, p = self.gate.open(
            envelope, MessageKind.task_result, {"gateway"}, LegOutcomePayload, check_peer=False, once=False
        )
        if (p.task_id, p.data_id) != (task_id, data_id) or envelope.header.data_id != data_id:
            raise EnvelopeError(400, "outcome envelope is for another task leg")
        entry: dict[str, Any] = {"party": p.party, "outcome": p.outcome.value, "final": p.final}
        if p.outcome.value != "result":
            entry["detail"] = p.detail
            return entry
        expected = self.assigned.get(task_id, {}).get(data_id)
        if expected is None or p.attestation is None:
            raise EnvelopeError(
                403, "a result for a leg this initiator did not assign, or without its party's attestation"
            )
        verify_attestation(p.attestation, self.roster[expected], task_id, data_id)
        entry["party"] = p.attestation.body.party  # the signed party, not a field the gateway could change
        if p.stream is not None:
            info = StreamInfo.model_validate(p.stream)
            if info.sha256 != p.attestation.body.sha256 or info.total_bytes != p.attestation.body.size:
                raise EnvelopeError(422, "stream opening does not match the party's attested digest")
            try:
                entry["result_file"] = str(self.fetch_stream(task_id, data_id, info))
            except (EnvelopeError, resultlink.ResultLinkError) as exc:
                if p.final:
                    raise
                # A live stream (the gateway was still relaying it) that broke off: the relay failed
                # or the gateway went down. Not final: the leg's recorded outcome is asked for again.
                why = exc.reason if isinstance(exc, EnvelopeError) else type(exc).__name__
                return {
                    "party": entry["party"],
                    "outcome": "rejected",
                    "final": False,
                    "detail": f"live result stream broke off ({why}); asking the gateway again",
                }
            entry["final"] = True  # a complete, checked stream: the gateway recorded it before its last chunk
            return entry
        text = (p.result_text or "").encode()
        if hashlib.sha256(text).hexdigest() != p.attestation.body.sha256 or len(text) != p.attestation.body.size:
            raise EnvelopeError(422, "result does not match the digest its party signed")
        entry["result"] = json.loads(text)
        return entry

    def fetch_stream(self, task_id: str, data_id: str, info: StreamInfo) -> Path:
        """Pull a streamed result's chunks from the gateway into ``results_dir/<task>/<data id>.json``.

        Chunks are decrypted and written one at a time (memory stays at about one chunk); the file
        appears only whole and checked (written as ``.part``, renamed at the end, removed on any
        failure). Raises :class:`EnvelopeError` on a truncated, reordered or tampered stream. For a
        live stream (the gateway still relaying it) the chunks arrive as the party sends them.
        """
        if info.stream_id is None:
            raise EnvelopeError(400, "stream opening without a stream id")
        if not self.gateway.endpoint:
            raise resultlink.ResultLinkError(f"the roster gives gateway {self.gateway.name!r} no endpoint")
        opener = ChunkOpener(info, info.stream_id, self.cfg.max_result_bytes)
        path = self.results_dir / task_id / f"{data_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        header = make_header(self.me.name, self.gateway.name, MessageKind.result_fetch.value, task_id, data_id, 120.0)
        env = seal(self.me, self.gateway, header, ResultFetch(task_id=task_id, data_id=data_id).model_dump(mode="json"))
        try:
            with (
                resultlink.post(
                    self.ssl_context,
                    self.gateway.endpoint,
                    "/v1/results",
                    env.model_dump_json().encode(),
                    dns_name(self.gateway.name, "gateway"),
                    self.timeout_s,
                ) as resp,
                part.open("wb", buffering=0) as fh,
            ):
                if resp.status != 200 or not resp.content_type.startswith(STREAM_MEDIA_TYPE):
                    text = resp.body.read(4096).decode(errors="replace")
                    raise EnvelopeError(502, f"gateway did not send the result stream ({resp.status}): {text[:300]}")
                _receive_frames(resp.body, opener, fh)
                opener.finish()
                os.fsync(fh.fileno())
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        return path

    def run_task(self, spec: TaskSpec) -> dict[str, Any]:
        """Create the task and its legs, then fetch results until every leg is final or the
        task's deadline passes (a leg whose party has not reported yet is asked for again)."""
        task_id = spec.task_id or uuid.uuid4().hex[:16]
        deadline = time.time() + spec.deadline_s
        self.register_task(task_id, spec.legs, spec.deadline_s, deadline)
        # Parties are retried for a bounded share of the deadline, so the others' results still come back.
        retry_until = time.time() + min(60.0, spec.deadline_s / 2)
        created = {leg.data_id: self.create_leg(task_id, leg, spec.deadline_s, retry_until) for leg in spec.legs}
        waiting = [leg.data_id for leg in spec.legs]
        results: dict[str, dict[str, Any]] = {}
        delay = 0.5
        while waiting:
            got = self.receive(task_id, waiting, spec.leg_timeout_s, deadline=deadline)
            results.update(got)
            waiting = [d for d in waiting if not got[d]["final"] and created[d]["ok"]]
            if waiting and time.time() + delay < deadline:
                self.log(f"task {task_id!r}: {len(waiting)} leg(s) not final yet; asking again in {delay:.1f}s")
                time.sleep(delay)
                delay = min(delay * 2, 8.0)
            else:
                break
        for data_id, c in created.items():
            results[data_id].pop("final", None)
            if not c["ok"] and results[data_id]["outcome"] != "result":
                detail = results[data_id].get("detail", "")
                results[data_id]["detail"] = (detail + f"; task creation: {c['detail']}").strip("; ")
        return {"task_id": task_id, "legs": results}


def _receive_frames(body: resultlink.ResponseBody, opener: ChunkOpener, fh: BinaryIO) -> None:
    """Decrypt a result stream's frames into ``fh``: each frame is read straight into one reused
    buffer and decrypted into another, so memory stays at two chunks and nothing is allocated per MB."""
    header = bytearray(4)
    frame_buf = bytearray(opener.max_frame)
    plain_buf = bytearray(opener.info.chunk_bytes)
    while True:
        got = body.read_into(memoryview(header))
        if got == 0:
            return
        size = int.from_bytes(header, "big")
        if got < 4:
            raise EnvelopeError(400, "stream truncated inside a frame")
        if size > len(frame_buf):
            raise EnvelopeError(413, f"stream frame of {size} bytes is over the stream's {len(frame_buf)}-byte frames")
        frame = memoryview(frame_buf)[:size]
        if body.read_into(frame) < size:
            raise EnvelopeError(400, "stream truncated inside a frame")
        plain, _last = opener.open_into(frame, plain_buf)
        written = 0
        while written < len(plain):
            written += fh.write(plain[written:]) or 0


def _detail(resp: httpx.Response) -> str:
    if resp.headers.get("content-type", "").startswith("application/json"):
        try:
            return str(resp.json().get("detail", ""))
        except (ValueError, AttributeError):
            pass
    return resp.text[:300]
