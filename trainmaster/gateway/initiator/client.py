"""The initiator: creates a task at the gateway and its legs at the parties, sends each leg's
input through the gateway, then fetches every result via the gateway.

Every leg's outcome comes back sealed to this initiator and signed by the gateway as a whole
(item 7); a result must also carry the attestation of the very party this initiator assigned the
leg to, over the result's digest (item 1), and the party printed is the one that signed. Calls
that fail because a service is down or busy are retried with backoff until the task's deadline,
with one line per retry on stderr instead of a traceback. Inputs and large results cross the
gateway's stream port a chunk at a time (:mod:`trainmaster.gateway.net.streams`), so memory stays
bounded whatever their size, and an interrupted transfer resumes from where it broke off: an input
from what its party committed, a result from what this initiator already holds in its ``.part``
file. A result file appears only whole and checked against its party's signed digest.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from trainmaster.errors import UserError
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.chunks import CHUNK_BYTES, ChunkOpener, ChunkSealer
from trainmaster.gateway.crypto.envelope import EnvelopeError, b64d, b64e, make_header, seal, verify_attestation
from trainmaster.gateway.crypto.gate import EnvelopeGate
from trainmaster.gateway.crypto.provision import load_identity, load_roster
from trainmaster.gateway.crypto.replay import SeenTable
from trainmaster.gateway.crypto.tlsid import dns_name
from trainmaster.gateway.initiator.taskfile import LegSpec, TaskSpec
from trainmaster.gateway.models import (
    DataReceive,
    Envelope,
    InputPut,
    InputRef,
    LegAssignment,
    LegOutcomePayload,
    MessageKind,
    ResultFetch,
    RuleCall,
    SignedAttestation,
    StreamReady,
    TaskCancel,
    TaskCreate,
    TaskRegister,
    TaskResult,
)
from trainmaster.gateway.net.filesink import FileSink, rehash_prefix
from trainmaster.gateway.net.streams import ChunkReader, StreamError, StreamSocket, connect
from trainmaster.gateway.net.tls import client_ssl_context, expect
from trainmaster.gateway.rules.registry import REGISTRY

RETRY_STATUSES = (429, 502, 503, 504)
READ_BLOCK = 1 << 20
STREAM_RETRY_S = 120.0
"""How long a broken stream (input or result) is resumed, by default."""


@dataclass(frozen=True)
class Registration:
    """The gateway's answer to a task creation: new, or created before (when, and whether by this run)."""

    created: bool
    created_at: float
    same_run: bool


class StreamRefused(Exception):
    """The gateway (or the party behind it) refused a stream: final unless ``status`` is 5xx."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def file_digest(path: Path) -> InputRef:
    """A leg input's size and SHA-256 (what its party checks the arriving bytes against)."""
    sha, size = hashlib.sha256(), 0
    buf = bytearray(READ_BLOCK)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            sha.update(memoryview(buf)[:n])
            size += n
    return InputRef(size=size, sha256=sha.hexdigest())


