"""The container runtime of instances: podman, detected and configured once, here.

Podman is daemonless, so a container is owned by whoever runs ``podman run`` attached: the node
agent spawns that client as the instance's main process (its exit status is the container's,
its stdout/stderr are the container's, written to the instance log). What the client cannot
guarantee on its own, the agent does through this module: a name per instance attempt (podman
refuses a second container of the same name, so no attempt ever runs twice), a label naming the
agent (so a restarted agent removes what its dead predecessor started), and ``rm -f`` once the
client ended (a SIGKILLed client leaves its container running).

Facts of some machines, handled once in :func:`detect`: ``crun`` fails where cgroups are in
hybrid mode, so podman is told ``--runtime runc``; and where the container's init may not set
resource limits at all (runc's ``setrlimit`` is refused, even to the current values) podman's
default ``nofile``/``nproc`` limits cannot be switched off from its command line, so runc is
called through a small shim that drops the ``rlimits`` of the OCI config (the container
inherits the agent's limits instead). The probe runs an empty root filesystem with a missing
program, so it needs no image.

The agent reaps every child of its process, so exit statuses of podman helper commands run
inside the agent are not trusted: every helper here is judged by its output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmaster.contract import ContainerLaunch

INSTALL_HINT = (
    "install podman and runc (Debian/Ubuntu: 'apt-get install -y podman runc'), or run the "
    "role on this machine's own software with 'runtime: host'"
)
AGENT_LABEL = "trainmaster.agent"
INSTANCE_LABEL = "trainmaster.instance"
ENV_FILE = "container.env"
CID_FILE = "container.cid"
PROBE_TIMEOUT = 60.0
HELPER_TIMEOUT = 60.0
RUNC_PLACES = ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc")
PULL_FLAGS = {"IfNotPresent": "missing", "Never": "never", "Always": "always"}

# The shim podman calls as its OCI runtime where runc may not set rlimits: it edits the bundle's
# config.json (podman writes it on one line) and becomes runc.
SHIM = """#!/bin/sh
# Written by trainmaster.containers.runtime: drops the OCI config's rlimits, then runs runc.
prev=""
for arg in "$@"; do
  if [ "$prev" = "--bundle" ] || [ "$prev" = "-b" ]; then
    sed -i -e 's/,"rlimits":\\[[^]]*\\]//' -e 's/"rlimits":\\[[^]]*\\],//' "$arg/config.json"
  fi
  prev="$arg"
done
exec {runc} "$@"
"""


class ContainerRuntimeMissing(RuntimeError):
    """No usable container runtime here; the message says why and what to do."""


@dataclass(frozen=True)
class ContainerRuntime:
    """How to call podman on this machine."""

    podman: str  # path of the podman program
    oci_runtime: str  # what follows ``--runtime``: "runc", or the shim's path

    def base(self) -> list[str]:
        return [self.podman, "--runtime", self.oci_runtime]


def _runc() -> str | None:
    found = shutil.which("runc")
    if found:
        return found
    return next((p for p in RUNC_PLACES if os.access(p, os.X_OK)), None)


def _shim_path(runc: str) -> Path:
    """Stable (podman records a container's runtime path), one per runc path and shim text."""
    text = SHIM.format(runc=runc)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "trainmaster" / "oci"
    path = folder / f"runc-without-rlimits-{digest}"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as tmp:
            tmp.write(text)
        os.chmod(tmp.name, 0o755)
        os.replace(tmp.name, path)
    return path


def _probe(podman: str, oci_runtime: str) -> str:
    """Run a missing program in an empty root filesystem: podman's error says whether the
    runtime itself works (the program is not found) or fails before it (rlimits, cgroups)."""
    with tempfile.TemporaryDirectory(prefix="tm-probe-") as rootfs:
        try:
            done = subprocess.run(
                [
                    podman,
                    "--runtime",
                    oci_runtime,
                    "run",
                    "--rm",
                    "--network",
                    "host",
                    "--rootfs",
                    rootfs,
                    "/trainmaster-probe",
                ],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return f"podman did not answer a probe within {PROBE_TIMEOUT:g}s"
    err = done.stderr.strip()
    if "trainmaster-probe" in err and ("not found" in err or "no such file" in err.lower()):
        return ""
    return err.splitlines()[-1] if err else f"podman probe exited with {done.returncode} and said nothing"


@functools.lru_cache(maxsize=1)
def _detect() -> ContainerRuntime | str:
    podman = shutil.which("podman")
    if podman is None:
        return f"podman is not installed: {INSTALL_HINT}"
    runc = _runc()
    if runc is None:
        return f"podman is installed but runc is not (crun fails on hybrid cgroups): {INSTALL_HINT}"
    problem = _probe(podman, runc)
    if not problem:
        return ContainerRuntime(podman, runc)
    if "rlimit" in problem:
        shim = str(_shim_path(runc))
        second = _probe(podman, shim)
        if not second:
            return ContainerRuntime(podman, shim)
        problem = f"{problem}; without rlimits: {second}"
    return f"podman cannot run a container here ({problem}): {INSTALL_HINT}"


def detect() -> ContainerRuntime:
    """The runtime of this machine (probed once per process), or :class:`ContainerRuntimeMissing`."""
    found = _detect()
    if isinstance(found, str):
        raise ContainerRuntimeMissing(found)
    return found


def unavailable() -> str:
    """Empty when containers can run here, else why not and what to do."""
    found = _detect()
    return found if isinstance(found, str) else ""


def container_name(node_key: str, instance_id: str) -> str:
    """One name per agent and instance attempt: podman refuses a second container by that name."""
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in instance_id.replace("/", "."))
    return f"tm-{node_key}-{safe}"[:250]


def run_argv(
    runtime: ContainerRuntime,
    launch: ContainerLaunch,
    *,
    name: str,
    node_key: str,
    instance_id: str,
    env_file: str,
    cid_file: str,
    cpu: float,
    memory: int,
    cgroup_parent: str | None = None,
) -> list[str]:
    """``podman run`` attached, for one instance attempt.

    The container shares its node's network namespace, so addresses and ports work as for
    processes: ``--network host`` is the namespace podman itself runs in, the agent's, which for
    a testbed host's agent is that host's (``ns:/run/netns/...`` would be refused there: runc
    sees the namespace it is in and rejects podman's default network sysctls). The environment
    comes from ``env_file`` (written just before, once the instance's environment is resolved);
    resources map onto ``--cpus``/``--memory``. With a
    ``cgroup_parent`` (the agent's, holding the memory limit) the container's cgroup goes below
    it, so its memory, CPU and OOM kills are counted where they outlive the container."""
    argv = [
        *runtime.base(),
        "run",
        "--name",
        name,
        "--label",
        f"{AGENT_LABEL}={node_key}",
        "--label",
        f"{INSTANCE_LABEL}={instance_id}",
        "--network",
        "host",
        "--pull",
        PULL_FLAGS[launch.pull_policy],
        "--env-file",
        env_file,
        "--cidfile",
        cid_file,
        "--stop-timeout",
        "0",
    ]
    if cgroup_parent:
        argv += ["--cgroup-parent", cgroup_parent]
    if cpu > 0:
        argv += ["--cpus", f"{cpu:g}"]
    if memory > 0:
        argv += ["--memory", str(memory), "--memory-swap", str(memory)]
    if launch.working_dir:
        argv += ["--workdir", launch.working_dir]
    for mount in launch.mounts:
        options = "ro" if mount.get("read_only") else "rw"
        argv += ["--volume", f"{mount['source']}:{mount['target']}:{options}"]
    if launch.command is not None:  # replaces ENTRYPOINT; CMD is then dropped unless args given
        argv += ["--entrypoint", json.dumps(launch.command)]
    argv.append(launch.image)
    if launch.args is not None:
        argv += launch.args
    return argv


def write_env_file(path: str | Path, env: dict[str, str]) -> None:
    """The container's environment as podman's ``--env-file`` (one ``KEY=VALUE`` a line).

    A value with a line break cannot be written so; it is refused by name rather than cut."""
    lines = []
    for key, value in env.items():
        if "\n" in value or "\n" in key or "=" in key:
            raise ValueError(
                f"environment variable {key!r} cannot be passed to a container "
                "(a line break in its name or value, or '=' in its name)"
            )
        lines.append(f"{key}={value}\n")
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


def _helper(argv: list[str]) -> str:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=HELPER_TIMEOUT, stdin=subprocess.DEVNULL
        ).stdout
    except subprocess.TimeoutExpired:
        return ""


