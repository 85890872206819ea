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
    task_register = "task_register"
    task_create = "task_create"
    executor_report = "executor_report"
    data_receive = "data_receive"
    data_transfer = "data_transfer"
    transfer_result = "transfer_result"
    task_result = "task_result"
    result_fetch = "result_fetch"
    task_cancel = "task_cancel"


class Header(Strict):
    v: Literal[1]
    msg_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    kind: MessageKind
    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9_-]{0,63})$")
    sender: str = Field(pattern=ID_PATTERN)
    recipient: str = Field(pattern=ID_PATTERN)
    issued_at: float = Field(allow_inf_nan=False)
    expires_at: float = Field(allow_inf_nan=False)
    """Finite by the model (item 7): a NaN compares false with every bound, so it would pass any
    clock check written as ``if now > expires_at: refuse``."""


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


class LegAssignment(Strict):
    """One leg of a task: which party holds the data id and the rule it runs (fixed at creation)."""

    data_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    call: RuleCall


class TaskRegister(Strict):
    """Initiator -> gateway: create a task (its id, owner = the sender, and every leg's party).

    The gateway keeps it for good: an id is never reused, and the same body sent again is an
    idempotent retry (like an idempotency key), anything else under that id is refused.
    """

    task_id: str = Field(pattern=ID_PATTERN)
    legs: list[LegAssignment] = Field(min_length=1, max_length=256)
    deadline_s: float = Field(default=300.0, gt=0, le=3600)


class TaskCancel(Strict):
    """Initiator -> gateway: cancel the legs of a task it owns that have no outcome yet."""

    task_id: str = Field(pattern=ID_PATTERN)


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
    cancelled = "cancelled"
    party_unavailable = "party_unavailable"
    timeout = "timeout"
    rejected = "rejected"
    decrypt_failed = "decrypt_failed"


class LegAttestation(Strict):
    """What a party signs about the one result it gives for a leg: the initiator checks it against
    the key of the party it assigned the leg to, so neither another party nor the gateway can
    answer in its name (item 1). ``sha256``/``size`` are over the exact result bytes."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class SignedAttestation(Strict):
    body: LegAttestation
    signature: str = Field(pattern=B64_PATTERN, min_length=86, max_length=88)


class LegOutcomePayload(Strict):
    """The sealed, gateway-signed body of one leg's outcome (item 7): outcome, detail and party
    travel only inside the signature; for a result, the party's own attestation and the result
    text (inline) or the stream opening (large results, chunks from ``/v1/results``)."""

    task_id: str
    data_id: str
    party: str | None
    outcome: LegOutcome
    detail: str = ""
    result_text: str | None = None
    stream: dict[str, Any] | None = None
    attestation: SignedAttestation | None = None
    final: bool = True
    """False for a leg still waiting for its party's executor report: ask again before the deadline."""


class LegResult(Strict):
    """One leg as the gateway answers it: only the data id in the clear, the rest sealed."""

    data_id: str
    envelope: Envelope


class ResultFetch(Strict):
    """Initiator -> gateway: send the chunks of one leg's streamed result."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)


class TaskResult(Strict):
    task_id: str
    legs: list[LegResult]