class Initiator:
    def __init__(
        self,
        cfg: ServiceConfig,
        timeout_s: float = 60.0,
        results_dir: str | Path | None = None,
        log: Callable[[str], None] | None = None,
        stream_retry_s: float = STREAM_RETRY_S,
    ):
        self.cfg = cfg
        self.me = load_identity(cfg)
        self.roster = load_roster(cfg.roster)
        self.gateway = next(p for p in self.roster.values() if p.role == "gateway")
        self.gate = EnvelopeGate(self.me, self.roster, SeenTable("sqlite://"), cfg.skew_s)
        self.ssl_context = client_ssl_context(cfg)
        self.timeout_s = timeout_s
        self.stream_retry_s = stream_retry_s
        """How long a broken stream is resumed (past the task's deadline for a result fetch)."""
        self.http = httpx.Client(verify=self.ssl_context, timeout=timeout_s)
        self.results_dir = Path(results_dir) if results_dir else Path(cfg.state_dir) / "results"
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.assigned: dict[str, dict[str, str]] = {}
        """task id -> data id -> the party this initiator assigned it to (what results are checked against)."""
        self.rules: dict[str, dict[str, str]] = {}
        self._inputs: dict[str, InputRef] = {}
        self.stored: dict[tuple[str, str], SignedAttestation] = {}
        """Results kept at their parties, by (task id, data id): their attestations, to fetch them."""

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

    def input_ref(self, path: Path) -> InputRef:
        """The size and digest of a leg input (hashed once per file per initiator)."""
        key = str(path)
        if key not in self._inputs:
            self._inputs[key] = file_digest(path)
        return self._inputs[key]

    def _assignment(self, leg: LegSpec) -> LegAssignment:
        return LegAssignment(
            data_id=leg.data_id,
            party=leg.party,
            call=RuleCall(rule=leg.rule, params=leg.params),
            input=self.input_ref(leg.input) if leg.input is not None else None,
        )

    def register_task(
        self,
        task_id: str,
        legs: list[LegSpec],
        deadline_s: float = 300.0,
        deadline: float | None = None,
        run_id: str | None = None,
    ) -> Registration:
        """Create the task at the gateway (owner: this initiator). The answer says whether it is
        new or was created before, when, and whether by this run (``run_id``: a retry of this run)
        or an earlier one. A task id used before for anything else is refused (exit 2)."""
        req = TaskRegister(
            task_id=task_id, legs=[self._assignment(leg) for leg in legs], deadline_s=deadline_s, run_id=run_id
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
        self.rules[task_id] = {leg.data_id: leg.rule for leg in legs}
        body = resp.json()
        return Registration(
            resp.status_code == 201, float(body.get("created_at", time.time())), bool(body.get("same_run", False))
        )

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
            input=self.input_ref(leg.input) if leg.input is not None else None,
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
                    retry_statuses=(502, 503),
                )  # busy (executor cap) or restarting; a 504 is an outcome
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

    # -- the stream port ----------------------------------------------------------------------

    def _stream(
        self, kind: MessageKind, task_id: str, data_id: str, payload: BaseModel
    ) -> tuple[StreamSocket, StreamReady]:
        """Open a stream at the gateway's stream port and take its sealed answer."""
        if not self.gateway.stream_endpoint:
            raise StreamRefused(400, f"the roster gives gateway {self.gateway.name!r} no stream endpoint")
        conn = connect(
            self.ssl_context,
            self.gateway.stream_endpoint,
            dns_name(self.gateway.name, "gateway"),
            self.timeout_s,
            f"gateway {self.gateway.name!r}",
        )
        try:
            header = make_header(self.me.name, self.gateway.name, kind.value, task_id, data_id, 120.0)
            conn.send_frame(
                seal(self.me, self.gateway, header, payload.model_dump(mode="json")).model_dump_json().encode()
            )
            answer = conn.recv_json()
            if answer["status"] != 200:
                raise StreamRefused(int(answer["status"]), str(answer.get("detail", "")))
            _s, ready = self.gate.open(
                Envelope.model_validate(answer.get("ready")),
                MessageKind.stream_ready,
                {"gateway"},
                StreamReady,
                check_peer=False,
            )  # the TLS server name was checked
            if (ready.task_id, ready.data_id) != (task_id, data_id):
                raise StreamRefused(502, "the gateway answered for another leg")
            return conn, ready
        except BaseException:
            conn.close()
            raise

    def _resuming(self, what: str, deadline: float, attempt: Callable[[], Any]) -> Any:
        """Run a stream ``attempt`` again while it breaks off (a service restarted, a 5xx), each try
        resuming where the last ended, until ``deadline``; a 4xx or a refused stream is final."""
        delay = 0.25
        while True:
            try:
                return attempt()
            except StreamRefused as exc:
                if exc.status < 500:
                    raise
                why = f"busy or restarting ({exc.status}: {exc.detail[:120]})"
            except StreamError as exc:
                why = f"broke off ({exc})"
            left = deadline - time.time()
            if left <= delay:
                raise StreamRefused(504, f"{what}: the stream kept failing until its deadline; last: {why}")
            self.log(f"{what}: {why}; resuming in {delay:.1f}s ({left:.0f}s to its deadline)")
            time.sleep(delay)
            delay = min(delay * 2, 8.0)

    def send_input(self, task_id: str, data_id: str, path: Path, deadline: float | None = None) -> dict[str, Any]:
        """Send a leg's input file through the gateway to its party, a chunk at a time, resuming from
        what the party committed after any break, until ``deadline``. The party checks the size and
        SHA-256 this initiator signed in the leg's task creation request."""
        ref = self.input_ref(path)

        def attempt() -> dict[str, Any]:
            key = os.urandom(32)
            put = InputPut(
                task_id=task_id, data_id=data_id, key=b64e(key), chunk_bytes=CHUNK_BYTES, stream_id=os.urandom(16).hex()
            )
            conn, ready = self._stream(MessageKind.input_put, task_id, data_id, put)
            try:
                if ready.total_bytes != ref.size or ready.chunk_bytes != put.chunk_bytes:
                    raise StreamRefused(409, "the gateway expects another input for this leg")
                sealer = ChunkSealer(key, put.stream_id, ready.offset // ready.chunk_bytes)
                plain, framed = bytearray(ready.chunk_bytes), sealer.buffer(ready.chunk_bytes)
                with path.open("rb", buffering=0) as fh:
                    fh.seek(ready.offset)
                    left = ref.size - ready.offset
                    while True:
                        n = fh.readinto(memoryview(plain)[: min(ready.chunk_bytes, left)]) if left else 0
                        if left and not n:
                            conn.send_chunk(sealer.abort("the input file shrank while it was being sent"))
                            raise StreamRefused(409, f"{path} shrank while it was being sent")
                        left -= n
                        conn.send_chunk(sealer.seal_into(memoryview(plain)[:n], left == 0, framed))
                        if left == 0:
                            break
                answer = conn.recv_json()
            finally:
                conn.close()
            if answer["status"] != 200:
                raise StreamRefused(int(answer["status"]), str(answer.get("detail", "")))
            return {"bytes": ref.size, "resumed_from": ready.offset}

        until = max(deadline or 0.0, time.time() + self.stream_retry_s)
        try:
            return dict(self._resuming(f"sending the input of leg {data_id!r}", until, attempt))
        except StreamRefused as exc:
            if exc.status == 409 and ("arrived already" in exc.detail or "reached its party already" in exc.detail):
                return {"bytes": ref.size, "resumed_from": ref.size}  # a retry after the party had it whole
            raise

    def fetch_result(self, task_id: str, data_id: str, attestation: SignedAttestation) -> Path:
        """Pull a stored result through the gateway into ``results_dir/<task>/<data id>.<ext>``.

        Chunks are decrypted, hashed and written one at a time (memory stays at about one chunk);
        a break resumes from what the ``.part`` file holds; the file appears only whole and checked
        against the party's signed digest (``.part`` renamed at the end). Raises
        :class:`EnvelopeError` for a tampered, reordered or truncated stream or other bytes than
        the party signed, :class:`StreamRefused` for a result the gateway or party cannot give.
        """
        rule = self.rules.get(task_id, {}).get(data_id, "")
        ext = "bin" if rule in REGISTRY and REGISTRY[rule].needs_input else "json"
        path = self.results_dir / task_id / f"{data_id}.{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        total, signed = attestation.body.size, attestation.body.sha256

        def attempt() -> None:
            have = part.stat().st_size if part.exists() else 0
            conn, ready = self._stream(
                MessageKind.result_fetch, task_id, data_id, ResultFetch(task_id=task_id, data_id=data_id, offset=have)
            )
            try:
                if ready.total_bytes != total or ready.key is None or ready.stream_id is None or ready.offset > have:
                    raise EnvelopeError(502, "the gateway's stream does not match the party's signed result")
                first = ready.offset // ready.chunk_bytes
                opener = ChunkOpener(b64d(ready.key), ready.stream_id, total, ready.chunk_bytes, first, ready.offset)
                sha = hashlib.sha256()
                fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    rehash_prefix(fd, ready.offset, sha, "the partial result file")
                    os.ftruncate(fd, ready.offset)
                    os.lseek(fd, ready.offset, os.SEEK_SET)
                    reader = ChunkReader(conn, opener)
                    sink = FileSink(fd, sha, ready.chunk_bytes, ready.offset)
                    try:
                        while True:
                            plain = sink.buffer()
                            view, last = reader.next_into(plain)
                            sink.put(plain, len(view))
                            if last:
                                break
                    finally:
                        sink.close()
                    opener.finish()
                    if sha.hexdigest() != signed:
                        os.ftruncate(fd, 0)
                        raise EnvelopeError(422, "stream content does not match the digest its party signed")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                conn.close()

        try:
            self._resuming(f"fetching the result of leg {data_id!r}", time.time() + self.stream_retry_s, attempt)
        except (EnvelopeError, StreamRefused):
            part.unlink(missing_ok=True)
            raise
        os.replace(part, path)
        return path

    # -- results ------------------------------------------------------------------------------

    def receive(
        self,
        task_id: str,
        data_ids: list[str],
        leg_timeout_s: float = 30.0,
        calls: dict[str, RuleCall] | None = None,
        deadline: float | None = None,
        parties: dict[str, str] | None = None,
        fetch: bool = True,
    ) -> dict[str, dict[str, Any]]:
        """Fetch and verify results via the gateway; retries while it is down or busy (until ``deadline``).

        ``parties`` (data id -> party) is needed only by an initiator that did not create the task
        in this run (after a crash): results are checked against the party each leg was assigned to.
        ``fetch=False`` leaves a stored result at its party (its leg says ``stored`` and its size;
        :meth:`fetch_result` with ``self.stored[(task id, data id)]`` brings it later).
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
                out[leg.data_id] = self._verify_leg(task_id, leg.data_id, leg.envelope, fetch)
            except EnvelopeError as exc:
                out[leg.data_id] = {
                    "party": None,
                    "outcome": "rejected",
                    "final": True,
                    "detail": f"result refused at the initiator: {exc.reason}",
                }
            except StreamRefused as exc:
                out[leg.data_id] = {
                    "party": None,
                    "outcome": "rejected",
                    "final": True,
                    "detail": f"result could not be fetched ({exc.status}): {exc.detail}",
                }
        return out

    def _verify_leg(self, task_id: str, data_id: str, envelope: Any, fetch: bool = True) -> dict[str, Any]:
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
        if p.stored:
            entry["bytes"] = p.attestation.body.size
            self.stored[(task_id, data_id)] = p.attestation
            if fetch:
                entry["result_file"] = str(self.fetch_result(task_id, data_id, p.attestation))
            else:
                entry["stored"] = True
            return entry
        text = (p.result_text or "").encode()
        if hashlib.sha256(text).hexdigest() != p.attestation.body.sha256 or len(text) != p.attestation.body.size:
            raise EnvelopeError(422, "result does not match the digest its party signed")
        entry["result"] = json.loads(text)
        return entry

    def run_task(self, spec: TaskSpec, fresh: bool = False) -> dict[str, Any]:
        """Create the task and its legs, send the legs' inputs, then fetch results until every leg is
        final or the task's deadline passes (a leg that may still run is asked for again).

        A task id an earlier run created is never run again: its stored results are shown, and the
        report and a line on stderr say so and when it ran (``fresh`` refuses instead, exit 2)."""
        task_id = spec.task_id or uuid.uuid4().hex[:16]
        deadline = time.time() + spec.deadline_s
        reg = self.register_task(task_id, spec.legs, spec.deadline_s, deadline, run_id=uuid.uuid4().hex)
        earlier = None if reg.created or reg.same_run else _when(reg.created_at)
        if earlier is not None:
            if fresh:
                raise UserError(
                    f"task id {task_id!r} was used before: an earlier run created it at {earlier}",
                    details=[
                        "--fresh refuses to show that run's stored results; choose a new task_id "
                        "(or drop task_id from the task file to get a new one each run)"
                    ],
                )
            self.log(
                f"task {task_id!r} was created by an earlier run at {earlier}: showing that run's stored "
                "results (nothing runs again); choose a new task_id, or drop it from the task file, to run anew"
            )
            deadline = max(deadline, time.time() + spec.leg_timeout_s + 60)
        # Parties are retried for a bounded share of the deadline, so the others' results still come back.
        retry_until = time.time() + min(60.0, spec.deadline_s / 2)
        created = {leg.data_id: self.create_leg(task_id, leg, spec.deadline_s, retry_until) for leg in spec.legs}
        for leg in spec.legs:
            if leg.input is not None and created[leg.data_id]["ok"]:
                try:
                    self.send_input(task_id, leg.data_id, leg.input, deadline)
                except StreamRefused as exc:
                    created[leg.data_id] = {"ok": False, "status": exc.status, "detail": f"input: {exc.detail}"}
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
        report: dict[str, Any] = {"task_id": task_id, "legs": results}
        if earlier is not None:
            report["earlier_run"] = {"created_at": earlier, "note": "stored results of that run; nothing ran again"}
        return report


def _when(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat(timespec="seconds")


def _detail(resp: httpx.Response) -> str:
    if resp.headers.get("content-type", "").startswith("application/json"):
        try:
            return str(resp.json().get("detail", ""))
        except (ValueError, AttributeError):
            pass
    return resp.text[:300]
