"""Mechanisms of the node agent itself (controller spec 'Our product decisions'; issue #14 part 1),
exercised through its daemon and client with real processes: process-tree ownership (cgroup v1
trees, and the marker fallback), stop = TERM then KILL of the whole tree, the durable exit
journal, agent death (AgentRestarted, nothing runs twice), one agent per state dir, and the
OS's refusal as a StartFailed that names the program."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent_fixtures import ESCAPERS, PY, doubles, escapers, replica, starts
from helpers import wait_until
from controller_harness import stop_agent
from trainmaster.agent.client import AgentClient, agent_pid, ensure_agent
from trainmaster.contract import InstancePhase, LaunchSpec
from trainmaster.agent.tree import CgroupTrees, cgroup_name, cgroups_available

CGROUPS = not cgroups_available()
BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.fixture(
    params=[
        pytest.param(
            "cgroup",
            marks=pytest.mark.skipif(not CGROUPS, reason=f"cgroup v1 trees unavailable here: {cgroups_available()}"),
        ),
        "marker",
    ]
)
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AgentClient]:
    """An agent daemon of its own (cgroup trees, or environment markers only), stopped (with
    everything it started) when the test ends, passed or failed."""
    state_dir = tmp_path / f"agent-{request.param}"
    extra = ("--no-cgroups",) if request.param == "marker" else ()
    ensure_agent(state_dir, linger=30, extra_args=extra)
    client = AgentClient(state_dir, linger=30)
    assert client.ping()["trees"] == request.param
    yield client
    client.close()
    stop_agent(state_dir)


def spec(tmp_path: Path, name: str, argv: list[str], attempt: int = 1, **extra: object) -> LaunchSpec:
    return LaunchSpec(
        instance_id=f"job/{name}/{attempt}",
        job_id=1,
        job_name="job",
        role=name,
        index=0,
        attempt=attempt,
        argv=argv,
        env=dict(BASE_ENV),
        cwd=None,
        log_path=str(tmp_path / f"{name}.log"),
        instance_dir=str(tmp_path / name),
        host="127.0.0.1",
        **extra,
    )  # type: ignore[arg-type]


def test_exit_codes_cpu_and_peak_memory_are_reported(agent: AgentClient, tmp_path: Path) -> None:
    """Reaping with wait4: the exit code (or 128 + signal), and the tree's CPU seconds and peak RSS."""
    burn = "import sys; x = bytearray(64 << 20); t = sum(range(3_000_000)); sys.exit(3)"
    results = agent.start(
        [
            spec(tmp_path, "burn", [PY, "-c", burn]),
            spec(tmp_path, "killed", [PY, "-c", "import os; os.kill(os.getpid(), 9)"]),
        ]
    )
    assert all(r.handle for r in results)
    burnt, killed = _exited(agent, ["job/burn/1", "job/killed/1"])
    assert burnt.exit_code == 3 and burnt.reason == "Error"
    assert burnt.cpu_seconds > 0.05 and burnt.peak_rss >= 64 << 20
    assert killed.exit_code == 137 and killed.reason == "Killed"


def _exited(agent: AgentClient, ids: list[str], timeout: float = 30):  # type: ignore[no-untyped-def]
    def done():  # type: ignore[no-untyped-def]
        statuses = agent.observe(ids)
        return statuses if all(s.phase == InstancePhase.EXITED for s in statuses) else None

    return wait_until(done, timeout, f"{ids} to exit")


