"""The audit log every party and the gateway keep: who asked for what on whose data, and when.

One JSON line per event (a task created, a leg dispatched or run, a rule run, a transfer, a result
fetched, an input received, a restart's recovery), each with the time and the requester as the
service authenticated it: the sender's name and role, and the id and signature of the signed
message that asked (the signature is over that message, checkable by whoever keeps it). Lines are
only ever appended (``O_APPEND``, one ``write`` per line) and chained: each line holds the SHA-256
of the line before it (``prev``), its own ``hash`` over its canonical body and ``prev``, and the
service's Ed25519 signature over that hash. So

* an edited line no longer matches its hash (or, rehashed, its signature, which needs the key),
* a removed line leaves a gap in ``seq`` and breaks the next line's ``prev``,
* reordered lines break ``seq`` order and ``prev``,
* a cut-off tail is found against the head the service keeps beside the log (``<log>.head``,
  rewritten with each group commit) or a head taken earlier (``--head`` of ``audit verify``).

Durability: lines reach the page cache with each event (a ``kill -9`` loses none); the log and
its head are fsynced together at most every ``sync_s`` (a group commit, not one per line), so
a power loss can cut at most that much of the tail, and verification then says so. A service
that finds its log shorter than its head at start appends an ``audit.tail_missing`` line, so the
loss stays on record.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature

from trainmaster.gateway.crypto.envelope import Identity, PublicIdentity, b64d, b64e

GENESIS = "0" * 64
HEAD_SUFFIX = ".head"
_DOMAIN = b"trainmaster-gateway/v1/audit\x00"
_TAIL_READ = 1 << 16


def _canonical(entry: dict[str, Any]) -> bytes:
    body = {k: v for k, v in entry.items() if k not in ("hash", "sig")}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def entry_hash(entry: dict[str, Any]) -> str:
    """The line's hash: over its canonical body (``prev`` included, ``hash`` and ``sig`` not)."""
    return hashlib.sha256(_DOMAIN + _canonical(entry)).hexdigest()


@dataclass(frozen=True)
class Requester:
    """Who asked, as the service authenticated them: name and role, and their signed message."""

    name: str
    role: str
    msg_id: str = ""
    signature: str = ""

    def fields(self) -> dict[str, str]:
        out = {"requester": self.name, "role": self.role}
        if self.msg_id:
            out |= {"msg_id": self.msg_id, "msg_sig": self.signature}
        return out


SELF = Requester("", "self")
"""Events the service does of its own accord (a restart's recovery, an expiry)."""


class AuditLog:
    """Appends chained, signed lines to one file; safe to use from several threads."""

    def __init__(self, path: Path, me: Identity, sync_s: float = 1.0):
        self.path, self._me, self._sync_s = path, me, sync_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.seq, self.head = _last(path)
        self._dirty = False
        self._last_sync = time.monotonic()
        recorded = read_head(path)
        if recorded is not None and recorded[0] > self.seq:
            self.append(
                "audit.tail_missing",
                SELF,
                found_seq=self.seq,
                head_seq=recorded[0],
                detail="the log ends before the head recorded at its last group commit: lines were lost or removed",
            )
            self.sync()

    def append(self, event: str, requester: Requester, **fields: Any) -> dict[str, Any]:
        """Append one event (one line); returns it as written."""
        with self._lock:
            entry: dict[str, Any] = {
                "seq": self.seq + 1,
                "t": round(time.time(), 6),
                "service": self._me.name,
                "event": event,
                **requester.fields(),
                **fields,
                "prev": self.head,
            }
            digest = entry_hash(entry)
            entry["hash"] = digest
            entry["sig"] = b64e(self._me.sign_key.sign(bytes.fromhex(digest)))
            line = (json.dumps(entry, separators=(",", ":"), ensure_ascii=True) + "\n").encode()
            os.write(self._fd, line)  # one write with O_APPEND: a line is never interleaved or torn by a kill
            self.seq, self.head, self._dirty = entry["seq"], digest, True
            if time.monotonic() - self._last_sync >= self._sync_s:
                self._sync_locked()
            return entry

    def sync(self) -> None:
        """Group commit: fsync the log, then record its head beside it."""
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        self._last_sync = time.monotonic()
        if not self._dirty:
            return
        os.fsync(self._fd)
        head = self.path.with_name(self.path.name + HEAD_SUFFIX)
        part = head.with_name(head.name + ".part")
        part.write_text(json.dumps({"seq": self.seq, "hash": self.head}))
        fd = os.open(part, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, head)
        self._dirty = False

    def close(self) -> None:
        self.sync()
        os.close(self._fd)


