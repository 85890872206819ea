"""The cluster's daemons as processes: started detached with their log, recorded by pid and start
time (a pid alone may be reused), stopped by that record only: never by name, never broadly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DaemonRecord:
    """One started daemon: its pid and the kernel's start time of that pid (``/proc/PID/stat``
    field 22), so a later ``down`` never signals a stranger that got the pid."""

    name: str
    pid: int
    start_time: int
    log: str


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (PID 1 here reaps lazily: a SIGKILLed
    daemon stays a zombie for seconds and ``kill -0`` still succeeds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def is_running(record: DaemonRecord) -> bool:
    return alive(record.pid) and start_time(record.pid) == record.start_time


class Daemons:
    """The pid records of one cluster (``<folder>/pids/<name>.json``)."""

    def __init__(self, folder: Path):
        self.folder = folder / "pids"
        self.logs = folder / "logs"

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> DaemonRecord:
        """Start ``argv`` detached (its own session, stdin from /dev/null, output to its log)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        record = DaemonRecord(name, proc.pid, start_time(proc.pid) or 0, str(log))
        (self.folder / f"{name}.json").write_text(json.dumps(record.__dict__))
        # the Popen object is dropped: the daemon outlives this process; reaping is PID 1's
        proc.returncode = 0  # keep Popen.__del__ from warning about a running child
        return record

    def get(self, name: str) -> DaemonRecord | None:
        try:
            return DaemonRecord(**json.loads((self.folder / f"{name}.json").read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def records(self) -> list[DaemonRecord]:
        found = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            record = self.get(path.stem)
            if record is not None:
                found.append(record)
        return found

    def stop(self, names: list[str], grace: float = 5.0) -> None:
        """SIGTERM each named daemon that still runs, SIGKILL after ``grace``; forget them."""
        records = [r for r in (self.get(n) for n in names) if r is not None]
        signal_and_wait([r.pid for r in records if is_running(r)], grace)
        for record in records:
            (self.folder / f"{record.name}.json").unlink(missing_ok=True)


def signal_and_wait(pids: list[int], grace: float) -> None:
    """SIGTERM ``pids``, wait up to ``grace`` s, SIGKILL what is left, wait up to 10 s more."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        left = [p for p in pids if alive(p)]
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if alive(p)]
        if not left:
            return


def pids_with_argument(argument: str) -> list[int]:
    """Processes whose command line holds ``argument`` exactly (a containerd's socket path,
    unique to one node of one cluster: its shims carry it as ``-address``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if argument.encode() in args:
            found.append(int(entry))
    return [p for p in found if p != os.getpid()]