def test_start_is_idempotent_and_refusals_name_the_program(agent: AgentClient, tmp_path: Path) -> None:
    """A repeated start of an instance id starts nothing; a missing program, a bad working
    directory and a non-executable file are StartFailed with the program and the OS error."""
    lock = tmp_path / "once.lock"
    first = agent.start([spec(tmp_path, "once", replica(lock, 30))])[0]
    again = agent.start([spec(tmp_path, "once", replica(lock, 30))])[0]
    assert first.handle == again.handle
    wait_until(lambda: starts(lock) == 1, what="the replica to start")
    plain = tmp_path / "plain.txt"
    plain.write_text("not a program")
    refused = agent.start(
        [
            spec(tmp_path, "nope", ["no-such-program-xyz"]),
            LaunchSpec(**{**spec(tmp_path, "cwd", [PY, "-c", "pass"]).to_dict(), "cwd": str(tmp_path / "missing-dir")}),
            spec(tmp_path, "noexec", [str(plain)]),
        ]
    )
    assert [r.handle for r in refused] == [None, None, None]
    assert "program 'no-such-program-xyz' not found" in refused[0].error
    assert "missing-dir" in refused[1].error and PY in refused[1].error
    assert "plain.txt" in refused[2].error and "Permission denied" in refused[2].error
    nope = agent.observe(["job/nope/1"])[0]  # a refused start is an exit: code 127, reason StartFailed
    assert (nope.phase, nope.exit_code, nope.reason) == (InstancePhase.EXITED, 127, "StartFailed")
    agent.stop(["job/once/1"], grace=1)
    assert starts(lock) == 1 and doubles(tmp_path) == []


def test_a_batch_is_spawned_by_several_threads_each_child_in_its_own_tree(agent: AgentClient, tmp_path: Path) -> None:
    """Parallel spawning (issue #14, controller/agent speed): one start of 40 instances is spawned
    by several agent threads, each moving from one instance's cgroups into the next. Every child
    is born in its own instance's tree, one that exits while the batch is still spawning is
    reported with its exit code, a refused one in the middle is StartFailed and hinders no other,
    and afterwards no agent thread is left inside an instance's cgroup (it would be frozen with it)."""
    batch = []
    for n in range(40):
        argv = ["true"] if n % 10 == 3 else ["no-such-program-xyz"] if n == 17 else ["sleep", "30"]
        batch.append(LaunchSpec(**{**spec(tmp_path, f"w{n}", argv).to_dict(), "index": n}))
    results = agent.start(batch)
    assert [r.handle is None for r in results] == [n == 17 for n in range(40)]
    ids = [s.instance_id for s in batch]
    quick = [ids[n] for n in range(40) if n % 10 == 3]
    assert all(s.exit_code == 0 and s.reason == "Completed" for s in _exited(agent, quick))
    sleepers = [n for n in range(40) if n % 10 != 3 and n != 17]
    statuses = agent.observe([ids[n] for n in sleepers])
    assert all(s.phase == InstancePhase.RUNNING for s in statuses)
    if agent.ping()["trees"] == "cgroup":
        for n, status in zip(sleepers, statuses):
            assert status.handle.pid is not None
            lines = Path(f"/proc/{status.handle.pid}/cgroup").read_text().splitlines()
            pids_line = next(line for line in lines if ":pids:" in line)
            assert pids_line.endswith("/" + cgroup_name(ids[n])), (n, pids_line)
        agent_tasks = Path(f"/proc/{agent.ping()['pid']}/task")
        for task in agent_tasks.iterdir():
            assert "job.w" not in (task / "cgroup").read_text(), f"agent thread {task.name} left in a tree"
    stopped = agent.stop([ids[n] for n in sleepers], grace=1)
    assert all(s.phase == InstancePhase.EXITED for s in stopped)


def test_prepare_creates_the_logs_ahead_and_starts_nothing(agent: AgentClient, tmp_path: Path) -> None:
    """The controller's hint before it commits a pass's start intents (Backend.prepare_start):
    the agent answers at once and creates the instances' log files (and their folder), empty,
    on a thread of its own; it starts nothing and journals nothing, so a start that never comes
    leaves only an empty file. The start then writes the attempt's header and the command's
    output into the same file."""
    logs = tmp_path / "later" / "logs"
    early = LaunchSpec(
        **{
            **spec(tmp_path, "early", ["sh", "-c", "echo hello-from-early"]).to_dict(),
            "log_path": str(logs / "early.log"),
        }
    )
    agent.prepare([early.log_path, str(logs / "never.log")])
    wait_until(lambda: (logs / "early.log").exists() and (logs / "never.log").exists(), what="the prepared logs")
    assert (logs / "early.log").read_bytes() == b"" and (logs / "never.log").read_bytes() == b""
    assert agent.list() == []
    assert "early" not in (agent.state_dir / "journal.jsonl").read_text()
    agent.start([early])
    assert _exited(agent, [early.instance_id])[0].exit_code == 0
    text = (logs / "early.log").read_text()
    assert text.startswith("--- attempt 1 of early-0 at ") and "hello-from-early" in text
    assert (logs / "never.log").read_bytes() == b""


