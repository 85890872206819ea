"""What one service (gateway, party, initiator, operator) reads at start: its ``config.yaml``.

The bottom of the gateway package with :mod:`trainmaster.gateway.models`: every layer above reads
a :class:`ServiceConfig`, none is imported here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trainmaster.errors import UserError
from trainmaster.spec.boundedyaml import load_one
from trainmaster.gateway.models import ID_PATTERN


class ServiceConfig(BaseModel):
    """What one service (gateway, party or initiator) needs to start."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=ID_PATTERN)
    role: str = Field(pattern=r"^(gateway|party|initiator|operator)$")
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    stream_port: int = Field(default=0, ge=0, le=65535)
    """Gateway and parties: the stream port (bulk inputs and stored results on blocking TLS sockets)."""
    ca: str
    cert: str
    key: str
    sign_key: str
    enc_key: str
    roster: str
    state_dir: str
    db_url: str | None = None
    skew_s: float = Field(default=30.0, gt=0)
    party_concurrency: int = Field(default=8, ge=1)
    max_inflight_tasks: int = Field(default=256, ge=1)
    task_queue_depth: int = Field(default=4, ge=1)
    max_body_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    executor_start_timeout_s: float = Field(default=20.0, gt=0)
    """Party: how long an executor's first start may take to report ready. A start that fails or
    does not report in time is retried with backoff, each wait twice the last (up to 8x), until the
    task's deadline; only then does the leg end with the error."""
    executor_memory_mb: int = Field(default=4096, ge=64)
    allowed_rules: list[str] | None = None
    executor: str = Field(default="subprocess", pattern=r"^(subprocess|ray)$")
    """Party: how each task's isolated executor runs (a subprocess with rlimits, or a Ray actor)."""
    isolation: str = Field(default="sandbox", pattern=r"^(sandbox|process)$")
    """Party with ``executor: subprocess``: ``sandbox`` runs each executor in bubblewrap namespaces as
    uid 65534 with seccomp and cgroup limits (needs root and bubblewrap; the party refuses to start
    without them); ``process`` is the explicit opt-out: a plain subprocess with rlimits only."""
    ray_address: str | None = None
    """Party with ``executor: ray``: the cluster to use; unset starts a local Ray in the party."""
    stream_chunk_bytes: int = Field(default=1 << 20, ge=1024, le=8 << 20)
    """Results larger than this travel as a chunked stream of chunks this size (party config)."""
    max_result_bytes: int = Field(default=1 << 30, ge=1024)
    """The largest stored result an executor may write and the gateway or initiator accepts."""
    max_input_bytes: int = Field(default=1 << 30, ge=0)
    """The largest leg input (model, parameters) a party or the gateway accepts."""
    max_streams: int = Field(default=64, ge=1, le=4096)
    """Gateway and parties: streams served at once on the stream port; past it a stream gets 503."""
    stream_commit_bytes: int = Field(default=64 << 20, ge=1 << 20)
    """Party: an arriving input is made durable and its progress recorded every this many bytes (a
    group commit: one fdatasync and one row per step, not per chunk), so a resumed upload continues
    from the last step."""
    result_retention_s: float = Field(default=3600.0, ge=0)
    """Party: a stored result stays fetchable this long after its task's deadline, then it is removed."""
    # Connection hygiene (item 4), gateway and parties.
    header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """A connection must deliver a request's headers this long after it opens or after its last response."""
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """A request body must arrive whole within this long."""
    idle_timeout_s: float = Field(default=15.0, gt=0, le=600)
    """An idle keep-alive connection is closed after this long."""
    max_connections: int = Field(default=512, ge=4, le=65536)
    """Connections (and requests) served at once; past it new requests get 503."""
    max_header_bytes: int = Field(default=16384, ge=1024, le=1 << 20)
    # Bounds per member (items 5, 8).
    max_open_legs_per_party: int = Field(default=1024, ge=1)
    """Gateway: legs without an outcome a party may be assigned at once; a task past it is refused."""
    max_executors: int = Field(default=32, ge=1)
    """Party: executors running at once; a task created past it queues until one is released (its
    leg's rule has run, or its deadline passed)."""
    max_queued_legs: int = Field(default=4096, ge=0)
    """Party: legs waiting for an executor slot (a few hundred bytes each); a task creation past it
    gets 503 with Retry-After."""
    # Disclosure limits on aggregate rules (item 10), per party and data set.
    min_group_size: int = Field(default=5, ge=1)
    """Party: every non-empty histogram bin and every summary must cover at least this many rows."""
    privacy_budget: int = Field(default=200_000, ge=0)
    """Party: aggregate values one data set may release in total, over all tasks and initiators."""
    # Fault injection, off by default; the fault tests turn these on.
    fault_delay_s: float = 0.0
    fault_clock_offset_s: float = 0.0
    fault_executor_silent_starts: int = Field(default=0, ge=0)
    """Party: the first this many executor starts of each leg never report ready (a starved
    machine); a number past any retry count keeps every start silent."""
    fault_stream: str = Field(default="", pattern=r"^(|truncate|reorder|flip|slow|misattest)$")
    """Party: corrupt outgoing result streams this way (tests that the gateway refuses them);
    ``misattest`` signs a digest of other bytes than it streams (refused at the initiator)."""


def load_config(path: str | Path) -> ServiceConfig:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    try:
        return ServiceConfig.model_validate(load_one(p.read_text(), str(p)))
    except Exception as exc:  # pydantic ValidationError or YAML error: both the user's to fix
        raise UserError(f"invalid config {p}", details=[str(exc)]) from exc
