"""The first process of a host-runtime pod: ``python -m trainmaster.backends.kubernetes_entry
CWD RECORD -- ARGV...``.

It does in the pod what the node agent does for a local instance: enter the working directory
(a missing one is a refused start, not a folder quietly created as a container runtime would),
start the role's command, forward the kubelet's SIGTERM to it, wait for it, and leave the
outcome in the container's termination message (one JSON object: ``reason``/``message`` for a
refused start, the tree's CPU seconds and peak memory from the container's cgroup), which the
backend reads from the pod's status. ``RECORD`` receives ``{"pid": ...}``: with the machine's
PID namespace shared, that is the command's pid on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

TERMINATION_LOG = "/dev/termination-log"
CGROUP = "/sys/fs/cgroup"


def _cgroup_value(hierarchy: str, knob: str) -> int:
    """A counter of this container's cgroup (the runtime mounts the container's own groups at
    the hierarchies' roots); 0 where unreadable."""
    try:
        with open(os.path.join(CGROUP, hierarchy, knob)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _finish(details: dict[str, object]) -> None:
    try:
        with open(TERMINATION_LOG, "w") as f:
            f.write(json.dumps(details))
    except OSError:
        pass


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--" or len(argv) < 4:
        print("usage: python -m trainmaster.backends.kubernetes_entry CWD RECORD -- COMMAND...", file=sys.stderr)
        return 2
    cwd, record, command = argv[0], argv[1], argv[3:]
    program = command[0]
    try:
        if cwd:
            os.chdir(cwd)
        child = subprocess.Popen(command)
    except OSError as exc:
        where = f"working directory '{cwd}'" if exc.filename == cwd and cwd else "exec"
        message = (
            f"program '{program}' not found ({exc.strerror})"
            if isinstance(exc, FileNotFoundError) and where == "exec"
            else f"program '{program}' could not start: {where}: {exc.strerror or exc}"
        )
        print(f"[trainmaster] {message}", flush=True)
        _finish({"reason": "StartFailed", "message": message})
        return 127
    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(record, "w") as f:
            json.dump({"pid": child.pid}, f)
    except OSError:
        pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    code = child.wait()
    usage = os.times()
    cpu = _cgroup_value("cpuacct", "cpuacct.usage") / 1e9 or (usage.children_user + usage.children_system)
    _finish({"cpu_seconds": cpu, "peak_rss": _cgroup_value("memory", "memory.max_usage_in_bytes")})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