def _slots(parent: Path) -> dict[str, list[int]]:
    """The warm slots under an agent's cgroup parent (pids hierarchy) and the threads in each."""
    return {p.name: [int(t) for t in (p / "tasks").read_text().split()] for p in parent.glob("warm-*")}


def _slots_when(parent: Path, count: int) -> dict[str, list[int]] | None:
    slots = _slots(parent)
    return slots if len(slots) == count else None


def test_warm_slots_give_each_child_fresh_renamed_cgroups_and_a_killed_agent_leaves_none_used(
    agent: AgentClient, tmp_path: Path
) -> None:
    """Warm slots (issue #14, submit -> replicas running): after a batch (of at least
    WARM_BATCH) the agent keeps as many spawning threads waiting in fresh, empty cgroups as that
    batch had; the next batch's children
    are born in those cgroups renamed after their instances (every hierarchy; where the name is
    taken, in the cgroups of that name), a spawn refused before or after its slot was named
    leaves no cgroup, no agent thread stays in an instance's cgroup, and the slots are made
    again with new names. A slot only ever holds one agent thread: a kill -9 of the agent
    leaves slots with no process in them, and the next agent removes them before it starts
    anything."""
    if agent.ping()["trees"] != "cgroup":
        pytest.skip("warm slots exist only with cgroup trees")
    from trainmaster.agent.core import AgentOptions
    from trainmaster.agent.tree import CgroupTrees

    trees = CgroupTrees(AgentOptions(agent.state_dir.resolve()).node_key)
    parent = trees.hierarchies["pids"]
    first = [LaunchSpec(**{**spec(tmp_path, f"a{n}", ["sleep", "30"]).to_dict(), "index": n}) for n in range(8)]
    agent.start(first)
    old = agent.ping()["pid"]
    warm = wait_until(lambda: _slots_when(parent, 8), what="eight warm slots")
    agent_threads = {int(t.name) for t in Path(f"/proc/{old}/task").iterdir()}
    assert all(len(tids) == 1 and tids[0] in agent_threads for tids in warm.values())
    commands = [["sleep", "30"]] * 6 + [["no-such-program-xyz"], []]  # refused once placed, and before
    second = [LaunchSpec(**{**spec(tmp_path, f"b{n}", argv).to_dict(), "index": n}) for n, argv in enumerate(commands)]
    trees.create(second[0].instance_id, 0)  # a tree of that name already there: its slot cannot take the name
    results = agent.start(second)
    assert [r.handle is None for r in results] == [False] * 6 + [True, True]
    assert "no-such-program-xyz" in results[6].error and "no command" in results[7].error
    for result in results[:6]:
        assert result.handle is not None and result.handle.pid is not None
        lines = Path(f"/proc/{result.handle.pid}/cgroup").read_text().splitlines()
        for hierarchy in trees.hierarchies:
            line = next(line for line in lines if f":{hierarchy}:" in line.replace(",", ":"))
            assert line.endswith("/" + cgroup_name(result.instance_id)), (hierarchy, line)
    for task in Path(f"/proc/{old}/task").iterdir():
        assert "job.b" not in (task / "cgroup").read_text(), f"agent thread {task.name} left in a tree"
    assert not any((parent / cgroup_name(r.instance_id)).exists() for r in results[6:])  # nothing left of them
    again = wait_until(lambda: _slots_when(parent, 8), what="the slots made again")
    assert not set(again) & set(warm)  # fresh cgroups, never an instance's old ones
    second = second[:6]
    statuses = agent.observe([s.instance_id for s in second])
    assert all(s.phase == InstancePhase.RUNNING and s.cpu_seconds < 1 for s in statuses)
    agent.stop([s.instance_id for s in first + second], grace=1)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{old}").exists() or _zombie(old), what="the agent to die")
    # no process in them: the threads that waited there died with the agent
    left = wait_until(lambda: (s := _slots(parent)) and all(t == [] for t in s.values()) and s, what="empty slots")
    assert len(left) == 8
    ensure_agent(agent.state_dir, linger=30)  # the next agent
    assert not set(_slots(parent)) & set(left)
    log = (agent.state_dir / "agent.log").read_text()
    assert "unjournaled process tree warm-" not in log


