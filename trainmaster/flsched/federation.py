"""A local Flower federation on loopback, with the flsched arbiter: real processes throughout.

``LocalFederation`` starts the node arbiter (``trainmaster flsched arbiter``), one Flower
SuperLink and N SuperNodes (Flower's deployment runtime: each SuperNode starts its SuperExec,
which starts a ClientApp process per message; the SuperLink starts a ServerApp process per
run), writes the Flower App (a ``pyproject.toml`` whose components are
``trainmaster.flsched.flower``'s) and the data shards, and submits runs with Flower's own CLI
(``flwr run``). Everything listens on 127.0.0.1 on free ports, under a private ``FLWR_HOME``;
no dataset is downloaded (the jobs are scikit-learn's bundled digits, wine and breast-cancer,
split non-IID as ``runtime.load_job`` does).

Devices: node k gets partition k of every dataset and the profile of device k of
``synthetic.make_straggler_pool`` (a ``stragglers`` share of the pool ``straggler_factor``
times slower), passed as its ``--node-config``; its ClientApp takes that device's time
divided by ``speedup`` (``flower.py``).

The Flower binaries come from the environment that has ``flwr`` (``flower_bin``, default: the
running interpreter's). Every wait has a timeout and names what it waited for. ``close()``
ends every process this federation started and each of their descendants, by pid, TERM then
KILL, and removes the working directory (kept when ``TM_KEEP_FEDERATION=1``, to read its logs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainmaster.errors import UserError

JOBS = {"digits": (2, 0.85), "wine": (1, 0.92), "breast-cancer": (1, 0.93)}
"""The runs' jobs: dataset -> (local epochs, target test accuracy), as the wall-clock runtime's."""
SAMPLE_SCALE = 20
"""Each real sample counts as this many on the device (the shards are small), as in ``fl_problem``."""
MODEL_BYTES = 4.0e6
"""Bytes each round moves per device in the cost model (the link time of the profile)."""
NODE_BATCH = 6
"""SuperNodes started at once."""

APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "flsched-runs"
version = "1.0.0"
description = "FedAvg runs whose nodes a flsched arbiter leases (trainmaster)"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "trainmaster"

[tool.flwr.app.components]
serverapp = "trainmaster.flsched.flower:server_app"
clientapp = "trainmaster.flsched.flower:client_app"

[tool.flwr.app.config]
mode = "train"
dataset = "digits"
target = 0.85
tau = 2
per-round = 3
max-rounds = 60
selection = "flower"
arbiter = ""
data-dir = ""
results-dir = ""
run-name = "run"
seed = 0
num-nodes = 30
sample-scale = {scale}
model-bytes = {model_bytes}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, what: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting; see {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s; see {log}")


def _proc_start(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/pid/stat), to tell it from a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _marked(marker: bytes) -> list[int]:
    """Processes whose environment holds ``marker`` (a ``NAME=value`` entry): every descendant
    inherits it, also one that was orphaned (its parent died, so it hangs off init) before a
    snapshot saw it. Flower's SuperNodes start their SuperExec in a new session, so a process
    group would not hold them."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                pids.append(int(entry.name))
    return pids


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry.name))
    return out


@dataclass(frozen=True)
class FederationOptions:
    """A local federation: ``nodes`` SuperNodes, their device pool drawn from ``seed``."""

    nodes: int = 30
    seed: int = 0
    stragglers: float = 0.25
    straggler_factor: float = 10.0
    speedup: float = 10.0
    fairness_weight: float = 600.0
    gather_s: float = 0.5
    scheduler: str = "sa"

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UserError(f"a federation needs at least one node, got {self.nodes}")
        if self.speedup <= 0:
            raise UserError(f"speedup must be positive, got {self.speedup}")


