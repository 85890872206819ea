"""Executor isolation ("Isolation that deserves the word", issue 15): real bubblewrap sandboxes.

The probes run Python code inside the very sandbox the party builds for an executor (same
:class:`Sandbox` launcher, same namespaces, mounts, uid, seccomp filter and cgroups), standing in
for an executor an attacker has taken over. Every test checks afterwards that it left no cgroup, no
process, no task folder and no mount behind, also when it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from helpers import wait_until

from trainmaster.gateway.executors.base import LegFiles
from trainmaster.gateway.executors.sandbox import bubblewrap as sbx
from trainmaster.gateway.initiator.taskfile import LegSpec
from trainmaster.gateway.executors.process import ExecutorHandle
from trainmaster.gateway.localdeploy import Deployment, breast_cancer_split, write_csv
from trainmaster.gateway.models import RuleCall
from trainmaster.gateway.crypto.provision import init_deployment
from trainmaster.gateway.executors.sandbox.seccomp import DENIED_X86_64, deny_list_program

REASON = sbx.unavailable_reason()
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(REASON is not None, reason=f"executor sandbox unavailable here: {REASON}"),
]
PROBE_TIMEOUT_S = 60.0


@dataclass
class ProbeResult:
    returncode: int
    out: dict
    stderr: str
    exit: sbx.SandboxExit
    described: str


class Tracker:
    """Every sandbox a test starts, so the fixture can prove each one is gone afterwards."""

    def __init__(self) -> None:
        self.started: list[sbx.Sandbox] = []
        self.handles: list[ExecutorHandle] = []


def _mounts() -> set[str]:
    """Host mounts a sandbox could leak: under the temp directory (task folders) or with bwrap's names.

    (Other tests on the host add and remove network-namespace mounts meanwhile; those are not ours.)
    """
    tmp = os.path.realpath(tempfile.gettempdir())
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return {p for p in points if p.startswith(tmp) or "bwrap" in p or "newroot" in p or p.startswith("/task")}


@pytest.fixture
def tracker() -> Iterator[Tracker]:
    """Kill whatever a test started, then check nothing it made survives (cgroups, processes, folders, mounts)."""
    before = _mounts()
    t = Tracker()
    try:
        yield t
    finally:
        for h in t.handles:
            h.kill()
        for s in t.started:
            s.kill()
        for s in [*t.started, *(h.sandbox for h in t.handles if h.sandbox)]:
            assert not s.cgroups.paths, f"cgroups left behind: {s.cgroups.paths}"
            assert not [d for d in sbx.group_dirs(s.cgroups.name) if d.exists()]
            assert not s.home.exists(), f"sandbox folder left behind: {s.home}"
            assert not s.cgroups.pids()
            if s.proc.returncode is None:  # SIGKILLed above; reap it here if its event loop is gone
                try:
                    os.waitpid(s.proc.pid, 0)
                except ChildProcessError:
                    pass  # already reaped by asyncio's child watcher
        assert _mounts() == before, "the host's mount table changed"


def _probe(tmp_path: Path, tracker: Tracker, code: str, limits: sbx.SandboxLimits | None = None) -> ProbeResult:
    """Run ``code`` in a fresh executor sandbox; it prints one JSON object as its last line."""
    return asyncio.run(_aprobe(tmp_path, tracker, code, limits))


async def _aprobe(tmp_path: Path, tracker: Tracker, code: str, limits: sbx.SandboxLimits | None = None) -> ProbeResult:
    home = Path(os.path.realpath(tmp_path)) / f"test-{os.getpid()}-{len(tracker.started)}-{os.urandom(3).hex()}"
    home.mkdir()
    box = await sbx.Sandbox.start(
        [sbx.sandbox_python(), "-s", "-B", "-P", "-c", textwrap.dedent(code)],
        home=home,
        limits=limits or sbx.SandboxLimits(memory_mb=256),
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(sbx.package_parent())},
        stderr=asyncio.subprocess.PIPE,
    )
    tracker.started.append(box)
    stdout, stderr = await asyncio.wait_for(box.proc.communicate(), PROBE_TIMEOUT_S)
    lines = stdout.decode().strip().splitlines()
    out = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return ProbeResult(box.proc.returncode or 0, out, stderr.decode(), box.exit_status(), box.describe_exit())


def test_executor_cannot_read_the_partys_keys(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox mount namespace + uid drop: the party's key files exist on the host but not inside,
    and the executor runs as uid/gid 65534 with no capabilities, no_new_privs and a seccomp filter."""
    configs = init_deployment(tmp_path / "deploy", ["a"], port_base=20000)
    party_dir = configs["a"].parent
    keys = [str(party_dir / n) for n in ("sign.key", "enc.key", "tls.key")] + [str(configs["a"])]
    assert all(Path(k).is_file() for k in keys)
    r = _probe(
        tmp_path,
        tracker,
        f"""
        import json, os
        seen = {{}}
        for k in {keys!r}:
            try:
                open(k, "rb").read(); seen[k] = "read"
            except OSError as e:
                seen[k] = type(e).__name__
        status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
        print(json.dumps({{"seen": seen, "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
                           "capeff": status["CapEff"].strip(), "nnp": status["NoNewPrivs"].strip(),
                           "seccomp": status["Seccomp"].strip(), "root": sorted(os.listdir("/")),
                           "root_writable": os.access("/", os.W_OK)}}))
    """,
    )
    assert r.returncode == 0, r.stderr
    assert set(r.out["seen"].values()) == {"FileNotFoundError"}, r.out["seen"]
    assert (r.out["uid"], r.out["gid"], r.out["groups"]) == (65534, 65534, [])
    assert r.out["capeff"] == "0000000000000000" and r.out["nnp"] == "1" and r.out["seccomp"] == "2"
    links = {n for n in ("bin", "sbin", "lib", "lib32", "lib64", "libx32") if os.path.lexists(f"/{n}")}
    python_tops = {Path(root).parts[1] for root in sbx._python_roots()}
    assert (
        set(r.out["root"]) == {"dev", "proc", "task", "tmp", "usr"} | links | python_tops
    )  # no /etc, /home, /work/...
    assert not r.out["root_writable"]