def test_after_a_batch_its_threads_go_home_and_the_slots_it_left_keep_theirs(
    agent: AgentClient, tmp_path: Path
) -> None:
    """Warm slots (issue #38, the 64-replica start): a batch that took every waiting slot sends
    the agent's threads home together (one ``cgroup.procs`` write per hierarchy); a batch that
    left slots waiting sends its own threads home one by one, and the threads waiting in the
    slots it did not take stay there, each alone in its slot, ready for the next batch. Either
    way no agent thread is left in an instance's cgroups, and the next batch's children are born
    in their own."""
    if agent.ping()["trees"] != "cgroup":
        pytest.skip("warm slots exist only with cgroup trees")
    from trainmaster.agent.core import AgentOptions

    trees = CgroupTrees(AgentOptions(agent.state_dir.resolve()).node_key)
    parent = trees.hierarchies["pids"]
    pid = agent.ping()["pid"]

    def batch(prefix: str, count: int) -> list[LaunchSpec]:
        return [
            LaunchSpec(**{**spec(tmp_path, f"{prefix}{n}", ["sleep", "30"]).to_dict(), "index": n})
            for n in range(count)
        ]

    def threads_in_job_trees() -> list[str]:
        return [t.name for t in Path(f"/proc/{pid}/task").iterdir() if "job." in (t / "cgroup").read_text()]

    started = batch("a", 12)
    agent.start(started)  # then twelve slots are made
    twelve = wait_until(lambda: _slots_when(parent, 12), what="twelve warm slots")
    taken_all = batch("b", 12)
    results = agent.start(taken_all)  # takes every slot: the threads go home together
    assert all(r.handle is not None for r in results)
    assert threads_in_job_trees() == []
    made_again = wait_until(lambda: _slots_when(parent, 12), what="the twelve slots made again")
    assert not set(made_again) & set(twelve)  # the first twelve were all used
    left_some = batch("c", 8)
    results = agent.start(left_some)  # takes 8 of 12: the other four wait on in their slots
    assert all(r.handle is not None for r in results)
    assert threads_in_job_trees() == []
    untaken = {name: tids for name, tids in _slots(parent).items() if name in made_again}  # (the
    # slots the refill makes meanwhile have new names)
    agent_threads = {int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()}
    assert len(untaken) == 4 and all(len(t) == 1 and t[0] in agent_threads for t in untaken.values()), untaken
    for result in results:
        assert result.handle is not None and result.handle.pid is not None
        line = next(x for x in Path(f"/proc/{result.handle.pid}/cgroup").read_text().splitlines() if ":pids:" in x)
        assert line.endswith("/" + cgroup_name(result.instance_id)), line
    agent.stop([s.instance_id for s in started + taken_all + left_some], grace=1)


def test_stop_kills_setsid_grandchildren_and_double_forked_daemons(agent: AgentClient, tmp_path: Path) -> None:
    """Stop: TERM every process of the tree, KILL after the grace: detached descendants too."""
    agent.start([spec(tmp_path, "escape", [PY, "-c", ESCAPERS, "300"])])
    wait_until(lambda: len(escapers()) == 2, what="the setsid grandchild and the daemon")
    statuses = agent.stop(["job/escape/1"], grace=1)
    assert statuses[0].phase == InstancePhase.EXITED and statuses[0].reason == "Stopped"
    assert escapers() == []


