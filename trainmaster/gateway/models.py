"""Wire models: strict (``extra="forbid"``), size-capped, and the only shapes a service accepts."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
"""Task, data and identity ids: no dots, slashes or NULs, so an id can never name a path."""

B64_PATTERN = r"^[A-Za-z0-9_=-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MessageKind(str, Enum):
    task_create = "task_create"
    executor_report = "executor_report"
    data_receive = "data_receive"
    data_transfer = "data_transfer"
    transfer_result = "transfer_result"
    task_result = "task_result"
    result_fetch = "result_fetch"


class Header(Strict):
    v: Literal[1]
    msg_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    kind: MessageKind
    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9_-]{0,63})$")
    sender: str = Field(pattern=ID_PATTERN)
    recipient: str = Field(pattern=ID_PATTERN)
    issued_at: float
    expires_at: float


class Envelope(Strict):
    header: Header
    eph_pub: str = Field(pattern=B64_PATTERN, min_length=43, max_length=44)
    nonce: str = Field(pattern=B64_PATTERN, min_length=16, max_length=16)
    ciphertext: str = Field(pattern=B64_PATTERN, min_length=22, max_length=140 * 1024 * 1024)
    signature: str = Field(pattern=B64_PATTERN, min_length=86, max_length=88)


class RuleCall(Strict):
    """A processing rule by name with its parameters; code is never an option."""

    rule: str = Field(pattern=r"^[a-z][a-z0-9_]{0,47}$")
    params: dict[str, Any] = Field(default_factory=dict)


class TaskCreate(Strict):
    """Initiator -> party: start an isolated executor for (task, data id) under this rule."""

    task_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    call: RuleCall
    deadline_s: float = Field(default=300.0, gt=0, le=3600)


class ExecutorReport(Strict):
    """Party -> gateway: where the task's executor is (or that it failed to come up)."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    address: str = Field(max_length=300)
    call: RuleCall
    ready: bool = True
    reason: str = Field(default="", max_length=500)


class DataReceive(Strict):
    """Initiator -> gateway: fetch these data ids' results for one task."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_ids: list[str] = Field(min_length=1, max_length=256)
    calls: dict[str, RuleCall] = Field(default_factory=dict)
    leg_timeout_s: float = Field(default=30.0, gt=0, le=600)


class DataTransfer(Strict):
    """Gateway -> party: run the rule on the data in the task's executor."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    call: RuleCall


class LegOutcome(str, Enum):
    result = "result"
    party_unavailable = "party_unavailable"
    timeout = "timeout"
    rejected = "rejected"
    decrypt_failed = "decrypt_failed"


class LegResult(Strict):
    """One leg's recorded outcome; ``envelope`` (sealed to the initiator) is set for results."""

    data_id: str
    party: str | None
    outcome: LegOutcome
    detail: str = ""
    envelope: Envelope | None = None
    stream_bytes: int | None = None
    """Set for a large result: ``envelope`` opens the stream, its chunks come from ``/v1/results``."""


class ResultFetch(Strict):
    """Initiator -> gateway: send the chunks of one leg's streamed result."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)


class TaskResult(Strict):
    task_id: str
    legs: list[LegResult]
