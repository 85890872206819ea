"""The first process of a host-runtime pod: ``python -m trainmaster.backends.kubernetes_entry
CWD RECORD ENVFILE -- ARGV...``.

It does in the pod what the node agent does for a local instance: with an ``ENVFILE`` (an
instance with dependencies), wait for it (the backend writes it once the dependencies hold:
the instance's whole environment, resolved with their addresses, or why it gives up: the wait
step, in the pod, so the pod already has its address while it waits); enter the working directory
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
import time

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


POD_IP = "$(TM_POD_IP)"
WAIT_STEP_EXIT = 124


def _wait_for_environment(path: str) -> dict[str, str] | str:
    """The environment the backend wrote, or the message of why the wait step gave up."""
    print("[trainmaster] waiting for the roles this instance depends on", flush=True)
    delay = 0.02
    while not os.path.exists(path):
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    with open(path) as f:
        content = json.load(f)
    if "env" not in content:
        return f"{content.get('reason', 'DependencyTimeout')}: {content.get('message', '')}"
    ip = os.environ.get("TM_POD_IP", "")
    env = {k: str(v).replace(POD_IP, ip) for k, v in content["env"].items()}
    env["TM_POD_IP"] = ip
    return env


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print(
            "usage: python -m trainmaster.backends.kubernetes_entry CWD RECORD ENVFILE -- COMMAND...", file=sys.stderr
        )
        return 2
    cwd, record, env_file, command = argv[0], argv[1], argv[2], argv[4:]
    program = command[0]
    env = None
    if env_file:
        found = _wait_for_environment(env_file)
        if isinstance(found, str):
            print(f"[trainmaster] {found}", flush=True)
            reason, _, message = found.partition(": ")
            _finish({"reason": reason, "message": message})
            return WAIT_STEP_EXIT
        env = found
    try:
        if cwd:
            os.chdir(cwd)
        child = subprocess.Popen(command, env=env)
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