def test_executor_cannot_reach_the_network(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox net namespace: a loopback server the host reaches is unreachable from inside."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the control: the server is there
        r = _probe(
            tmp_path,
            tracker,
            f"""
            import json, socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=5).close(); err = ""
            except OSError as e:
                err = type(e).__name__ + ": " + str(e)
            print(json.dumps({{"err": err, "ifaces": [n for _, n in socket.if_nameindex()]}}))
        """,
        )
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    assert r.out["err"], "the sandbox reached a host loopback server"
    assert r.out["ifaces"] == ["lo"]


def test_executor_cannot_see_other_tasks(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox pid and mount namespaces: another task's executor process and folder are invisible."""
    data = tmp_path / "d.csv"
    data.write_text("x\n1\n2\n")

    async def run() -> tuple[ExecutorHandle, ProbeResult]:
        other = await ExecutorHandle.start(data, deadline_s=60, start_timeout_s=30, memory_mb=256, isolation="sandbox")
        tracker.handles.append(other)
        try:
            assert other.sandbox.cgroups.pids() and Path(other._workdir).is_dir()
            return other, await _aprobe(tmp_path, tracker, SEE_OTHERS_PROBE.format(other_dir=other._workdir))
        finally:
            other.kill()
            await asyncio.wait_for(other.proc.wait(), 10)

    other, r = asyncio.run(run())
    assert r.returncode == 0, r.stderr
    assert not any("trainmaster.gateway.executors.worker" in c for c in r.out["cmdlines"]), r.out["cmdlines"]
    assert len(r.out["pids"]) <= 2 and max(r.out["pids"]) < 10, r.out  # bwrap's init and the probe itself
    # /tmp is the sandbox's own: empty but for the path to a Python installed under /tmp (a CI clone)
    python_under_tmp = {root.parts[2] for root in sbx._python_roots() if root.parts[:2] == ("/", "tmp")}
    assert not r.out["other_dir"] and set(r.out["tmp"]) <= python_under_tmp and r.out["task"] == []


SEE_OTHERS_PROBE = """
import json, os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
cmdlines = [open(f"/proc/{{p}}/cmdline", "rb").read().replace(b"\\0", b" ").decode() for p in pids]
print(json.dumps({{"pids": pids, "cmdlines": cmdlines, "other_dir": os.path.exists({other_dir!r}),
                   "tmp": os.listdir("/tmp"), "task": os.listdir("/task")}}))
"""


def test_executor_cannot_exceed_its_memory(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox cgroup memory limit: allocating past it gets the process killed, and the exit says so."""
    r = _probe(
        tmp_path,
        tracker,
        """
        import json
        hog = b"x" * (512 << 20)
        print(json.dumps({"survived": len(hog)}))
    """,
        limits=sbx.SandboxLimits(memory_mb=96),
    )
    assert r.out == {}, "allocated 512 MB under a 96 MB limit"
    assert r.exit.memory_killed, (r.returncode, r.stderr)
    assert "exceeded its memory limit of 96 MB" in r.described


def test_executor_over_its_memory_is_reported_clearly(
    tmp_path: Path, tracker: Tracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sandbox cgroup memory limit through the executor interface: an executor whose data does not
    fit its limit is killed by the kernel, and the party's start error says it was the memory limit."""
    rows = np.random.default_rng(0).random((300_000, 8))
    data = tmp_path / "big.csv"
    with data.open("w") as fh:
        fh.write(",".join(f"c{i}" for i in range(8)) + "\n")
        np.savetxt(fh, rows, delimiter=",", fmt="%.6f")

    async def start() -> None:
        await ExecutorHandle.start(data, deadline_s=60, start_timeout_s=60, memory_mb=64, isolation="sandbox")

    task_root = tmp_path / "tasks"
    task_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(task_root))  # the executor's task folder goes here

    def groups() -> set[str]:
        return {p.name for parent in sbx.parent_dirs() for p in parent.glob("tm-exec-*")}

    before = groups()
    with pytest.raises(TimeoutError, match="exceeded its memory limit of 64 MB"):
        asyncio.run(start())
    names = [p.name for p in task_root.iterdir()]
    assert names == [], f"task folder left behind: {names}"
    assert groups() <= before, f"cgroups left behind: {groups() - before}"


def test_executor_cannot_fork_bomb(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox cgroup pids limit: forking stops at the limit with EAGAIN; everything is killed after."""
    r = _probe(
        tmp_path,
        tracker,
        """
        import json, os, time
        made, err = 0, ""
        for _ in range(500):
            try:
                pid = os.fork()
            except OSError as e:
                err = e.strerror
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            made += 1
        print(json.dumps({"made": made, "err": err}), flush=True)
        os._exit(0)
    """,
        limits=sbx.SandboxLimits(memory_mb=256, pids=16),
    )
    assert r.out["err"], "500 forks succeeded under a pids limit of 16"
    assert r.out["made"] < 16
    assert r.exit.pids_refused > 0


def test_blocked_syscalls_fail(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox seccomp filter: ptrace, unshare, setns, mount, keyctl, bpf, personality and clone with
    namespace flags fail with EPERM inside; ordinary syscalls (fork, getpid) still work."""
    r = _probe(
        tmp_path,
        tracker,
        """
        import ctypes, errno, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        def call(name, *args):
            ctypes.set_errno(0)
            rc = libc.syscall(ctypes.c_long(nr[name]), *[ctypes.c_long(a) for a in args])
            return rc, ctypes.get_errno()
        nr = {"ptrace": 101, "unshare": 272, "setns": 308, "mount": 165, "keyctl": 250, "bpf": 321,
              "personality": 135, "clone": 56, "perf_event_open": 298, "getpid": 39}
        out = {name: call(name, *args) for name, args in [
            ("ptrace", (0, 0, 0, 0)), ("unshare", (0x10000000,)), ("setns", (0, 0)), ("mount", (0, 0, 0, 0, 0)),
            ("keyctl", (0, 0)), ("bpf", (0, 0, 0)), ("personality", (0xffffffff,)),
            ("clone", (0x10000000 | 17, 0, 0, 0, 0)), ("perf_event_open", (0, 0, -1, -1, 0)), ("getpid", ())]}
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        out["fork"] = os.waitpid(pid, 0)[1] >> 8
        print(json.dumps(out))
    """,
    )
    assert r.returncode == 0, r.stderr
    for name in ("ptrace", "unshare", "setns", "mount", "keyctl", "bpf", "personality", "clone", "perf_event_open"):
        assert r.out[name] == [-1, 1], f"{name} was not refused with EPERM: {r.out[name]}"
    assert r.out["getpid"][0] > 0 and r.out["fork"] == 7


def test_seccomp_numbers_match_the_kernel_headers() -> None:
    """Sandbox seccomp filter: the deny list's x86_64 numbers are the kernel's (when headers exist)."""
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip(f"{header} not installed (linux-libc-dev), so the numbers cannot be cross-checked")
    table = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", header.read_text())}
    assert {n: table[n] for n in DENIED_X86_64} == DENIED_X86_64
    assert len(deny_list_program()) % 8 == 0


def test_summary_rule_runs_through_the_sandbox(tmp_path: Path, tracker: Tracker) -> None:
    """Sandboxed executor, normal path: summary statistics on the sample data (a file only root may
    read, passed as a descriptor) equal the direct computation; the executor runs as uid 65534 in
    its own pid/net/mount namespaces under seccomp; its socket sits in a root-only folder outside
    the sandbox (only ``task/`` is bound in); after kill its cgroups and folder are gone."""
    names, splits = breast_cancer_split(2)
    data = tmp_path / "m_a.csv"
    write_csv(data, names, splits[0])
    data.chmod(0o600)

    async def run() -> tuple[dict, dict]:
        h = await ExecutorHandle.start(
            data, deadline_s=60, start_timeout_s=30, memory_mb=512, allowed=["summary_stats"], isolation="sandbox"
        )
        tracker.handles.append(h)
        host = {}
        for pid in h.sandbox.cgroups.pids():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"trainmaster.gateway.executors.worker" in cmd:
                status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                host = {
                    "uid": status["Uid"].split(),
                    "seccomp": status["Seccomp"].strip(),
                    "ns": {
                        n: os.readlink(f"/proc/{pid}/ns/{n}") != os.readlink(f"/proc/self/ns/{n}")
                        for n in ("pid", "net", "mnt", "ipc", "uts")
                    },
                }
        sock_dir = Path(h.address).parent  # the party's: the executor cannot swap its socket for a symlink
        host["sock_dir"] = (sock_dir.stat().st_uid, oct(sock_dir.stat().st_mode & 0o777), sorted(os.listdir(sock_dir)))
        files = _leg_files(tmp_path)
        reply = await h.call(RuleCall(rule="summary_stats", params={}), files, timeout_s=30)
        result = json.loads(files.result.read_bytes()) if reply.ok else {"error": reply.error}
        h.kill()
        await asyncio.wait_for(h.proc.wait(), 10)
        return result, host

    result, host = asyncio.run(run())
    assert host["uid"] == ["65534"] * 4 and host["seccomp"] == "2" and all(host["ns"].values()), host
    assert host["sock_dir"] == (0, "0o700", ["executor.sock", "task"]), host
    rows = splits[0]
    for i, name in enumerate(names):
        got = result["columns"][name]
        assert got["count"] == len(rows)
        assert got["sum"] == pytest.approx(rows[:, i].sum())
        assert got["mean"] == pytest.approx(rows[:, i].mean())
        assert got["std"] == pytest.approx(rows[:, i].std())


PARTY_STANDIN = """
import asyncio, json, sys
from pathlib import Path
from trainmaster.gateway.executors.process import ExecutorHandle

async def main():
    h = await ExecutorHandle.start(Path(sys.argv[1]), deadline_s=120, start_timeout_s=60, memory_mb=256,
                                   isolation="sandbox")
    print(json.dumps({"group": h.sandbox.cgroups.name, "workdir": h._workdir}), flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_party_killed_9_leaves_no_sandbox_running(tmp_path: Path) -> None:
    """Nothing left behind after kill -9: a party killed -9 takes its sandboxed executor with it
    (bubblewrap's --die-with-parent), and the next sandbox start's sweep removes the empty cgroups
    and the task folder it left."""
    data = tmp_path / "d.csv"
    data.write_text("x\n1\n2\n")
    env = {**os.environ, "PYTHONPATH": str(sbx.package_parent())}
    party = subprocess.Popen(
        [sys.executable, "-c", PARTY_STANDIN, str(data)], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    groups: list[Path] = []
    workdir = None
    try:
        ready, _, _ = select.select([party.stdout], [], [], 60)
        assert ready, "the stand-in party did not start its executor within 60s"
        info = json.loads(party.stdout.readline())
        groups = sbx.group_dirs(info["group"])
        workdir = Path(info["workdir"])
        procs = groups[-1] / "cgroup.procs"
        assert procs.read_text().split(), "the executor is not in its pids group"
        os.killpg(party.pid, signal.SIGKILL)
        party.wait(timeout=10)
        wait_until(lambda: not procs.read_text().split(), 15, "the sandbox's processes to die with their party")
        assert all(g.is_dir() for g in groups) and workdir.is_dir()  # what kill -9 leaves for the sweep
        wait_until(lambda: time.time() - groups[0].stat().st_mtime > 1.0, 15, "the left-over groups to be a second old")
        sbx.sweep_stale_groups(workdir.parent, min_age_s=1.0)
        assert not any(g.exists() for g in groups) and not workdir.exists()
    finally:
        if party.poll() is None:
            os.killpg(party.pid, signal.SIGKILL)
            party.wait(timeout=10)
        for g in groups:  # a failed run must not leave them either
            for pid in (g / "cgroup.procs").read_text().split() if g.exists() else []:
                os.kill(int(pid), signal.SIGKILL)
        for g in groups:
            if g.exists():
                wait_until(lambda: not (g / "cgroup.procs").read_text().split(), 15, f"{g} to empty")
                g.rmdir()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _descendants(root: int) -> list[int]:
    """Every live process below ``root``, from /proc (parent pid is field 4 of /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_party_runs_its_executors_in_the_sandbox(tmp_path: Path) -> None:
    """Spec flow step 2, "an isolated container for that task", as the party's default isolation
    (sandbox): a party started from its config as a user would runs a leg's executor as uid 65534
    under seccomp in its own cgroups, the leg's result comes back through the gateway, the executor
    is released (process, cgroups, folder gone) as soon as its rule has run, and stopping the party
    leaves nothing behind."""
    dep = Deployment(tmp_path, ["a"])
    assert dep.cfg("a").isolation == "sandbox"
    dep.start_all()
    executors: list[int] = []
    made: list[Path] = []
    try:
        ini = dep.initiator()
        legs = [LegSpec(data_id="m_a", party="a", rule="summary_stats", params={"columns": ["mean_radius"]})]
        assert ini.create_task("sandboxed1", legs)["m_a"]["ok"]  # the leg's executor is up, waiting for its transfer
        tree = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in _descendants(dep.procs["a"].pid)}
        executors = [
            p for p, argv in tree.items() if b"trainmaster.gateway.executors.worker" in argv and b"python" in argv[0]
        ]
        assert len(executors) == 1, tree
        assert any(argv[0].endswith(b"bwrap") for argv in tree.values()), tree
        status = Path(f"/proc/{executors[0]}/status").read_text()
        assert re.search(r"^Uid:\s+65534\s+65534\s+65534\s+65534$", status, re.M), status
        assert re.search(r"^Seccomp:\s+2$", status, re.M)
        group = Path(f"/proc/{executors[0]}/cgroup").read_text()
        name = re.search(rf":/{sbx.CGROUP_PARENT}/([^/\s]+)$", group, re.M)[1]
        assert name.startswith("tm-exec-sandboxed1.m_a."), name  # the operator can tell which task it serves
        wanted = ["pids", "memory"] if sbx.cgroup_version() == 1 else [""]  # v2: the one "0::" line
        assert all(re.search(rf"^\d+:{c}:/{sbx.CGROUP_PARENT}/{name}$", group, re.M) for c in wanted), group
        made = sbx.group_dirs(name)
        made.append(Path(tempfile.gettempdir()) / name)  # the executor's folder is named like its groups
        assert all(p.is_dir() for p in made), made
        got = ini.receive("sandboxed1", ["m_a"], 60)["m_a"]
        ini.close()
        wait_until(  # the leg's rule ran: its executor is released at once, not at the task's deadline
            lambda: not any(Path(f"/proc/{p}").exists() for p in executors) and not any(p.exists() for p in made),
            15,
            "the leg's executor to be released after its rule ran",
        )
        col = dep.splits[0][:, dep.names.index("mean_radius")]
        assert got["outcome"] == "result" and got["result"]["columns"]["mean_radius"]["sum"] == pytest.approx(col.sum())
    finally:
        dep.stop_all()
    wait_until(
        lambda: not any(Path(f"/proc/{p}").exists() for p in executors),
        15,
        "the party's executor to be gone after the party stopped",
    )
    assert not [p for p in made if p.exists()], made


def test_party_refuses_sandbox_isolation_it_cannot_provide(tmp_path: Path) -> None:
    """Party isolation check: configured for the sandbox on a host where bubblewrap cannot be found
    (PATH without it), `party serve` exits 2 without a traceback, naming what is missing and the
    opt-out (isolation: process)."""
    dep = Deployment(tmp_path, ["a"])
    env = {**os.environ, "PATH": str(tmp_path / "no-bin"), "PYTHONPATH": str(sbx.package_parent())}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "party",
            "serve",
            "--config",
            str(dep.configs["a"]),
            "--data",
            str(tmp_path / "data" / "a"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr
    assert "isolation 'sandbox' is not available" in run.stderr and "bubblewrap" in run.stderr, run.stderr
    assert "isolation: process" in run.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "party",
            "serve",
            "--config",
            str(dep.configs["a"]),
            "--data",
            str(tmp_path / "data" / "a"),
            "--isolation",
            "container",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--isolation must be sandbox or process" in bad.stderr, bad.stderr


def test_executor_killed_mid_call_reports_its_memory_limit(tmp_path: Path, tracker: Tracker) -> None:
    """Sandbox cgroup memory limit during a rule: once the executor is up, its limit is lowered to
    a few MB above what it uses; a rule whose result needs far more (per-row predictions for 400k
    rows) gets it killed by the kernel, and the call fails with ExecutorDied naming the limit."""
    from trainmaster.gateway.executors.base import ExecutorDied

    data = tmp_path / "rows.csv"
    with data.open("w") as fh:
        fh.write("x\n")
        np.savetxt(fh, np.random.default_rng(1).random(400_000), fmt="%.6f")

    async def run() -> str:
        h = await ExecutorHandle.start(
            data, deadline_s=60, start_timeout_s=60, memory_mb=256, allowed=["predict"], isolation="sandbox"
        )
        tracker.handles.append(h)
        cg = h.sandbox.cgroups
        cg.set_memory_limit(cg.memory_usage() + (6 << 20))
        try:
            reply = await h.call(
                RuleCall(rule="predict", params={"features": ["x"], "weights": {"w": [1.0], "b": 0.0}}),
                _leg_files(tmp_path),
                timeout_s=30,
            )
            return f"no failure: ok={reply.ok} size={reply.size}"
        except ExecutorDied as exc:
            return str(exc)
        finally:
            h.kill()
            await asyncio.wait_for(h.proc.wait(), 10)

    message = asyncio.run(run())
    assert message.startswith("executor killed by the kernel: it exceeded its memory limit"), message


def test_parquet_data_is_read_through_the_descriptor(tmp_path: Path, tracker: Tracker) -> None:
    """Sandboxed executor, Parquet data: pyarrow reads the descriptor the party passed (the file is
    readable only by root, the executor runs as 65534), and row_count is right."""
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed, so Parquet data files cannot be read")
    import pyarrow.parquet as pq

    data = tmp_path / "m_p.parquet"
    pq.write_table(pa.table({"x": np.arange(1234, dtype=np.float64), "y": np.ones(1234)}), data)
    data.chmod(0o600)

    async def run() -> dict:
        h = await ExecutorHandle.start(data, deadline_s=60, start_timeout_s=60, memory_mb=512, isolation="sandbox")
        tracker.handles.append(h)
        try:
            files = _leg_files(tmp_path)
            reply = await h.call(RuleCall(rule="row_count", params={}), files, timeout_s=30)
            return json.loads(files.result.read_bytes()) if reply.ok else {"error": reply.error}
        finally:
            h.kill()
            await asyncio.wait_for(h.proc.wait(), 10)

    result = asyncio.run(run())
    assert result.get("rows") == 1234, result


def test_sandbox_setup_failure_is_a_clear_start_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sandbox setup refused (here: the cgroup root is not a directory): ExecutorHandle.start raises
    ExecutorStartError saying so (the party answers 503 and reports the leg not ready, never a 500),
    and leaves no executor folder behind."""
    from trainmaster.gateway.executors.base import ExecutorStartError

    data = tmp_path / "d.csv"
    data.write_text("x\n1\n")
    not_a_dir = tmp_path / "not-a-cgroup-root"
    not_a_dir.write_text("")
    task_root = tmp_path / "tasks"
    task_root.mkdir()
    monkeypatch.setattr(sbx, "CGROUP_ROOT", not_a_dir)
    monkeypatch.setattr(tempfile, "tempdir", str(task_root))

    async def start() -> None:
        await ExecutorHandle.start(data, deadline_s=60, start_timeout_s=30, memory_mb=256, isolation="sandbox")

    with pytest.raises(ExecutorStartError, match="executor sandbox could not be set up: NotADirectoryError"):
        asyncio.run(start())
    assert list(task_root.iterdir()) == []


def test_a_checkout_under_tmp_stays_visible_inside(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The sandbox's private /tmp is mounted before the Python roots are bound, so an installation
    that lives under /tmp (a CI clone) is not hidden by it (an executor there exited 127)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    root = tmp_path / "clone" / ".venv"
    monkeypatch.setattr(sbx, "_python_roots", lambda: [root])
    args = sbx.bwrap_args(tmp_path / "task", seccomp_fd=3)
    assert args.index("--tmpfs") < args.index(str(root))


def _leg_files(folder: Path) -> LegFiles:
    """Where a direct call's rule run writes (the party's leg folder, in a party)."""
    leg = folder / "leg"
    leg.mkdir(exist_ok=True)
    return LegFiles("t", "d", leg / "result", leg / "commit")