def inspect(runtime: ContainerRuntime, names: list[str]) -> dict[str, dict[str, Any]]:
    """Name -> podman's State of each container that exists (a missing one is left out)."""
    if not names:
        return {}
    out = _helper([*runtime.base(), "container", "inspect", *names])
    try:
        found = json.loads(out) if out.strip() else []
    except json.JSONDecodeError:
        return {}
    return {item["Name"].lstrip("/"): item.get("State", {}) for item in found if isinstance(item, dict)}


def remove(runtime: ContainerRuntime, names: list[str]) -> list[str]:
    """Kill and remove containers (``rm -f``); returns the names still present afterwards."""
    if not names:
        return []
    _helper([*runtime.base(), "rm", "--force", "--time", "0", "--ignore", *names])
    left = set(_helper([*runtime.base(), "ps", "--all", "--format", "{{.Names}}"]).split())
    return [n for n in names if n in left]


def labelled(runtime: ContainerRuntime, node_key: str) -> list[str]:
    """Names of every container a node agent with this key started (live or not)."""
    out = _helper(
        [*runtime.base(), "ps", "--all", "--filter", f"label={AGENT_LABEL}={node_key}", "--format", "{{.Names}}"]
    )
    return out.split()


def cgroup_usage(group: str) -> tuple[float, int] | None:
    """CPU seconds and peak memory of a cgroup (v1, ``group`` relative to each hierarchy), or
    None where it is not there."""
    group = group.strip("/")
    try:
        cpu_ns = int(Path(f"/sys/fs/cgroup/cpuacct/{group}/cpuacct.usage").read_text())
        peak = int(Path(f"/sys/fs/cgroup/memory/{group}/memory.max_usage_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return cpu_ns / 1e9, peak


def oom_kills(group: str) -> int:
    """How often a v1 memory cgroup hit its limit: its ``oom_kill`` count where the kernel counts
    kills of descendants there, else ``failcnt`` (the caller pairs it with a SIGKILL exit)."""
    folder = Path(f"/sys/fs/cgroup/memory/{group.strip('/')}")
    try:
        text = (folder / "memory.oom_control").read_text()
        failcnt = int((folder / "memory.failcnt").read_text())
    except (OSError, ValueError):
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and int(value) > 0:
            return int(value)
    return failcnt


def remove_cgroup(group: str) -> None:
    """Remove an (empty) v1 cgroup from every hierarchy podman created it in."""
    root = Path("/sys/fs/cgroup")
    for hierarchy in root.iterdir():
        try:
            (hierarchy / group.strip("/")).rmdir()
        except OSError:
            pass
