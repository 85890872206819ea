"""The agent's exit journal: append-only JSON lines on disk, fsync'd before an exit is reported.

Three kinds of line: ``start`` (an instance is about to be spawned: written before the spawn,
so a restarted agent knows every instance that may still have processes), ``exit``
(its final :class:`InstanceStatus`, fsync'd before anyone is told) and ``forget`` (the
controller stored the exit; the record may go). Replaying the lines in order rebuilds the
agent's records; :meth:`ExitJournal.compact` rewrites the file with only what is still needed.
A torn last line (the agent killed mid-write) is skipped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmaster.contract import InstanceStatus

log = logging.getLogger(__name__)

COMPACT_EVERY = 4096  # lines appended since the last compaction


@dataclass
class JournaledInstance:
    """What the journal knows of one instance attempt."""

    instance_id: str
    started: dict[str, Any]  # the start line (spec summary, time)
    exit: InstanceStatus | None = None


class ExitJournal:
    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._appended = 0

    def replay(self) -> dict[str, JournaledInstance]:
        records: dict[str, JournaledInstance] = {}
        with open(self.path, "rb") as lines:
            for number, raw in enumerate(lines, 1):
                try:
                    line = json.loads(raw)
                except ValueError:
                    log.warning("journal %s line %d is torn; skipped", self.path, number)
                    continue
                kind = line["t"]
                if kind == "start":
                    records[line["id"]] = JournaledInstance(line["id"], line)
                elif kind == "exit" and line["id"] in records:
                    records[line["id"]].exit = InstanceStatus.from_dict(line["status"])
                elif kind == "forget":
                    for instance_id in line["ids"]:
                        records.pop(instance_id, None)
        return records

    def _append(self, lines: list[dict[str, Any]], sync: bool) -> None:
        self._file.write(b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines))
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())
        self._appended += len(lines)

    def started(self, starts: list[dict[str, Any]]) -> None:
        """Record instances about to be spawned: written to the kernel before the spawn, not
        fsync'd. The line guards against the agent's death, which the kernel's page cache
        survives; a machine crash, which it may not survive, ends the instances too."""
        self._append([{"t": "start", **s} for s in starts], sync=False)

    def exited(self, statuses: list[InstanceStatus]) -> None:
        """Record final statuses (one fsync for all); only then may they be reported."""
        self._append([{"t": "exit", "id": s.handle.instance_id, "status": s.to_dict()} for s in statuses], sync=True)

    def forgotten(self, instance_ids: list[str]) -> None:
        self._append([{"t": "forget", "ids": instance_ids}], sync=False)

    def needs_compaction(self) -> bool:
        return self._appended >= COMPACT_EVERY

    def compact(self, records: dict[str, JournaledInstance]) -> None:
        """Rewrite the journal with only ``records`` (atomically: temp file, fsync, rename)."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for record in records.values():
                out.write(json.dumps(record.started, separators=(",", ":")).encode() + b"\n")
                if record.exit is not None:
                    out.write(
                        json.dumps(
                            {"t": "exit", "id": record.instance_id, "status": record.exit.to_dict()},
                            separators=(",", ":"),
                        ).encode()
                        + b"\n"
                    )
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._file.close()
        self._file = open(self.path, "ab")
        self._appended = 0

    def close(self) -> None:
        self._file.close()