def test_when_the_main_process_ends_its_tree_is_killed(agent: AgentClient, tmp_path: Path) -> None:
    """An instance ends with its main process (as a container does): the daemon it left is
    killed before the exit is reported, so a replacement never meets a stale copy."""
    agent.start([spec(tmp_path, "short", [PY, "-c", ESCAPERS, "0.5"])])
    status = _exited(agent, ["job/short/1"])[0]
    assert status.exit_code == 0 and escapers() == []


def test_stop_asks_with_sigterm_first(agent: AgentClient, tmp_path: Path) -> None:
    """Stop = TERM, then KILL after the grace: an instance that handles SIGTERM gets it (its
    signal mask is empty and its handler runs) and ends within the grace, as a graceful
    shutdown should; the escalation below is only for one that ignores it."""
    graceful = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('got SIGTERM', flush=True), sys.exit(3)))\n"
        "print('ready', flush=True)\ntime.sleep(60)"
    )
    agent.start([spec(tmp_path, "graceful", [PY, "-c", graceful])])
    wait_until(lambda: "ready" in (tmp_path / "graceful.log").read_text(), what="the handler")
    status = agent.stop(["job/graceful/1"], grace=20)[0]
    assert status.exit_code == 3 and "got SIGTERM" in (tmp_path / "graceful.log").read_text()


def test_stop_escalates_to_sigkill(agent: AgentClient, tmp_path: Path) -> None:
    stubborn = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)"
    )
    agent.start([spec(tmp_path, "stubborn", [PY, "-c", stubborn])])
    wait_until(lambda: "ready" in (tmp_path / "stubborn.log").read_text(), what="the handler")
    started = time.monotonic()
    status = agent.stop(["job/stubborn/1"], grace=0.5)[0]
    assert status.exit_code == 137 and time.monotonic() - started < 10


