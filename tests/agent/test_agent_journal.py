"""Mechanism: the node agent's durable exit journal (issue #14 part 1): append-only JSON lines,
replayed in order after a restart (a torn last line from a kill mid-write is skipped), forgotten
records dropped, and compaction keeping exactly what a restarted agent needs."""

from __future__ import annotations

from pathlib import Path

from trainmaster.contract import InstanceHandle, InstancePhase, InstanceStatus
from trainmaster.agent.journal import ExitJournal


def _exit(instance_id: str, code: int) -> InstanceStatus:
    return InstanceStatus(
        InstanceHandle("local", instance_id, 42),
        InstancePhase.EXITED,
        exit_code=code,
        reason="Error",
        message=f"exited with code {code}",
        cpu_seconds=0.5,
        peak_rss=1 << 20,
    )


def test_replay_rebuilds_starts_exits_and_forgets_and_skips_a_torn_line(tmp_path: Path) -> None:
    journal = ExitJournal(tmp_path / "journal.jsonl")
    journal.started(
        [{"id": "a", "role": "w", "at": 1.0}, {"id": "b", "role": "w", "at": 1.0}, {"id": "c", "role": "w", "at": 1.0}]
    )
    journal.exited([_exit("a", 3)])
    journal.exited([_exit("b", 0)])
    journal.forgotten(["b"])
    journal.close()
    with open(tmp_path / "journal.jsonl", "ab") as torn:  # the agent killed mid-append
        torn.write(b'{"t": "exit", "id": "c", "sta')
    records = ExitJournal(tmp_path / "journal.jsonl").replay()
    assert sorted(records) == ["a", "c"]
    assert records["a"].exit == _exit("a", 3)  # every field survives the round trip
    assert records["c"].exit is None  # started, never ended: a restarted agent kills it


def test_compaction_keeps_only_live_and_unforgotten_records(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = ExitJournal(path)
    for n in range(50):
        journal.started([{"id": f"i{n}", "role": "w", "at": 1.0}])
        journal.exited([_exit(f"i{n}", n)])
    journal.forgotten([f"i{n}" for n in range(48)])
    before = path.stat().st_size
    journal.compact(journal.replay())
    assert path.stat().st_size < before / 10
    journal.started([{"id": "after", "role": "w", "at": 2.0}])  # appends after compaction still land
    records = ExitJournal(path).replay()
    assert sorted(records) == ["after", "i48", "i49"] and records["i49"].exit == _exit("i49", 49)
