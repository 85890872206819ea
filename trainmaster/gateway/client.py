"""The initiator: creates a task's legs at the parties, then fetches every result via the gateway.

It talks to each party once (task creation) and to the gateway once per fetch; every result comes
back sealed by the gateway to the initiator, and is verified and decrypted here.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainmaster.errors import UserError
from trainmaster.gateway.crypto import EnvelopeError, make_header, seal
from trainmaster.gateway.gate import EnvelopeGate
from trainmaster.gateway.models import (
    ID_PATTERN, DataReceive, MessageKind, ResultFetch, RuleCall, TaskCreate, TaskResult,
)
from trainmaster.gateway.provision import ServiceConfig, load_identity, load_roster
from trainmaster.gateway.routing import SeenTable
from trainmaster.gateway.service import client_ssl_context
from trainmaster.gateway.stream import MEDIA_TYPE as STREAM_MEDIA_TYPE
from trainmaster.gateway.stream import ChunkOpener, FrameSplitter, StreamInfo


class LegSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    rule: str
    params: dict[str, Any] = Field(default_factory=dict)


class TaskSpec(BaseModel):
    """A task file: which party holds each data id and the rule to run on it."""

    model_config = ConfigDict(extra="forbid")
    task_id: str | None = Field(default=None, pattern=ID_PATTERN)
    leg_timeout_s: float = Field(default=30.0, gt=0, le=600)
    deadline_s: float = Field(default=300.0, gt=0, le=3600)
    legs: list[LegSpec] = Field(min_length=1)


def load_task(path: str | Path) -> TaskSpec:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"task file not found: {p}")
    try:
        return TaskSpec.model_validate(yaml.safe_load(p.read_text()))
    except (ValidationError, yaml.YAMLError) as exc:
        raise UserError(f"invalid task file {p}", details=[str(exc)]) from exc


class Initiator:
    def __init__(self, cfg: ServiceConfig, timeout_s: float = 60.0):
        self.cfg = cfg
        self.me = load_identity(cfg)
        self.roster = load_roster(cfg.roster)
        self.gateway = next(p for p in self.roster.values() if p.role == "gateway")
        # Per-run seen table: a result fetched twice in one run is delivered once.
        self.gate = EnvelopeGate(self.me, self.roster, SeenTable("sqlite://"), cfg.skew_s)
        self.http = httpx.Client(verify=client_ssl_context(cfg), timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _post(self, url: str, recipient: str, kind: MessageKind, task_id: str, data_id: str, payload: BaseModel,
              ttl_s: float = 120.0) -> httpx.Response:
        header = make_header(self.me.name, recipient, kind.value, task_id, data_id, ttl_s)
        env = seal(self.me, self.roster[recipient], header, payload.model_dump(mode="json"))
        return self.http.post(url, content=env.model_dump_json(), headers={"content-type": "application/json"})

    def create_leg(self, task_id: str, leg: LegSpec, deadline_s: float = 300.0) -> dict[str, Any]:
        party = self.roster.get(leg.party)
        if party is None or party.role != "party" or not party.endpoint:
            raise UserError(f"party {leg.party!r} is not in the roster")
        req = TaskCreate(task_id=task_id, party=leg.party, data_id=leg.data_id,
                         call=RuleCall(rule=leg.rule, params=leg.params), deadline_s=deadline_s)
        try:
            resp = self._post(f"{party.endpoint}/v1/tasks", party.name, MessageKind.task_create, task_id, leg.data_id, req)
        except httpx.TransportError as exc:
            return {"ok": False, "status": 0, "detail": f"party {leg.party!r} unreachable: {type(exc).__name__}"}
        return {"ok": resp.status_code == 201, "status": resp.status_code, "detail": resp.json().get("detail", "")
                if resp.headers.get("content-type", "").startswith("application/json") else resp.text[:300]}

    def receive(self, task_id: str, data_ids: list[str], leg_timeout_s: float = 30.0,
                calls: dict[str, RuleCall] | None = None) -> dict[str, dict[str, Any]]:
        """Fetch results via the gateway; retries on 429 with a bounded backoff."""
        req = DataReceive(task_id=task_id, data_ids=data_ids, leg_timeout_s=leg_timeout_s, calls=calls or {})
        for attempt in range(8):
            resp = self._post(f"{self.gateway.endpoint}/v1/receive", self.gateway.name, MessageKind.data_receive,
                              task_id, "*", req)
            if resp.status_code != 429:
                break
            time.sleep(min(2.0, 0.1 * 2**attempt))
        if resp.status_code != 200:
            raise UserError(f"gateway refused the data receive request ({resp.status_code}): {resp.text[:300]}")
        result = TaskResult.model_validate_json(resp.content)
        out: dict[str, dict[str, Any]] = {}
        for leg in result.legs:
            entry: dict[str, Any] = {"party": leg.party, "outcome": leg.outcome.value}
            if leg.envelope is not None:
                try:
                    _s, payload = self.gate.open(leg.envelope, MessageKind.task_result, {"gateway"}, _ResultPayload)
                    if leg.envelope.header.data_id != leg.data_id or leg.envelope.header.task_id != task_id:
                        raise EnvelopeError(400, "result envelope is for another task leg")
                    result = payload.result
                    if payload.stream is not None:
                        result = self.fetch_stream(task_id, leg.data_id, payload.stream, leg.envelope.header.msg_id)
                    entry["result"] = result
                except EnvelopeError as exc:
                    entry.update(outcome="rejected", detail=f"result refused at the initiator: {exc.reason}")
                except httpx.HTTPError as exc:
                    entry.update(outcome="rejected", detail=f"result stream could not be fetched: {type(exc).__name__}")
            else:
                entry["detail"] = leg.detail
            out[leg.data_id] = entry
        return out

    def fetch_stream(self, task_id: str, data_id: str, info: StreamInfo, stream_id: str) -> dict[str, Any]:
        """Pull a streamed result's chunks from the gateway and check them against the signed opening.

        Chunks are decrypted one at a time; only the result itself is assembled (the caller wants it
        as a dict). Raises :class:`EnvelopeError` on a truncated, reordered or tampered stream.
        """
        opener = ChunkOpener(info, stream_id, self.cfg.max_result_bytes)
        splitter = FrameSplitter()
        out = bytearray()
        header = make_header(self.me.name, self.gateway.name, MessageKind.result_fetch.value, task_id, data_id, 120.0)
        env = seal(self.me, self.gateway, header, ResultFetch(task_id=task_id, data_id=data_id).model_dump(mode="json"))
        with self.http.stream("POST", f"{self.gateway.endpoint}/v1/results", content=env.model_dump_json(),
                              headers={"content-type": "application/json"}) as resp:
            if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith(STREAM_MEDIA_TYPE):
                resp.read()
                raise EnvelopeError(502, f"gateway did not send the result stream ({resp.status_code}): {resp.text[:300]}")
            for data in resp.iter_bytes():
                for body in splitter.feed(data):
                    out += opener.open(body)[0]
        splitter.close()
        opener.finish()
        try:
            return json.loads(out)
        except json.JSONDecodeError as exc:
            raise EnvelopeError(422, "streamed result is not JSON") from exc

    def run_task(self, spec: TaskSpec) -> dict[str, Any]:
        task_id = spec.task_id or uuid.uuid4().hex[:16]
        created = {leg.data_id: self.create_leg(task_id, leg, spec.deadline_s) for leg in spec.legs}
        results = self.receive(task_id, [leg.data_id for leg in spec.legs], spec.leg_timeout_s)
        for data_id, c in created.items():
            if not c["ok"] and results[data_id]["outcome"] != "result":
                results[data_id].setdefault("detail", "")
                results[data_id]["detail"] = (results[data_id]["detail"] + f"; task creation: {c['detail']}").strip("; ")
        return {"task_id": task_id, "legs": results}


class _ResultPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    party: str
    result: dict[str, Any] | None
    stream: StreamInfo | None = None