def _last(path: Path) -> tuple[int, str]:
    """The seq and hash of the log's last whole line (0 and the genesis hash for an empty log)."""
    with path.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - _TAIL_READ))
        lines = [line for line in fh.read().split(b"\n") if line.strip()]
    for line in reversed(lines):
        try:
            entry = json.loads(line)
            return int(entry["seq"]), str(entry["hash"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0, GENESIS


def read_head(path: Path) -> tuple[int, str] | None:
    """The head recorded at the log's last group commit, if any."""
    try:
        head = json.loads(path.with_name(path.name + HEAD_SUFFIX).read_text())
        return int(head["seq"]), str(head["hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class Verdict:
    """What ``verify`` found: the lines checked, the head reached, and every problem, by line."""

    lines: int = 0
    seq: int = 0
    head: str = GENESIS
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: Path, signer: PublicIdentity | None = None, head: tuple[int, str] | None = None) -> Verdict:
    """Check every line of an audit log: parse, hash, chain (``prev``), ``seq`` order and
    continuity, the signature (with ``signer``'s key, when given), and that the log reaches
    ``head`` (default: the head recorded beside it). Reports each problem by line number."""
    verdict = Verdict()
    expect_seq, prev = 1, GENESIS
    anchor = head if head is not None else read_head(path)
    anchored = False
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            verdict.lines += 1
            try:
                entry = json.loads(raw)
                seq, stored, sig = int(entry["seq"]), str(entry["hash"]), str(entry["sig"])
            except (ValueError, KeyError, TypeError):
                verdict.problems.append(f"line {number}: not an audit entry (damaged or edited)")
                expect_seq += 1
                continue
            if entry_hash(entry) != stored:
                verdict.problems.append(f"line {number} (seq {seq}): content does not match its hash (edited)")
            elif signer is not None:
                try:
                    signer.sign_pub.verify(b64d(sig), bytes.fromhex(stored))
                except (InvalidSignature, ValueError):
                    verdict.problems.append(f"line {number} (seq {seq}): signature is not {signer.name!r}'s (forged)")
            if seq < expect_seq:
                verdict.problems.append(
                    f"line {number}: seq {seq} comes after seq {expect_seq - 1} (reordered or repeated)"
                )
            elif seq > expect_seq:
                verdict.problems.append(
                    f"line {number}: seq {seq} follows seq {expect_seq - 1}: "
                    f"{seq - expect_seq} line(s) removed before it"
                )
            if entry.get("prev") != prev:
                verdict.problems.append(f"line {number} (seq {seq}): does not chain to the line before it")
            if entry.get("event") == "audit.tail_missing":
                verdict.problems.append(
                    f"line {number} (seq {seq}): the service found lines {entry.get('found_seq', 0) + 1}-"
                    f"{entry.get('head_seq')} missing at a restart"
                )
            if anchor is not None and seq == anchor[0]:
                anchored = True
                if stored != anchor[1]:
                    verdict.problems.append(f"line {number} (seq {seq}): not the line the head names (replaced)")
            expect_seq, prev = seq + 1, stored
            verdict.seq, verdict.head = seq, stored
    if anchor is not None and not anchored and anchor[0] > 0:
        verdict.problems.append(
            f"the log ends at seq {verdict.seq}; its head says seq {anchor[0]}: lines removed from the end"
        )
    return verdict


def read_entries(path: Path, after: int = 0, limit: int = 200, task_id: str | None = None) -> list[dict[str, Any]]:
    """Entries with ``seq`` above ``after`` (optionally of one task), oldest first, at most ``limit``."""
    out: list[dict[str, Any]] = []
    with path.open("rb") as fh:
        for raw in fh:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(entry, dict) or int(entry.get("seq", 0)) <= after:
                continue
            if task_id is not None and entry.get("task_id") != task_id:
                continue
            out.append(entry)
            if len(out) >= limit:
                break
    return out


def page(
    path: Path,
    signer: PublicIdentity,
    after: int = 0,
    limit: int = 200,
    task_id: str | None = None,
    check: bool = False,
) -> dict[str, Any]:
    """What ``GET /v1/audit`` answers the operator: entries after ``after`` (of one task, if asked)
    and, with ``check``, the verdict of :func:`verify` over the whole log."""
    out: dict[str, Any] = {
        "service": signer.name,
        "entries": read_entries(path, after, limit, task_id),
        "head": dict(zip(("seq", "hash"), _last(path))),
    }
    if check:
        verdict = verify(path, signer)
        out["verify"] = {"ok": verdict.ok, "lines": verdict.lines, "problems": verdict.problems[:50]}
    return out