@pytest.mark.skipif(not CGROUPS, reason=f"cgroup v1 trees unavailable here: {cgroups_available()}")
@pytest.mark.parametrize("control_file", ["freezer.state", "cgroup.procs"])
def test_a_tree_whose_cgroup_vanishes_during_a_stop_is_already_stopped(
    control_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mechanism (stop = freeze, signal every member, thaw): the reaper removes an ended
    instance's cgroups while a stop may be freezing or listing that tree. A control file opened
    just before the removal answers ENODEV, not ENOENT; the tree has ended, so the stop is done
    (nothing to signal), never an error the agent refuses ``stop`` with (issue 38: a traceback
    from ``trainmaster run``). The removal is put exactly between the open and the access."""
    trees = CgroupTrees(f"test-vanish-{os.getpid()}")
    instance = "job/vanish/1"
    trees.create(instance, 0)
    kernel_said: list[int] = []
    real_read, real_write = Path.read_text, Path.write_text

    def vanish_then(access: str, path: Path) -> int:
        """Open ``path``, remove the instance's cgroups, then read or write through the open file."""
        fd = os.open(path, os.O_RDONLY if access == "read" else os.O_WRONLY)
        try:
            assert trees.remove(instance)
            try:
                os.read(fd, 4096) if access == "read" else os.write(fd, b"FROZEN")
            except OSError as exc:
                kernel_said.append(exc.errno or 0)
                raise
            return 0
        finally:
            os.close(fd)

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == control_file and not kernel_said:
            vanish_then("read", self)
        return real_read(self, *args, **kwargs)  # type: ignore[arg-type]

    def write_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name == control_file and not kernel_said:
            return vanish_then("write", self)
        return real_write(self, data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(Path, "write_text", write_text)
    try:
        assert trees.signal_all(instance, signal.SIGTERM) == 0
        assert trees.pids(instance) == [] and trees.cpu_seconds(instance) is None
        assert kernel_said == [errno.ENODEV]  # the race happened as on the busy machine
    finally:
        monkeypatch.undo()
        trees.remove(instance)
        trees.close()


@pytest.mark.skipif(not CGROUPS, reason=f"cgroup v1 trees unavailable here: {cgroups_available()}")
def test_memory_limit_is_enforced_by_the_cgroup(agent: AgentClient, tmp_path: Path) -> None:
    """LaunchSpec.memory becomes memory.limit_in_bytes: an instance over it is OOMKilled."""
    if agent.ping()["trees"] != "cgroup":
        pytest.skip("the marker fallback sets no memory limit")
    hog = "x = []\nwhile True: x.append(bytearray(8 << 20))"
    agent.start([spec(tmp_path, "hog", [PY, "-c", hog], memory=64 << 20)])
    status = _exited(agent, ["job/hog/1"])[0]
    assert status.exit_code == 137 and status.reason == "OOMKilled"


def test_agent_killed_restarts_kill_what_it_left_and_journal_agent_restarted(
    agent: AgentClient, tmp_path: Path
) -> None:
    """Agent death: kill -9 of the agent leaves its instances running without an owner; the
    next agent kills them BEFORE it accepts a start and journals them EXITED/AgentRestarted
    (137); exits journaled before the crash are still reported. A replacement started right
    after never overlaps the old copy."""
    state_dir = agent.state_dir
    extra = ("--no-cgroups",) if agent.ping()["trees"] == "marker" else ()
    lock = tmp_path / "r.lock"
    agent.start(
        [
            spec(tmp_path, "r", [PY, "-c", f"import subprocess, sys; subprocess.run({replica(lock, 300)!r})"]),
            spec(tmp_path, "done", [PY, "-c", "raise SystemExit(5)"]),
        ]
    )
    _exited(agent, ["job/done/1"])
    wait_until(lambda: starts(lock) == 1, what="the replica to start")
    old = agent_pid(state_dir)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{old}").exists() or _zombie(old), what="the agent to die")
    ensure_agent(state_dir, linger=30, extra_args=extra)  # what the next client call does
    after = {s.handle.instance_id: s for s in agent.observe(["job/r/1", "job/done/1"])}
    assert after["job/done/1"].exit_code == 5  # journaled before the crash: not lost
    lost = after["job/r/1"]
    assert lost.phase == InstancePhase.EXITED and lost.reason == "AgentRestarted" and lost.exit_code == 137
    agent.start([spec(tmp_path, "r", replica(lock, 0.5), attempt=2)])
    _exited(agent, ["job/r/2"])
    assert starts(lock) == 2 and doubles(tmp_path) == []


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_kill9_of_the_wait_step_ends_the_instance_and_nothing_runs_twice(agent: AgentClient, tmp_path: Path) -> None:
    """The wait step is the instance's main process (it later execs the command): killing it
    ends the attempt with 137; nothing of it is left to overlap the next attempt."""
    from trainmaster.contract import Dependency

    gated = spec(
        tmp_path,
        "gated",
        ["true"],
        depends=[Dependency("nobody", "Running", 60, 1)],
        env_inputs={
            "framework": "command",
            "role_env": {},
            "context": {
                "job_name": "job",
                "role": "gated",
                "index": 0,
                "replicas": 1,
                "role_replicas": {},
                "host": "127.0.0.1",
                "ports": [],
                "params": {},
                "output_dir": str(tmp_path),
                # a channel whose controller is away: the wait step retries until the timeout
                "channel": f"unix://{tmp_path / 'away.sock'}",
                "channel_token": "tm1.x.y",
            },
        },
    )
    pid = agent.start([gated])[0].handle.pid  # type: ignore[union-attr]
    assert agent.observe(["job/gated/1"])[0].phase == InstancePhase.STARTING
    os.kill(pid, signal.SIGKILL)
    status = _exited(agent, ["job/gated/1"])[0]
    assert status.exit_code == 137 and status.command_started_at is None


def test_one_agent_per_state_dir(tmp_path: Path) -> None:
    """Two controllers (here: two processes racing to start one) share a single agent: the
    state dir's flock lets only one serve; the other daemon exits at once."""
    state_dir = tmp_path / "shared"
    code = (
        "import sys; from pathlib import Path; from trainmaster.agent.client import AgentClient\n"
        f"c = AgentClient(Path({str(state_dir)!r}), linger=30); print(c.ping()['pid'])"
    )
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )
            for _ in range(3)
        ]
        pids = {p.communicate(timeout=60)[0].strip() for p in procs}
        assert len(pids) == 1 and pids == {str(agent_pid(state_dir))}
    finally:
        stop_agent(state_dir)
