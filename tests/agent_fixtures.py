"""Helpers for node agent tests: a replica command that detects a second live copy of itself,
and process scans by the agent's instance marker."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil


PY = sys.executable

# A replica that holds an exclusive flock on its own lock file for as long as it lives. A second
# copy of the same replica alive at the same time cannot take the lock and records itself in
# ``<lock>.double``; every start appends its pid to ``<lock>.starts``.
REPLICA = (
    "import fcntl, os, sys, time\n"
    "lock = sys.argv[1]\n"
    "f = open(lock, 'a+')\n"
    "try:\n"
    "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "except BlockingIOError:\n"
    "    open(lock + '.double', 'a').write(f'{os.getpid()}\\n')\n"
    "open(lock + '.starts', 'a').write(f'{os.getpid()}\\n')\n"
    "time.sleep(float(sys.argv[2]))\n"
)

# A command that leaves a setsid grandchild and a double-forked daemon behind, then sleeps.
ESCAPERS = (
    "import os, subprocess, sys, time\n"
    "subprocess.Popen(['setsid', sys.executable, '-c', 'import time; time.sleep(300)  # escaper'])\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)  # escaper'])\n"
    "    os._exit(0)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


def replica(lock: Path, seconds: float) -> list[str]:
    return [PY, "-c", REPLICA, str(lock), str(seconds)]


def doubles(folder: Path) -> list[str]:
    """Every replica lock that saw two live copies at once."""
    return sorted(p.name for p in folder.glob("*.double"))


def starts(lock: Path) -> int:
    path = Path(str(lock) + ".starts")
    return len(path.read_text().split()) if path.exists() else 0


def job_processes(home: Path) -> list[int]:
    """Live processes a node agent started for instances of the Trainmaster home ``home``: each
    carries the agent's markers (``TM_INSTANCE_ID``, and ``TM_AGENT_KEY`` naming the agent's state
    folder by a digest), and an instance's built environment nothing of the home itself."""
    import hashlib

    digests = {
        hashlib.sha256(str(journal.parent.resolve()).encode()).hexdigest()[:10]
        for journal in home.rglob("journal.jsonl")
    }
    found = []
    for proc in psutil.process_iter():
        try:
            environ = proc.environ()
            if (
                "TM_INSTANCE_ID" in environ
                and environ.get("TM_AGENT_KEY", "").rsplit("-", 1)[-1] in digests
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def shell_parent(lock: Path, seconds: float) -> list[str]:
    """``sh -c '<replica> & wait'``: the replica runs as the shell's child."""
    quoted = " ".join("'" + part.replace("'", "'\"'\"'") + "'" for part in replica(lock, seconds))
    return ["/bin/sh", "-c", f"{quoted} & wait"]


ESCAPER_CODE = "import time; time.sleep(300)  # escaper"


def escapers() -> list[int]:
    """Live setsid grandchildren and daemons that :data:`ESCAPERS` commands left."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and ESCAPER_CODE in (proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found
