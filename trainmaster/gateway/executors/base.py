"""What the party needs from a per-task executor, whatever runs it: the :class:`Executor`
interface, where a rule run writes (:class:`LegFiles`), the run's commit, and the errors.

A rule run writes its result straight into the leg's result file (the executor gets an open
descriptor, never a path) and then *commits*: one line appended to the leg's commit file, in one
``write`` on an ``O_APPEND`` descriptor, with the result's size and SHA-256. That line is the only
proof that the rule ran to the end. The party records the run from the executor's reply; if the
party is killed in between, its recovery finds the line and adopts the result instead of running
the rule again, and without the line (the executor died mid-rule) the rule has not run yet and
runs. So a rule's completed runs per leg are at most one, and the commit file counts them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.rules.registry import REGISTRY, Table, validate_call


@dataclass(frozen=True)
class LegFiles:
    """One leg's files at its party: the result (written by the rule run), the commit file (one
    line per completed run) and the input, if the leg has one (read only)."""

    task_id: str
    data_id: str
    result: Path
    commit: Path
    input: Path | None = None

    def open_for_run(self) -> tuple[int, int, int | None]:
        """Descriptors for one run: the result truncated, the commit file for appending, the input."""
        result = os.open(self.result, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        commit = os.open(self.commit, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        source = os.open(self.input, os.O_RDONLY | os.O_CLOEXEC) if self.input is not None else None
        return result, commit, source


@dataclass(frozen=True)
class RuleReply:
    """An executor's answer: ``ok``/``error`` and, when ok, the result's ``size`` and ``sha256``
    (the bytes are in the leg's result file)."""

    ok: bool
    error: str = ""
    size: int = 0
    sha256: str = ""


SYNC_EVERY_BYTES = 64 << 20
"""A large result is written back every this many bytes: its pages turn clean, so the memory
cgroup of a sandboxed executor (which is charged for the page cache it dirties) can reclaim them
instead of killing the executor mid-result; one ``fdatasync`` per 64 MiB, not per chunk."""


class DigestWriter:
    """Writes a result to a descriptor, counting and hashing it on the way."""

    def __init__(self, fd: int, cap: int, sync_every: int = SYNC_EVERY_BYTES):
        self.fd, self.cap, self.size, self._sha = fd, cap, 0, hashlib.sha256()
        self._sync_every, self._synced = sync_every, 0

    def write(self, data: bytes | memoryview) -> None:
        if self.size + len(data) > self.cap:
            raise ResultTooLarge(f"result over the party's {self.cap}-byte cap (max_result_bytes)")
        self._sha.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(data)
        if self.size - self._synced >= self._sync_every:
            os.fdatasync(self.fd)
            self._synced = self.size

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


class ResultTooLarge(Exception):
    """A rule's result went past the party's cap; the run is refused, not committed."""


def run_rule(
    table: Table,
    call: RuleCall,
    allowed: list[str] | None,
    out: DigestWriter,
    source: BinaryIO | None,
) -> None:
    """Run a registered rule into ``out``: a dict rule's result as compact JSON, a stream rule's
    bytes as it makes them (reading its input from ``source`` a block at a time)."""
    params = validate_call(call, allowed)
    rule = REGISTRY[call.rule]
    if rule.stream is not None:
        if source is None:
            raise ValueError(f"rule {call.rule!r} needs an input and the leg has none")
        rule.stream(table, params, source, out.write)
        return
    assert rule.run is not None  # a registered rule either streams or returns JSON
    out.write(json.dumps(rule.run(table, params), separators=(",", ":")).encode())


def commit_line(task_id: str, data_id: str, size: int, sha256: str) -> bytes:
    """One completed run, as the executor appends it to the leg's commit file."""
    record = {"task_id": task_id, "data_id": data_id, "size": size, "sha256": sha256, "pid": os.getpid()}
    return (json.dumps({**record, "at": round(time.time(), 3)}, separators=(",", ":")) + "\n").encode()


def read_commits(path: Path) -> list[dict[str, Any]]:
    """The completed runs a commit file records (a torn last line, from a kill mid-write, is not one)."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return []
    runs = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and {"size", "sha256"} <= record.keys():
            runs.append(record)
    return runs


class Executor(Protocol):
    """What the party needs from a per-task isolated executor, whatever runs it."""

    address: str

    @property
    def alive(self) -> bool: ...

    async def call(self, call: RuleCall, files: LegFiles, timeout_s: float) -> RuleReply: ...

    def kill(self) -> None: ...


class ExecutorStartError(RuntimeError):
    """The executor could not be set up at all (its sandbox or cgroups refused); the message says why."""


class ExecutorDied(OSError):
    """The executor ended while serving a call; the message says why (e.g. its memory limit)."""
