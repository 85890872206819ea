"""Where the CPU of one drain of 1,000 ``true`` jobs goes, on the whole machine.

``bench/scale.py --only drain`` gives the drain's rate and the controller's own CPU. This
diagnostic adds the rest of the machine over the same drain: the controller's process (every
thread), the node agent's process (every thread) and the ``true`` children it reaped (its
``cutime``/``cstime``), the kernel's threads by kind (kworker, jbd2, ksoftirqd, ...), everything
else (other users' processes), and from ``/proc/stat`` how much of the drain's wall time the
cores were busy, idle or waiting for the disk. Busy cores say the drain is bound by CPU (then the
largest consumer is the lever); idle ones say it waits (on the agent, the store or the disk).

Thread CPU comes from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds); the reaped children's
from their parent's ``cutime``/``cstime`` (clock ticks). Run it from the tree whose code you
measure (``python -m`` and the agent's own start put the current folder first)::

    .venv/bin/python bench/drain_account.py --runs 3

Who ran when, and what the drain waited for while every core was idle (the scheduler's
switches, with kernel stacks, recorded by ``perf`` on the drain's clock)::

    perf record -g -k CLOCK_MONOTONIC -e sched:sched_switch -a -o /tmp/drain.perf -- \\
        .venv/bin/python bench/drain_account.py --json /tmp/drain.json
    .venv/bin/python bench/drain_account.py --json /tmp/drain.json --timeline /tmp/drain.perf
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

TICK = os.sysconf("SC_CLK_TCK")
KTHREADD = 2
#: the keys of an account that add up to the machine's busy time (the rest are their parts)
TOTALS = (
    "controller process",
    "agent process",
    "kernel threads",
    "other processes",
    "true children (reaped by the agent)",
)


def _cpu_line() -> list[int]:
    """The ``cpu`` line of ``/proc/stat``: user nice system idle iowait irq softirq steal (ticks)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:9]]


def _stat(path: str) -> tuple[str, list[str]] | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    return comm, text[text.rindex(")") + 2 :].split()