@dataclass
class LocalFederation:
    """See the module docstring. Use as a context manager: ``with LocalFederation(opts) as fed``."""

    options: FederationOptions = field(default_factory=FederationOptions)
    flower_bin: Path | None = None
    workdir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    tracked: dict[int, str | None] = field(default_factory=dict)  # every pid seen in our trees -> start time

    def __post_init__(self) -> None:
        self.bin = Path(self.flower_bin or Path(sys.executable).parent)
        if not (self.bin / "flower-superlink").exists():
            raise UserError(
                f"Flower's deployment runtime is not installed in {self.bin}",
                ["`make flower-env` makes .venv-flower with flwr; run this from there (.venv-flower/bin/python)"],
            )
        self._own_dir = self.workdir is None
        self.root = Path(self.workdir or tempfile.mkdtemp(prefix="tm-flsched-fed-"))
        self.workdir = self.root
        self.home = self.root / "flwr-home"
        self.app = self.root / "app"
        self.data = self.root / "data"
        self.results = self.root / "results"
        self.logs = self.root / "logs"
        for d in (self.home, self.app, self.data, self.results, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        package_root = str(Path(__file__).resolve().parents[2])  # ServerApp/ClientApp processes import trainmaster
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p),
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # marks every process of this federation, however it was started (see _marked)
            "TM_FEDERATION": f"{os.getpid()}-{uuid.uuid4().hex}",
        }
        self.superlink_port = 0
        self.arbiter_url = ""
        self.node_ports: list[int] = []
        self.devices: list = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.logs / f"{name}.log"
        proc = subprocess.Popen(
            argv,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.root,
        )
        self.procs[name] = proc
        self.tracked[proc.pid] = _proc_start(proc.pid)
        return proc

    def start(self, timeout: float = 600.0) -> None:
        """Data, arbiter, SuperLink, SuperNodes (connected), the app and the CLI's config."""
        from trainmaster.flsched.synthetic import make_straggler_pool

        o = self.options
        self._write_data()
        (self.app / "pyproject.toml").write_text(APP_PYPROJECT.format(scale=SAMPLE_SCALE, model_bytes=MODEL_BYTES))
        port = free_port()
        arbiter = self._spawn(
            "arbiter",
            [
                sys.executable, "-m", "trainmaster", "flsched", "arbiter", "--port", str(port),
                "--scheduler", o.scheduler, "--seed", str(o.seed), "--fairness-weight", str(o.fairness_weight),
                "--gather-s", str(o.gather_s), "--state", str(self.root / "arbiter-state.json"),
            ],
        )  # fmt: skip
        _wait_port(port, "the arbiter", arbiter, timeout, self.logs / "arbiter.log")
        self.arbiter_url = f"http://127.0.0.1:{port}"
        self.superlink_port = free_port()
        link = self._spawn(
            "superlink",
            [
                str(self.bin / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.superlink_port),
            ],
        )
        _wait_port(self.superlink_port, "the SuperLink", link, timeout, self.logs / "superlink.log")
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{self.superlink_port}"\ninsecure = true\n'
        )
        self.devices = make_straggler_pool(o.nodes, o.seed, o.stragglers, o.straggler_factor)
        for first in range(0, o.nodes, NODE_BATCH):  # a few at a time: each imports Flower (a second of CPU)
            batch = range(first, min(o.nodes, first + NODE_BATCH))
            for k in batch:
                self.node_ports.append(free_port())
                self.start_node(k)
            for k in batch:
                _wait_port(
                    self.node_ports[k], f"SuperNode {k}", self.procs[f"node{k}"], timeout, self.logs / f"node{k}.log"
                )
            # registered before the next batch starts: on a busy machine a storm of registrations
            # times out, and each retry is refused as a key already in use, with growing back-off
            self._wait_connected(len(self.node_ports), timeout)

    def start_node(self, k: int) -> subprocess.Popen:
        """(Re)start SuperNode k with its device profile as node config."""
        dev = self.devices[k]
        config = (
            f'partition-id={k} device-id="p{k}" a={dev.a!r} mu={dev.mu!r} bandwidth={dev.bandwidth!r} '
            f'speedup={float(self.options.speedup)!r} data-dir="{self.data}"'
        )
        return self._spawn(
            f"node{k}",
            [
                str(self.bin / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.superlink_port}",
                "--host", "127.0.0.1", "--port", str(self.node_ports[k]), "--node-config", config,
            ],
        )  # fmt: skip

    def _connected(self) -> int:
        total = 0
        for k in range(len(self.node_ports)):
            log = self.logs / f"node{k}.log"
            if log.exists() and "SuperNode ID:" in log.read_text(errors="replace"):
                total += 1
        return total

    def _wait_connected(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._connected() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {self._connected()} of {n} SuperNodes registered with the SuperLink within {timeout:.0f} s"
                )
            time.sleep(0.5)

    def clientapp_restarts(self) -> int:
        """ClientApp processes that came too late for their task so far (Flower gives one 30 s to
        claim it, then starts another): each is refused by its SuperNode with an expired task
        token when it asks for its input. Above zero, the machine is too busy for this federation."""
        total = 0
        for log in self.logs.glob("node*.log"):
            text = log.read_text(errors="replace")
            total += text.count("/v1/runtime/pull-task-input][ApiError:1008]")
        return total

    def _write_data(self) -> None:
        """Every job's non-IID shards, one file per dataset (x/y train and test, shard indices)."""
        from trainmaster.flsched.runtime import load_job

        for name, (tau, target) in JOBS.items():
            job = load_job(name, self.options.nodes, self.options.seed, target, tau=tau)
            arrays: dict[str, Any] = {f"shard_{k}": s for k, s in enumerate(job.shards)}
            arrays.update(
                x_train=job.x_train,
                y_train=job.y_train,
                x_test=job.x_test,
                y_test=job.y_test,
                features=np.array(job.x_train.shape[1]),
                classes=np.array(job.classes),
                shard_sizes=np.array([len(s) for s in job.shards]),
            )
            np.savez(self.data / f"{name}.npz", **arrays)

    # ------------------------------------------------------------------ runs
    def flwr(self, *args: str, timeout: float = 300.0) -> str:
        """Flower's CLI against this federation's SuperLink; its stdout."""
        out = subprocess.run(
            [str(self.bin / "flwr"), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=self.root,
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"flwr {' '.join(args)} failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}"
            )
        return out.stdout

    def submit(self, **config: object) -> str:
        """``flwr run`` of the app with these run-config values; the run id."""
        pairs = []
        for key, value in config.items():
            value = json.dumps(value) if isinstance(value, str) else repr(value)
            pairs.append(f"{key.replace('_', '-')}={value}")
        defaults = {"data-dir": str(self.data), "results-dir": str(self.results), "arbiter": self.arbiter_url}
        for key, value in defaults.items():
            if key not in {p.split("=", 1)[0] for p in pairs}:
                pairs.append(f"{key}={json.dumps(value)}")
        pairs.append(f"num-nodes={self.options.nodes}")
        out = self.flwr("run", str(self.app), "local", "--run-config", " ".join(pairs), "--format", "json")
        data = json.loads(out[out.index("{") :])
        if not data.get("success"):
            raise RuntimeError(f"flwr run was refused: {out}")
        return str(data["run-id"])

    def statuses(self) -> dict[str, str]:
        """Run id -> Flower's status string (e.g. 'finished:completed', 'running'); empty when the
        SuperLink did not answer in time (a busy machine), so that waiting asks again."""
        try:
            out = self.flwr("ls", "local", "--format", "json")
        except subprocess.TimeoutExpired:
            return {}
        data = json.loads(out[out.index("{") :])
        return {str(r["run-id"]): str(r.get("status", "")) for r in data.get("runs", [])}

    def wait(self, run_ids: list[str], timeout: float, poll: float = 5.0) -> dict[str, str]:
        """Wait until every run has finished (Flower's status, asked every ``poll`` seconds: each
        ask is a Flower CLI process); their statuses."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.statuses()
            if all(st.get(r, "").startswith("finished") for r in run_ids):
                return {r: st[r] for r in run_ids}
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs not finished within {timeout:.0f} s: { {r: st.get(r) for r in run_ids} }")
            time.sleep(poll)

    def enrol(self, timeout: float = 900.0) -> int:
        """Every node reports its device profile to the arbiter (a Flower query run); the number
        of nodes enrolled."""
        marker = self.results / "enrol.json"
        marker.unlink(missing_ok=True)
        run = self.submit(mode="enrol", run_name="enrol")
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the nodes did not enrol within {timeout:.0f} s (run {run}); see {self.logs}")
            status = self.statuses().get(run, "")
            if status.startswith("finished") and not marker.exists():
                raise RuntimeError(f"the enrolment run ended {status}; see {self.logs}")
            time.sleep(5.0)
        enrolled = int(json.loads(marker.read_text())["enrolled"])
        if enrolled < self.options.nodes:
            raise RuntimeError(f"only {enrolled} of {self.options.nodes} nodes enrolled; see {self.logs}")
        return enrolled

    def rounds(self, run_name: str) -> list[dict]:
        """A run's per-round records (its ServerApp's results file)."""
        path = self.results / f"{run_name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop_node(self, k: int, sig: int = signal.SIGTERM) -> None:
        """Make SuperNode k disappear (TERM: it leaves; KILL: it crashes)."""
        proc = self.procs[f"node{k}"]
        self._snapshot()
        proc.send_signal(sig)
        proc.wait(timeout=30)

    # ------------------------------------------------------------------ teardown
    def _snapshot(self) -> None:
        """Record every living descendant of the processes we started (with its start time)."""
        kids = _children()
        stack = [p.pid for p in self.procs.values() if p.poll() is None]
        stack += _marked(f"TM_FEDERATION={self.env['TM_FEDERATION']}".encode())
        while stack:
            pid = stack.pop()
            if pid not in self.tracked:
                self.tracked[pid] = _proc_start(pid)
            stack.extend(kids.get(pid, []))

    def _alive(self) -> list[int]:
        return [pid for pid, start in self.tracked.items() if start is not None and _proc_start(pid) == start]

    def close(self, timeout: float = 15.0) -> None:
        """End every process of this federation (TERM, then KILL) and remove its directory."""
        self._snapshot()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self._alive():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout
            while self._alive() and time.monotonic() < deadline:
                for proc in self.procs.values():
                    proc.poll()  # reap our own children
                self._snapshot()
                time.sleep(0.2)
            if not self._alive():
                break
        for proc in self.procs.values():
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        if self._own_dir and os.environ.get("TM_KEEP_FEDERATION") != "1":
            shutil.rmtree(self.root, ignore_errors=True)
