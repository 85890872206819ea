"""Run one task's process tree in a bubblewrap sandbox with its own cgroups.

Why: a task's executor holds one party's data file and runs rules on the initiator's parameters. If
anything in it is ever subverted, it must not reach the party's keys, other tasks, the network or
the host's memory. So each executor runs

- in new pid, net (loopback only, down), mount, ipc, uts and cgroup namespaces (``bwrap --unshare-*``);
- on an empty read-only root holding only ``/usr``, the Python installation, the virtualenv and the
  ``trainmaster`` package (read-only, at their host paths so the interpreter finds them), a private
  ``/tmp`` (tmpfs) and its task folder at ``/task``, the only writable host directory;
- reachable only through descriptors the party passes: the data file, opened read-only, and (for
  an executor) its listening Unix socket, bound by the party outside the task folder;
- as uid/gid 65534 (``nobody``) with no capabilities: bubblewrap runs as root (privileged mode, so
  no user namespace maps the sandbox back to host root) and ``setpriv`` drops to 65534 as the last
  step before the executor starts;
- under a seccomp filter (:mod:`trainmaster.gateway.executors.sandbox.seccomp`) and ``no_new_privs``;
- in ``memory`` and ``pids`` cgroups ``trainmaster-gateway/<name>`` (v1 hierarchies, or cgroup
  v2) that the launching child joins before it executes bubblewrap, so nothing of the tree ever
  runs outside them.

The data file is not mounted: the party opens it and passes the open descriptor (a file readable
only by the party stays so; the sandbox holds exactly that one file). The party reaches the
executor over that Unix socket, which works across network namespaces; since the sandbox cannot
write where the socket file is, it cannot swap it for a symlink to some other socket.

Everything here needs root (cgroup creation, the uid drop), bubblewrap and the cgroup ``memory``
and ``pids`` controllers; :func:`unavailable_reason` says which is missing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainmaster.gateway.executors.sandbox.seccomp import SeccompUnavailable, deny_list_program

log = logging.getLogger(__name__)

SANDBOX_UID = SANDBOX_GID = 65534
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "trainmaster-gateway"
CONTROLLERS = ("memory", "pids")
TASK_DIR_INSIDE = "/task"
STALE_GROUP_AGE_S = 60.0
"""An empty group older than this is left over from a party killed -9 and may be removed."""
KILL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox resource limits: cgroup memory and pids, and rlimits for CPU time and files."""

    memory_mb: int
    pids: int = 64
    cpu_s: int = 3600
    open_files: int = 64
    file_bytes: int | None = None
    """The largest file it may write (RLIMIT_FSIZE; default: its memory limit)."""


@dataclass(frozen=True)
class SandboxExit:
    """How a sandbox ended, in words a party operator or initiator can act on."""

    memory_killed: bool
    pids_refused: int
    returncode: int | None

    def describe(self, limits: SandboxLimits) -> str:
        if self.memory_killed:
            return f"killed by the kernel: it exceeded its memory limit of {limits.memory_mb} MB"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        if self.returncode is not None:
            return f"exited with code {self.returncode}"
        return "still running"


@functools.cache
def cgroup_version() -> int | None:
    """1 where cgroup v1 ``memory`` and ``pids`` hierarchies are mounted (also hybrid hosts), 2 on a
    unified (v2-only) host whose root offers both controllers, None otherwise."""
    if all((CGROUP_ROOT / ctl / "cgroup.procs").exists() for ctl in CONTROLLERS):
        return 1
    try:
        offered = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    return 2 if all(ctl in offered for ctl in CONTROLLERS) else None


def parent_dirs() -> list[Path]:
    """Where the sandbox groups live: one parent per controller (v1) or a single one (v2)."""
    if cgroup_version() == 2:
        return [CGROUP_ROOT / CGROUP_PARENT]
    return [CGROUP_ROOT / ctl / CGROUP_PARENT for ctl in CONTROLLERS]


def group_dirs(name: str) -> list[Path]:
    """The host directories of the sandbox group ``name`` (what must be gone once it ended)."""
    return [parent / name for parent in parent_dirs()]


def _enable_controllers(parent: Path) -> None:
    """cgroup v2: let ``parent``'s children use memory and pids (needs a parent without processes)."""
    enabled = (parent / "cgroup.subtree_control").read_text().split()
    missing = [ctl for ctl in CONTROLLERS if ctl not in enabled]
    if missing:
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{ctl}" for ctl in missing))


