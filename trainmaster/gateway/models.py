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
    input_put = "input_put"
    stream_ready = "stream_ready"
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


SHA256_PATTERN = r"^[0-9a-f]{64}$"


class InputRef(Strict):
    """A leg's input (a model or parameters the initiator sends): its size and SHA-256, fixed when
    the task is created, so the party checks the bytes that arrive through the gateway against what
    the initiator signed in its own task creation request."""

    size: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_PATTERN)


class LegAssignment(Strict):
    """One leg of a task: which party holds the data id and the rule it runs (fixed at creation)."""

    data_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    call: RuleCall
    input: InputRef | None = None


class TaskRegister(Strict):
    """Initiator -> gateway: create a task (its id, owner = the sender, and every leg's party).

    The gateway keeps it for good: an id is never reused, and the same body sent again is an
    idempotent retry (like an idempotency key), anything else under that id is refused.
    """

    task_id: str = Field(pattern=ID_PATTERN)
    legs: list[LegAssignment] = Field(min_length=1, max_length=256)
    deadline_s: float = Field(default=300.0, gt=0, le=3600)
    run_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    """The sending run's own random id (not part of the task's body): a retry of the same run
    carries the same one, so the gateway can tell it from a later run reusing the task id."""


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
    input: InputRef | None = None


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
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int = Field(ge=0)


class SignedAttestation(Strict):
    body: LegAttestation
    signature: str = Field(pattern=B64_PATTERN, min_length=86, max_length=88)


class LegOutcomePayload(Strict):
    """The sealed, gateway-signed body of one leg's outcome (item 7): outcome, detail and party
    travel only inside the signature; for a result, the party's own attestation and the result
    text (inline), or ``stored`` for a large one, which stays at its party and is fetched through
    the gateway's stream port (its size and digest are the attestation's)."""

    task_id: str
    data_id: str
    party: str | None
    outcome: LegOutcome
    detail: str = ""
    result_text: str | None = None
    stored: bool = False
    attestation: SignedAttestation | None = None
    final: bool = True
    """False for a leg that may still run (its party has not reported, is restarting, or its input
    is still being sent): ask again before the deadline."""


class LegResult(Strict):
    """One leg as the gateway answers it: only the data id in the clear, the rest sealed."""

    data_id: str
    envelope: Envelope


class ResultFetch(Strict):
    """Initiator -> gateway, gateway -> party (stream port): send the chunks of one leg's stored
    result from byte ``offset`` (a resumed download; rounded down to a chunk boundary)."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    offset: int = Field(default=0, ge=0)


class InputPut(Strict):
    """Initiator -> gateway, gateway -> party (stream port): the chunks of one leg's input follow,
    AES-GCM under ``key`` (fresh per stream, known only to the two ends of this hop)."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    key: str = Field(pattern=r"^[A-Za-z0-9_=-]{43,44}$")
    chunk_bytes: int = Field(ge=1024, le=8 << 20)
    stream_id: str = Field(pattern=r"^[0-9a-f]{32}$")


class StreamReady(Strict):
    """The stream port's answer to a fetch or an input: where the chunks start (``offset``, a
    chunk boundary: a resumed transfer starts there), how big they are and, for a fetch, the fresh
    key and stream id they are sealed under."""

    task_id: str = Field(pattern=ID_PATTERN)
    data_id: str = Field(pattern=ID_PATTERN)
    offset: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    chunk_bytes: int = Field(ge=1024, le=8 << 20)
    key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_=-]{43,44}$")
    stream_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")


class TaskResult(Strict):
    task_id: str
    legs: list[LegResult]