def _run_ns(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def snapshot() -> dict[str, Any]:
    """Every thread's CPU (ns), its process, name and parent; every process's reaped children's
    CPU (ticks); the machine's ``cpu`` line."""
    threads: dict[int, tuple[int, str, int, int]] = {}  # tid -> (pid, comm, ppid, ns)
    children: dict[int, int] = {}  # pid -> cutime + cstime (ticks)
    own: dict[int, tuple[int, int]] = {}  # pid -> utime, stime (ticks; its ended threads included)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        top = _stat(f"/proc/{pid}/stat")
        if top is None:
            continue
        ppid = int(top[1][1])
        children[pid] = int(top[1][13]) + int(top[1][14])
        own[pid] = (int(top[1][11]), int(top[1][12]))
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            st = _stat(f"/proc/{pid}/task/{tid}/stat")
            if st is None:
                continue
            threads[int(tid)] = (pid, st[0], ppid, _run_ns(f"/proc/{pid}/task/{tid}/schedstat"))
    return {"threads": threads, "children": children, "own": own, "cpu": _cpu_line(), "at": time.perf_counter()}


def _kind(comm: str) -> str:
    """A kernel thread's kind: its name up to the first ``/`` or digit-suffix (kworker/1:2H -> kworker)."""
    return re.split(r"[/:]", comm)[0].rstrip("0123456789-") or comm


def account(before: dict[str, Any], after: dict[str, Any], controller: int, agent: int) -> dict[str, Any]:
    """Milliseconds of CPU per consumer between two snapshots, and the cores' busy share."""
    wall = after["at"] - before["at"]
    ms: dict[str, float] = {}
    others: dict[str, float] = {}  # other processes' threads by name: who shares the machine

    def add(key: str, value: float) -> None:
        ms[key] = ms.get(key, 0.0) + value

    for tid, (pid, comm, ppid, ns) in after["threads"].items():
        old = before["threads"].get(tid)
        delta = (ns - old[3]) if old and old[0] == pid else ns
        if delta <= 0:
            continue
        if pid == controller:
            add("controller process", delta / 1e6)
        elif pid == agent:
            add("agent process", delta / 1e6)
        elif pid == KTHREADD or ppid == KTHREADD:
            add("kernel threads", delta / 1e6)
            add(f"kernel {_kind(comm)}", delta / 1e6)
        else:
            add("other processes", delta / 1e6)
            others[comm] = others.get(comm, 0.0) + delta / 1e6
    for name, pid in (("controller", controller), ("agent", agent)):
        for i, mode in enumerate(("user", "system")):
            was = before["own"].get(pid, (0, 0))[i]
            ms[f"{name} {mode} (ticks, ended threads too)"] = 1000 * (after["own"].get(pid, (0, 0))[i] - was) / TICK
    reaped = after["children"].get(agent, 0) - before["children"].get(agent, 0)
    ms["true children (reaped by the agent)"] = 1000 * reaped / TICK
    cpu = [a - b for a, b in zip(after["cpu"], before["cpu"])]
    total = sum(cpu) or 1
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    machine = {name: 100 * v / total for name, v in zip(names, cpu)}
    return {
        "wall_s": wall,
        "cores": os.cpu_count(),
        "machine_pct": machine,
        "busy_pct": 100 - machine["idle"] - machine["iowait"],
        "machine_busy_ms": 1000 * (total - cpu[3] - cpu[4]) / TICK,
        "ms": dict(sorted(ms.items(), key=lambda kv: -kv[1])),
        "unattributed_ms": 1000 * (total - cpu[3] - cpu[4]) / TICK - sum(v for k, v in ms.items() if k in TOTALS),
        "others_ms": dict(sorted(others.items(), key=lambda kv: -kv[1])[:6]),
    }


def drain(count: int, slots: int, scratch: Path) -> dict[str, Any]:
    """``bench/scale.py``'s drain, with a snapshot just before the drain and just after it (the
    agent still up, so its threads are counted)."""
    from controller_timing import Ours
    from sqlalchemy import select

    from trainmaster.backends.base import Resources
    from trainmaster.backends.local import LocalBackend
    from trainmaster.store import repository as repo
    from trainmaster.store.models import JobRow

    workdir = Path(tempfile.mkdtemp(dir=scratch))
    backend = LocalBackend(Resources(cpu=float(slots), memory=0), state_dir=workdir / "agent")
    ours = Ours(backend, workdir)
    left = select(JobRow.id).where(JobRow.state.in_(repo.ACTIVE_STATES), JobRow.owner == ours.controller.owner)
    for n in range(count):
        ours.submit(f"t{n}", [{"name": "task", "command": ["true"], "resources": {"cpu": 1}}])
    me = os.getpid()
    passes = 0
    with ours.sessions() as session:
        before = snapshot()
        began = time.monotonic()
        cpu = time.thread_time()
        while True:
            ours.controller.step()
            passes += 1
            if session.scalar(left.limit(1)) is None:
                break
            ours.controller.wait_for_work(0.05)  # as Ours.until (INTERVAL)
        ended = time.monotonic()
        after = snapshot()
        cpu = time.thread_time() - cpu
    # the agent: the child of ours that serves this run's state folder (an earlier run's may linger)
    agents = [
        tid
        for tid, (pid, _, ppid, _) in after["threads"].items()
        if ppid == me and tid == pid and str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    backend.close()
    shutil.rmtree(workdir, ignore_errors=True)
    result = account(before, after, me, agents[0] if agents else -1)
    result["wall_s"] = ended - began  # the drain alone (not the snapshots' own scan of /proc)
    result.update(
        jobs=count,
        passes=passes,
        jobs_per_s=count / result["wall_s"],
        controller_main_thread_ms=1000 * cpu,
        # CLOCK_MONOTONIC: matches `perf record -k CLOCK_MONOTONIC` timestamps (who ran when)
        monotonic=[began, ended],
        pids={"controller": me, "agent": agents[0] if agents else -1},
    )
    return result


# ---- who ran when (from `perf record -g -k CLOCK_MONOTONIC -e sched:sched_switch -a`) --------------
_SWITCH = re.compile(r"^(\S.*?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(.*)$")
_WAITING = {"__schedule", "schedule", "schedule_timeout", "schedule_hrtimeout_range_clock", "__traceiter_sched_switch"}


def timeline(perf_data: Path, run: dict[str, Any]) -> None:
    """Prints, over the run's drain, how long each kind of task ran (its share of the wall time,
    summed over the cores), the cores' joint states (controller beside agent, both idle, ...),
    and for each stretch with every core idle the kernel stack of the controller's or agent's
    thread that went to sleep last before it (what the drain was waiting for)."""
    text = subprocess.run(
        ["perf", "script", "-i", str(perf_data), "-F", "comm,cpu,pid,tid,time,trace,ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    t0, t1 = run["monotonic"]
    controller, agent = run["pids"]["controller"], run["pids"]["agent"]
    events: list[tuple[float, int, int, int, str, str, list[str]]] = []  # time cpu pid next next_comm state stack
    tgid: dict[int, int] = {}
    for line in text.splitlines():
        m = _SWITCH.match(line)
        if m:
            _, pid, tid, cpu, at, rest = m.groups()
            tgid[int(tid)] = int(pid)
            nxt = re.search(r"next_comm=(.*?) next_pid=(\d+)", rest)
            state = re.search(r"prev_state=(\S+)", rest)
            if nxt:
                events.append(
                    (
                        float(at),
                        int(cpu),
                        int(pid),
                        int(nxt.group(2)),
                        nxt.group(1),
                        state.group(1) if state else "?",
                        [],
                    )
                )
        elif events and line.strip():
            events[-1][6].append(line.split()[1].split("+")[0] if len(line.split()) > 1 else "?")
    events.sort(key=lambda e: e[0])
    cores = sorted({e[1] for e in events})

    def kind(tid: int, comm: str) -> str:
        group = tgid.get(tid, tid)
        if tid == 0:
            return "idle"
        if group in (controller, agent):
            return "controller" if group == controller else "agent"
        if comm == "true":
            return "true"
        if re.match(r"(kworker|jbd2|ksoftirqd|rcu|kdamond|migration)", comm):
            return "kernel"
        return "other"  # other users', and our children before their exec (named as their parent)

    running: dict[int, str] = {}
    alone: dict[str, float] = {}
    joint: dict[tuple[str, ...], float] = {}
    idle_for: dict[str, float] = {}
    last, slept, idle_since = t0, "", None
    for at, cpu, pid, nxt, comm, state, stack in events:
        if at > t1:
            break
        if at > t0 and len(running) == len(cores):
            span = at - max(last, t0)
            key = tuple(sorted(running.values()))
            joint[key] = joint.get(key, 0.0) + span
            for k in key:
                alone[k] = alone.get(k, 0.0) + span
        last = at
        if pid in (controller, agent) and nxt == 0:  # ours went to sleep and the core idles
            frames = [f for f in stack if f not in _WAITING][:5]
            slept = f"{'controller' if pid == controller else 'agent'} {state} " + " < ".join(frames)
        running[cpu] = kind(nxt, comm)
        everyone_idle = all(running.get(c) == "idle" for c in cores)
        if everyone_idle and idle_since is None:
            idle_since, cause = at, slept
        elif not everyone_idle and idle_since is not None:
            if at > t0:
                idle_for[cause] = idle_for.get(cause, 0.0) + at - max(idle_since, t0)
            idle_since = None
    wall = t1 - t0
    print(f"who ran, {wall:.2f} s of drain on {len(cores)} cores (share of the wall time):")
    for k, v in sorted(alone.items(), key=lambda kv: -kv[1]):
        print(f"    {100 * v / wall:5.1f}%  {k}")
    print("the cores together:")
    for key, v in sorted(joint.items(), key=lambda kv: -kv[1])[:10]:
        print(f"    {100 * v / wall:5.1f}%  {' + '.join(key)}")
    print(f"every core idle {sum(idle_for.values()) * 1000:.0f} ms; what ours waited in, last before it:")
    for cause, v in sorted(idle_for.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {v * 1000:6.1f} ms  {cause}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write the accounts here")
    parser.add_argument(
        "--timeline",
        type=Path,
        metavar="PERF_DATA",
        help="no drain: read --json's first run and this perf recording of it (see the module's docstring)",
    )
    args = parser.parse_args()
    if args.timeline:
        timeline(args.timeline, json.loads(args.json.read_text())[0])
        return
    scratch = Path(tempfile.mkdtemp(prefix="tm-account-"))
    runs = []
    try:
        for _ in range(args.runs):
            r = drain(args.jobs, 32, scratch)
            runs.append(r)
            print(
                f"{r['jobs_per_s']:.0f} jobs/s, {r['wall_s']:.2f} s, {r['passes']} passes, "
                f"cores busy {r['busy_pct']:.0f}% (iowait {r['machine_pct']['iowait']:.0f}%, "
                f"softirq {r['machine_pct']['softirq']:.0f}%), machine busy {r['machine_busy_ms'] / r['jobs']:.2f} ms/job"
            )
            for key, value in r["ms"].items():
                if value / r["jobs"] >= 0.01:
                    print(f"    {value / r['jobs']:6.2f} ms/job  {key}")
            print(
                f"    {r['unattributed_ms'] / r['jobs']:6.2f} ms/job  unattributed (threads that ended during the drain, irq)"
            )
            print("    others: " + ", ".join(f"{k} {v / r['jobs']:.2f}" for k, v in r["others_ms"].items()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
