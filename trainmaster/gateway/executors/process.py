"""The per-task isolated executor: one process tree per (task, data id), holding one data file.

Two isolations, picked by the party's ``isolation`` setting:

- ``sandbox`` (the default): the executor runs in a bubblewrap sandbox (:mod:`trainmaster.gateway.executors.sandbox.bubblewrap`):
  own pid/net/mount/ipc/uts namespaces, read-only root, uid 65534, seccomp filter, cgroup memory
  and pids limits. The party passes the data file as an open descriptor and the executor's
  listening socket as another; the socket file stays in the party's own folder, outside the
  sandbox, whose only writable host directory is that folder's ``task/``.
- ``process``: a plain subprocess as the party's own user in its own session, with a clean
  environment and resource limits (address space, CPU seconds, open files, no file writes): the
  opt-out for hosts without bubblewrap or root, which protects the host far less.

Either way the party kills the whole tree at the task's deadline. The executor listens on a Unix
socket inside a private (0700) directory of the party's; that socket path is the executor address the party
reports to the gateway. The process inside is
:mod:`trainmaster.gateway.executors.worker`; the party reads its replies in chunks, so a result of
tens of MB is never held twice.

:class:`~trainmaster.gateway.executors.base.Executor` is the interface the party uses; :class:`ExecutorHandle` (a subprocess, sandboxed
or not) and ``rayactor.RayExecutor`` (a Ray actor) implement it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trainmaster.gateway.executors.base import ExecutorDied, ExecutorStartError, LegFiles, RuleReply
from trainmaster.gateway.executors.worker import MAX_FRAME, recv_exact
from trainmaster.gateway.models import RuleCall

if TYPE_CHECKING:
    from trainmaster.gateway.executors.sandbox.bubblewrap import Sandbox

ISOLATIONS = ("sandbox", "process")
LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,160}$")
SANDBOX_PIDS = 64
"""Processes and threads one sandboxed executor may have (it needs two threads; BLAS is pinned to one)."""


class ExecutorHandle:
    """The party's side of one executor process tree (sandboxed or a plain subprocess)."""

    def __init__(
        self, proc: asyncio.subprocess.Process, sock_path: str, workdir: str, sandbox: "Sandbox | None" = None
    ):
        self.proc, self.address, self._workdir, self.sandbox = proc, sock_path, workdir, sandbox

    @classmethod
    async def start(
        cls,
        data_file: Path,
        deadline_s: float,
        start_timeout_s: float,
        memory_mb: int,
        allowed: list[str] | None = None,
        silent: bool = False,
        isolation: str = "process",
        label: str = "",
        max_result_bytes: int = 1 << 30,
    ) -> "ExecutorHandle":
        """Start an executor and wait for it to be ready.

        ``label`` (the party passes ``<task id>.<data id>``) prefixes the executor's folder name,
        which also names its sandbox cgroups, so an operator can tell which group serves which task.
        ``max_result_bytes`` caps what a rule run may write (also the executor's file-size rlimit).
        """
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, not {isolation!r}")
        if label and not LABEL.match(label):
            raise ValueError(f"executor label {label!r} must match {LABEL.pattern}")
        workdir = tempfile.mkdtemp(prefix=f"tm-exec-{label}." if label else "tm-exec-")
        os.chmod(workdir, 0o700)
        cpu = int(deadline_s) + 5
        extra = ["--max-result-bytes", str(max_result_bytes)] + (["--allowed", ",".join(allowed)] if allowed else [])
        extra += ["--silent"] if silent else []
        if isolation == "sandbox":
            handle = await cls._start_sandboxed(data_file, workdir, cpu, memory_mb, max_result_bytes, extra)
        else:
            handle = await cls._start_process(data_file, workdir, cpu, memory_mb, max_result_bytes, extra)
        await handle._await_ready(start_timeout_s)
        asyncio.get_running_loop().call_later(deadline_s, handle.kill)
        return handle

    @classmethod
    async def _start_sandboxed(
        cls, data_file: Path, workdir: str, cpu: int, memory_mb: int, max_result_bytes: int, extra: list[str]
    ) -> "ExecutorHandle":
        """The executor inside bubblewrap, reading its data from a descriptor the party opened.

        The party also creates and binds the listening socket, in its own folder outside what the
        sandbox sees, and hands the executor only the descriptor: an executor that could write
        beside its socket could replace it with a symlink and have the party connect elsewhere.
        """
        from trainmaster.gateway.executors.sandbox.bubblewrap import (
            Sandbox,
            SandboxLimits,
            SandboxUnavailable,
            package_parent,
            sandbox_python,
        )

        sock_path = os.path.join(workdir, "executor.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        data_fd = -1
        try:
            listener.bind(sock_path)
            listener.listen(8)
            data_fd = os.open(data_file, os.O_RDONLY | os.O_CLOEXEC)
            args = [
                sandbox_python(),
                "-s",
                "-B",
                "-P",
                "-m",
                "trainmaster.gateway.executors.worker",
                "--listen-fd",
                str(listener.fileno()),
                "--data-fd",
                str(data_fd),
                "--data-name",
                data_file.name,
                *extra,
            ]
            env = {
                "PATH": "/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONPATH": str(package_parent()),
            }
            limits = SandboxLimits(memory_mb=memory_mb, pids=SANDBOX_PIDS, cpu_s=cpu, file_bytes=max_result_bytes)
            sandbox = await Sandbox.start(
                args, home=Path(workdir), limits=limits, env=env, pass_fds=(listener.fileno(), data_fd)
            )
        except (OSError, SandboxUnavailable) as exc:
            shutil.rmtree(workdir, ignore_errors=True)
            raise ExecutorStartError(f"executor sandbox could not be set up: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            listener.close()
            if data_fd >= 0:
                os.close(data_fd)
        return cls(sandbox.proc, sock_path, workdir, sandbox)

    @classmethod
    async def _start_process(
        cls, data_file: Path, workdir: str, cpu: int, memory_mb: int, max_result_bytes: int, extra: list[str]
    ) -> "ExecutorHandle":
        sock_path = os.path.join(workdir, "executor.sock")

        def _limits() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_result_bytes, max_result_bytes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        args = [
            sys.executable,
            "-I",
            "-B",
            "-m",
            "trainmaster.gateway.executors.worker",
            "--socket",
            sock_path,
            "--data",
            str(data_file),
            *extra,
        ]
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
            cwd=workdir,
            start_new_session=True,
            preexec_fn=_limits,
        )
        return cls(proc, sock_path, workdir)

    async def _await_ready(self, start_timeout_s: float) -> None:
        """Wait for the executor's READY line; kill it (and say why) if it does not come."""
        try:
            assert self.proc.stdout is not None
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=start_timeout_s)
            if line.strip() != b"READY":
                code = await asyncio.wait_for(self.proc.wait(), timeout=start_timeout_s)
                how = self.sandbox.describe_exit() if self.sandbox else f"exited with code {code}"
                raise RuntimeError(f"executor {how} before reporting ready")
        except asyncio.TimeoutError as exc:
            self.kill()
            raise TimeoutError(f"executor did not report within {start_timeout_s:.0f}s") from exc
        except RuntimeError as exc:
            self.kill()
            raise TimeoutError(str(exc)) from exc
        except asyncio.CancelledError:  # the leg went (its deadline, a shutdown): nothing half-started stays
            self.kill()
            raise

    def _explain(self, exc: BaseException) -> BaseException:
        """A call that failed because the sandbox killed the executor says so; others pass unchanged."""
        if self.sandbox is not None and self.sandbox.exit_status().memory_killed:
            return ExecutorDied(f"executor {self.sandbox.describe_exit()}")
        return exc

    async def call(self, call: RuleCall, files: LegFiles, timeout_s: float) -> RuleReply:
        """Run the rule call into the leg's files (descriptors passed over the executor's socket)."""
        try:
            return await asyncio.to_thread(self._call, call, files, timeout_s)
        except OSError as exc:
            explained = self._explain(exc)
            if explained is exc:
                raise
            raise explained from exc

    def _call(self, call: RuleCall, files: LegFiles, timeout_s: float) -> RuleReply:
        """The call on a blocking socket in a worker thread: sending descriptors is a ``sendmsg``."""
        request = json.dumps(
            {"task_id": files.task_id, "data_id": files.data_id, "call": call.model_dump(mode="json")},
            separators=(",", ":"),
        ).encode()
        fds = files.open_for_run()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout_s)
                conn.connect(self.address)
                socket.send_fds(conn, [struct.pack(">I", len(request)) + request], [fd for fd in fds if fd is not None])
                head = recv_exact(conn, 4)
                (size,) = struct.unpack(">I", head)
                if size > MAX_FRAME:
                    raise ValueError("executor reply head too large")
                reply = json.loads(recv_exact(conn, size))
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
        return RuleReply(
            bool(reply.get("ok")), str(reply.get("error", "")), int(reply.get("size", 0)), str(reply.get("sha256", ""))
        )

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def kill(self) -> None:
        """Kill the executor's whole process tree and remove its private directory (and cgroups)."""
        if self.sandbox is not None:
            self.sandbox.kill()
            return
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        try:
            if os.path.exists(self.address):
                os.unlink(self.address)
            os.rmdir(self._workdir)
        except OSError:
            pass