@dataclass
class SandboxCgroups:
    """One sandbox's memory and pids groups, created empty, joined before exec, removed at the end.

    cgroup v1: ``memory/trainmaster-gateway/<name>`` and ``pids/trainmaster-gateway/<name>``;
    cgroup v2: ``trainmaster-gateway/<name>`` with both controllers (``paths`` maps each controller
    to its directory either way, so the rest does not care which).
    """

    name: str
    version: int
    paths: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, limits: SandboxLimits) -> "SandboxCgroups":
        version = cgroup_version()
        if version is None:
            raise OSError(f"no cgroup memory and pids controllers under {CGROUP_ROOT}")
        group = cls(name, version)
        limit = str(limits.memory_mb << 20)
        try:
            if version == 2:
                _enable_controllers(CGROUP_ROOT)
                (CGROUP_ROOT / CGROUP_PARENT).mkdir(exist_ok=True)
                _enable_controllers(CGROUP_ROOT / CGROUP_PARENT)
                path = CGROUP_ROOT / CGROUP_PARENT / name
                path.mkdir()
                group.paths = {ctl: path for ctl in CONTROLLERS}
                (path / "memory.max").write_text(limit)
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
                (path / "memory.oom.group").write_text("1")  # an OOM kill takes the whole sandbox
            else:
                for ctl in CONTROLLERS:
                    path = CGROUP_ROOT / ctl / CGROUP_PARENT / name
                    path.mkdir(parents=True)
                    group.paths[ctl] = path
                mem = group.paths["memory"]
                (mem / "memory.limit_in_bytes").write_text(limit)
                if (mem / "memory.memsw.limit_in_bytes").exists():  # swap counts too, where accounted
                    (mem / "memory.memsw.limit_in_bytes").write_text(limit)
            (group.paths["pids"] / "pids.max").write_text(str(limits.pids))
        except BaseException:
            group.remove()
            raise
        return group

    def _dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.paths.values()))

    def join_self(self) -> None:
        """Move the calling process into the group(s) (called in the child before it executes bwrap)."""
        pid = str(os.getpid()).encode()
        for path in self._dirs():
            fd = os.open(path / "cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def pids(self) -> list[int]:
        try:
            text = (self.paths["pids"] / "cgroup.procs").read_text()
        except (KeyError, FileNotFoundError):
            return []
        return [int(x) for x in text.split()]

    def memory_usage(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int((self.paths["memory"] / name).read_text())

    def set_memory_limit(self, limit_bytes: int) -> None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        (self.paths["memory"] / name).write_text(str(limit_bytes))

    def memory_killed(self) -> bool:
        """Whether the kernel's OOM killer killed a process of this group (``oom_kill`` counter)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (self.paths["memory"] / name).read_text().splitlines())
        except (KeyError, FileNotFoundError):
            return False
        return int(fields.get("oom_kill", "0")) > 0

    def pids_refused(self) -> int:
        """How many forks the pids limit refused (``pids.events``: ``max N``)."""
        try:
            return int((self.paths["pids"] / "pids.events").read_text().split()[1])
        except (KeyError, FileNotFoundError, IndexError, ValueError):
            return 0

    def kill_all(self, timeout_s: float = KILL_TIMEOUT_S) -> bool:
        """SIGKILL every process in the group until it is empty; False if it did not empty in time.

        Processes can fork while being killed (up to the pids limit), hence the rounds; each round
        waits a little for the kernel to finish the exits it started. cgroup v2's ``cgroup.kill``
        does the same in one write where the kernel has it.
        """
        kill_file = self.paths.get("pids", Path("/nonexistent")) / "cgroup.kill"
        if self.version == 2 and kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> bool:
        """Remove the group(s) (they must be empty); True when none is left."""
        left = False
        for path in self._dirs():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("sandbox cgroup %s not removed: %s", path, exc)
                left = True
                continue
            self.paths = {ctl: p for ctl, p in self.paths.items() if p != path}
        return not left


def sweep_stale_groups(home_root: Path, min_age_s: float = STALE_GROUP_AGE_S) -> list[Path]:
    """Remove empty sandbox groups left by a party that was killed -9, and their host folders.

    The kernel refuses to remove a group that still has processes, so a live sandbox is never
    touched; the age check keeps a group another party has just created (and not yet joined) safe.
    A group is named after its sandbox's home folder, so ``home_root/<group>`` goes with it.
    """
    removed = []
    now = time.time()
    for parent in parent_dirs():
        if not parent.is_dir():
            continue
        for group in parent.iterdir():
            try:
                if not group.is_dir() or now - group.stat().st_mtime < min_age_s:
                    continue
                group.rmdir()
                removed.append(group)
            except OSError:
                continue  # busy (still has processes) or already gone
            folder = home_root / group.name
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
    return removed


def _python_roots() -> list[Path]:
    """Host directories the interpreter needs: the base installation, the venv, the package's parent."""
    import trainmaster

    roots = {
        Path(os.path.realpath(sys.base_prefix)),
        Path(os.path.realpath(sys.prefix)),
        Path(os.path.realpath(Path(trainmaster.__file__).parent)),
    }
    return sorted(r for r in roots if r != Path("/usr") and Path("/usr") not in r.parents)  # /usr is bound whole


def package_parent() -> Path:
    import trainmaster

    return Path(os.path.realpath(Path(trainmaster.__file__).parent)).parent


def sandbox_python() -> str:
    """The interpreter path inside the sandbox: the venv's python, so its site-packages are found."""
    prefix = Path(os.path.realpath(sys.prefix))
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3", "python"):
        if (prefix / "bin" / name).exists():
            return str(prefix / "bin" / name)
    return os.path.realpath(sys.executable)


def _dirs_for(target: Path, made: set[str]) -> list[str]:
    """``--perms 0755 --dir`` for each ancestor of a bind target, so no ancestor copies a 0700 mode."""
    args: list[str] = []
    for parent in reversed(target.parents):
        p = str(parent)
        if p == "/" or p in made:
            continue
        made.add(p)
        args += ["--perms", "0755", "--dir", p]
    return args


def bwrap_args(task_dir: Path, seccomp_fd: int) -> list[str]:
    """The bubblewrap command line up to (not including) the command it runs."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise FileNotFoundError("bwrap")
    args = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "executor",
        "--die-with-parent",
        "--new-session",
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",  # only for setpriv's drop to 65534
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for link in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / link
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    # /tmp first: a Python or a checkout that lives under /tmp (a CI clone, say) is bound on top of it
    args += ["--tmpfs", "/tmp"]
    made: set[str] = set()
    for root in _python_roots():
        args += _dirs_for(root, made) + ["--ro-bind", str(root), str(root)]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--bind",
        str(task_dir),
        TASK_DIR_INSIDE,
        "--remount-ro",
        "/",
        "--chdir",
        TASK_DIR_INSIDE,
        "--seccomp",
        str(seccomp_fd),
    ]
    return args


def drop_privileges_args() -> list[str]:
    """``setpriv`` to uid/gid 65534 with no supplementary groups and no capabilities left."""
    return [
        "/usr/bin/setpriv",
        "--reuid",
        str(SANDBOX_UID),
        "--regid",
        str(SANDBOX_GID),
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


@functools.cache
def unavailable_reason() -> str | None:
    """Why the sandbox cannot run on this host, or None when a trial sandbox started and ran."""
    if sys.platform != "linux":
        return "executor sandboxing needs Linux"
    if os.geteuid() != 0:
        return "executor sandboxing needs root (to create cgroups and drop the executor to uid 65534)"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap (or make sandbox-deps)"
    if not Path("/usr/bin/setpriv").exists():
        return "setpriv (util-linux) is not installed at /usr/bin/setpriv"
    if cgroup_version() is None:
        return (
            f"no cgroup memory and pids controllers: neither v1 hierarchies at {CGROUP_ROOT}/{{memory,pids}} "
            f"nor a cgroup v2 root at {CGROUP_ROOT} offering both"
        )
    try:
        deny_list_program()
    except SeccompUnavailable as exc:
        return str(exc)
    try:
        SandboxCgroups.create(f"probe-{os.getpid()}", SandboxLimits(memory_mb=64)).remove()
    except OSError as exc:
        return f"cannot create sandbox cgroups {', '.join(map(str, group_dirs('<name>')))}: {exc}"
    probe_dir = Path(tempfile.mkdtemp(prefix="tm-sandbox-probe-"))
    seccomp_fd = _seccomp_fd()
    try:
        out = subprocess.run(
            bwrap_args(probe_dir, seccomp_fd) + drop_privileges_args() + ["/usr/bin/id", "-u"],
            capture_output=True,
            timeout=30,
            pass_fds=(seccomp_fd,),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"a trial bubblewrap sandbox could not run: {exc}"
    finally:
        os.close(seccomp_fd)
        shutil.rmtree(probe_dir, ignore_errors=True)
    if out.returncode != 0 or out.stdout.strip() != str(SANDBOX_UID).encode():
        return (
            f"a trial bubblewrap sandbox failed (code {out.returncode}): {out.stderr.decode(errors='replace')[-300:]}"
        )
    return None


def _seccomp_fd() -> int:
    """An fd positioned at the start of the compiled filter (bubblewrap reads it to the end)."""
    fd = os.memfd_create("trainmaster-seccomp", 0)
    os.write(fd, deny_list_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Sandbox:
    """One sandboxed process tree: its bubblewrap process, cgroups and host folder.

    ``home`` is a host folder the caller created for this sandbox (its name names the cgroups);
    the sandbox sees only ``home/task``, at ``/task``, writable and its working directory. The
    rest of ``home`` is the party's (the executor's listening socket lives there, out of reach).
    ``argv`` runs inside as uid 65534; ``pass_fds`` are inherited at the same numbers.
    :meth:`kill` ends the whole tree and removes the cgroups and ``home``; it is safe to call twice.
    """

    def __init__(self, proc: asyncio.subprocess.Process, cgroups: SandboxCgroups, home: Path, limits: SandboxLimits):
        self.proc, self.cgroups, self.home, self.limits = proc, cgroups, home, limits
        self._exit: SandboxExit | None = None

    @classmethod
    async def start(
        cls,
        argv: list[str],
        *,
        home: Path,
        limits: SandboxLimits,
        env: dict[str, str],
        pass_fds: tuple[int, ...] = (),
        stdout: int = asyncio.subprocess.PIPE,
        stderr: int = asyncio.subprocess.DEVNULL,
    ) -> "Sandbox":
        reason = unavailable_reason()
        if reason is not None:
            raise SandboxUnavailable(reason)
        sweep_stale_groups(home.parent)
        os.chmod(home, 0o700)
        task_dir = home / "task"
        task_dir.mkdir(mode=0o700)
        os.chown(task_dir, SANDBOX_UID, SANDBOX_GID)
        cgroups = SandboxCgroups.create(home.name, limits)
        seccomp_fd = -1
        try:
            seccomp_fd = _seccomp_fd()

            def _in_child() -> None:
                # Runs after fork, before exec: join the groups first, so bwrap and all it starts
                # are limited from their first instruction; then the rlimits the cgroups lack.
                cgroups.join_self()
                resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
                resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                file_cap = limits.file_bytes if limits.file_bytes is not None else limits.memory_mb << 20
                resource.setrlimit(resource.RLIMIT_FSIZE, (file_cap, file_cap))

            env = {**env, "HOME": "/tmp", "TMPDIR": "/tmp"}
            proc = await asyncio.create_subprocess_exec(
                *bwrap_args(task_dir, seccomp_fd),
                *drop_privileges_args(),
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                env=env,
                pass_fds=(seccomp_fd, *pass_fds),
                start_new_session=True,
                preexec_fn=_in_child,
            )
        except BaseException:
            cgroups.kill_all()
            cgroups.remove()
            raise
        finally:
            if seccomp_fd >= 0:
                os.close(seccomp_fd)
        return cls(proc, cgroups, home, limits)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def exit_status(self) -> SandboxExit:
        """What ended (or is ending) the sandbox; the counters survive until :meth:`kill` removes the groups."""
        if self._exit is not None:
            return self._exit
        return SandboxExit(self.cgroups.memory_killed(), self.cgroups.pids_refused(), self.proc.returncode)

    def describe_exit(self) -> str:
        return self.exit_status().describe(self.limits)

    def kill(self) -> None:
        """Kill every process of the sandbox, then remove its cgroups and host folder."""
        if self._exit is None:
            self._exit = SandboxExit(self.cgroups.memory_killed(), self.cgroups.pids_refused(), self.proc.returncode)
        if not self.cgroups.kill_all():
            log.warning("sandbox %s: processes still running after %.0fs of SIGKILL", self.cgroups.name, KILL_TIMEOUT_S)
        self.cgroups.remove()
        shutil.rmtree(self.home, ignore_errors=True)


class SandboxUnavailable(RuntimeError):
    """The host cannot run the sandbox; the message says what is missing and how to get it."""
