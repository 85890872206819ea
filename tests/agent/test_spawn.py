"""The node agent's process start (``trainmaster.agent.spawn``, posix_spawn with the interpreter
lock released): the child gets what ``Popen`` gave it (its own session, /dev/null on stdin, the
log on stdout and stderr, the notify pipe at descriptor 3 and no other descriptor of the agent,
default signal dispositions and an empty mask, its working directory, the program found on its
own PATH), and a start the OS refuses is the OSError that names the program or the directory."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from trainmaster.agent import spawn as spawning

pytestmark = pytest.mark.skipif(spawning.spawn is None, reason="libc has no posix_spawn with chdir")

#: Run by /bin/sh (not Python, which ignores SIGPIPE and SIGXFSZ itself): what the spawned process has.
PROBE = (
    "printf notified >&3; "
    "echo sid $(cut -d' ' -f6 /proc/$$/stat) pid $$; "
    "for f in /proc/$$/fd/*; do echo fd${f##*/} $(readlink $f); done; "
    "echo stdin $(readlink /proc/$$/fd/0); echo cwd $(pwd); "
    # read by the shell itself: a child (grep) reading it could catch the shell blocking every
    # signal for a moment while it waits for that child (dash does), a race seen under load
    "while read -r key value; do case $key in SigIgn:|SigBlk:) echo $key $value;; esac; done < /proc/$$/status; "
    "echo to stderr >&2"
)
#: glibc's own signals (SIGCANCEL, SIGSETXID), which its posix_spawn leaves ignored and glibc
#: programs take over at start; every other signal has its default disposition.
GLIBC_INTERNAL = (1 << 31) | (1 << 32)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_the_child_starts_as_popen_started_it(tmp_path: Path) -> None:
    log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    leaked = os.open(tmp_path / "leak", os.O_WRONLY | os.O_CREAT)  # an agent descriptor (close-on-exec)
    read, write = os.pipe()
    old = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the agent (Python) has it
    try:
        env = {"PATH": "/usr/bin:/bin"}
        pid = spawning.spawn(["sh", "-c", PROBE], env, str(tmp_path), log, write)
    finally:
        signal.signal(signal.SIGPIPE, old)
        os.close(write)
        os.close(log)
        os.close(leaked)
    assert _wait(pid) == 0
    assert os.read(read, 64) == b"notified"
    os.close(read)
    seen = dict(line.replace(":", "").split(None, 1) for line in (tmp_path / "log").read_text().splitlines() if line)
    assert seen["to"] == "stderr"
    assert seen["sid"].split() == [str(pid), "pid", str(pid)]  # its own session
    fds = {int(key[2:]): target for key, target in seen.items() if key.startswith("fd")}
    assert fds[0] == "/dev/null" and fds[1] == fds[2] == str(tmp_path / "log") and fds[3].startswith("pipe")
    assert str(tmp_path / "leak") not in fds.values()  # nothing of the agent (beyond 3: the shell's own)
    assert seen["stdin"] == "/dev/null" and seen["cwd"] == str(tmp_path)
    # nothing blocked (SIGTERM must reach it), nothing ignored but glibc's own
    assert int(seen["SigIgn"], 16) & ~GLIBC_INTERNAL == 0 and int(seen["SigBlk"], 16) == 0


def test_refusals_name_the_program_or_the_directory(tmp_path: Path) -> None:
    log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(FileNotFoundError) as missing:
            spawning.spawn(["no-such-program-here"], {"PATH": "/usr/bin:/bin"}, None, log, None)
        assert missing.value.filename == "no-such-program-here"
        with pytest.raises(FileNotFoundError) as no_dir:
            spawning.spawn(["true"], {"PATH": "/usr/bin:/bin"}, str(tmp_path / "gone"), log, None)
        assert no_dir.value.filename == str(tmp_path / "gone")
        script = tmp_path / "not-executable"
        script.write_text("#!/bin/sh\n")
        with pytest.raises(PermissionError):
            spawning.spawn([str(script)], {}, None, log, None)
        with pytest.raises(PermissionError):
            spawning.spawn(["not-executable"], {"PATH": str(tmp_path)}, None, log, None)
    finally:
        os.close(log)


def test_threads_spawn_side_by_side() -> None:
    """The interpreter lock is released while a child is created: a thread spinning in Python
    keeps running while another spawns (with Popen's fork_exec it waited)."""
    import threading

    log = os.open("/dev/null", os.O_WRONLY)
    spins = {"n": 0}
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            spins["n"] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        started = time.perf_counter()
        pids = [spawning.spawn(["true"], {"PATH": "/usr/bin:/bin"}, None, log, None) for _ in range(20)]
        assert time.perf_counter() - started < 30
    finally:
        done.set()
        spinner.join()
        os.close(log)
    assert all(_wait(pid) == 0 for pid in pids) and spins["n"] > 0
