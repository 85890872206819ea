"""A per-task executor as a Ray actor, behind the same :class:`~trainmaster.gateway.executors.base.Executor`
interface as the subprocess executor (a party picks one with ``executor: ray`` in its config).

Each (task, data id) gets its own actor (its own Ray worker process), killed at the task's deadline.
With ``isolation: sandbox`` (the default) the actor does not run rules itself: a Ray worker is
Ray's process (started by the raylet, talking to it and to the object store over the network and
shared memory), so it cannot be put in a network namespace with no route out, a read-only root or
an unprivileged uid. Instead the actor starts the same bubblewrap sandbox a local executor gets
(:class:`~trainmaster.gateway.executors.process.ExecutorHandle` with isolation ``sandbox``) on the node
where Ray placed it, passes it the data file as a read-only descriptor, and relays rule calls to
it over the sandbox's Unix socket: the rule runs in its own namespaces, as uid 65534, under the
seccomp filter and the memory and pids cgroups; the actor only ever holds the result bytes. Ray
gives the placement and the actor's lifetime. With ``isolation: process`` the actor runs the rule
in the Ray worker, as before (no sandbox: Ray's ``num_cpus``/``memory`` are scheduling hints,
not caps). The data file must be readable where the actor runs; with the default local Ray started
by the party, it is. Ray is imported only here, and only when a party asks for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from trainmaster.gateway.executors.base import (
    DigestWriter,
    ExecutorStartError,
    LegFiles,
    RuleReply,
    commit_line,
)
from trainmaster.gateway.rules.registry import REGISTRY
from trainmaster.gateway.models import RuleCall

_init_lock = threading.Lock()
STOP_TIMEOUT_S = 5.0
"""How long a sandboxed actor may take to end its sandbox before the actor is killed anyway."""


def ensure_ray(address: str | None) -> None:
    """Connect to ``address`` (or start a small local Ray) once per party process."""
    import ray

    with _init_lock:
        if not ray.is_initialized():
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                num_cpus=None if address else 2,
            )


class _RuleActor:
    """Lives in its own Ray worker: loads one data file, answers rule calls on it."""

    def __init__(self, data_file: str, allowed: list[str] | None):
        from trainmaster.gateway.rules.registry import load_table

        self.table, self.allowed = load_table(Path(data_file)), allowed

    def ready(self) -> bool:
        return True

    def run(self, call_json: str) -> tuple[dict[str, Any], bytes]:
        from trainmaster.gateway.rules.registry import RuleError, run_call

        try:
            body = json.dumps(
                run_call(self.table, RuleCall.model_validate_json(call_json), self.allowed), separators=(",", ":")
            ).encode()
        except RuleError as exc:
            return {"ok": False, "error": str(exc)}, b""
        except Exception as exc:  # a rule failing on this data: report it like the subprocess executor
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
        return {"ok": True, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}, body


class _SandboxedRuleActor:
    """Lives in its own Ray worker and runs the task's rules in a bubblewrap sandbox on that node."""

    def __init__(
        self, data_file: str, deadline_s: float, start_timeout_s: float, memory_mb: int, allowed: list[str] | None
    ):
        self._start = (Path(data_file), deadline_s, start_timeout_s, memory_mb, allowed)
        self._handle: Any = None

    async def ready(self, label: str) -> str:
        """Start the sandboxed executor; returns its folder (whose name names its cgroups)."""
        from trainmaster.gateway.executors.process import ExecutorHandle

        data_file, deadline_s, start_timeout_s, memory_mb, allowed = self._start
        self._handle = await ExecutorHandle.start(
            data_file, deadline_s, start_timeout_s, memory_mb, allowed, isolation="sandbox", label=label
        )
        return str(self._handle.sandbox.home)

    async def run(self, call_json: str, timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """The rule runs in the sandbox into files of the actor's own (on its node); the bytes come
        back through Ray's object store."""
        with tempfile.TemporaryDirectory(prefix="tm-ray-leg-") as folder:
            files = LegFiles("ray", "leg", Path(folder) / "result", Path(folder) / "commit")
            reply = await self._handle.call(RuleCall.model_validate_json(call_json), files, timeout_s)
            body = files.result.read_bytes() if reply.ok else b""
        return {"ok": reply.ok, "error": reply.error, "size": reply.size, "sha256": reply.sha256}, body

    def stop(self) -> bool:
        """End the sandbox's process tree and remove its cgroups and folder (before the actor goes)."""
        if self._handle is not None:
            self._handle.kill()
        return True


class RayExecutor:
    """The party's side of one task's Ray actor."""

    def __init__(self, actor: Any, name: str, sandboxed: bool = False):
        self._actor, self.address, self._dead, self._sandboxed = actor, f"ray:{name}", False, sandboxed
        self.sandbox_home: Any = None
        self.stopping: asyncio.Task[None] | None = None
        """A sandboxed actor being stopped from the event loop (the party awaits it when it shuts down)."""
        """With isolation ``sandbox``: the sandbox's folder on the actor's node (names its cgroups)."""

    @classmethod
    async def start(
        cls,
        data_file: Path,
        deadline_s: float,
        start_timeout_s: float,
        allowed: list[str] | None = None,
        ray_address: str | None = None,
        isolation: str = "sandbox",
        memory_mb: int = 1024,
        label: str = "",
    ) -> "RayExecutor":
        import ray

        await asyncio.to_thread(ensure_ray, ray_address)
        name = f"tm-exec-{uuid.uuid4().hex[:12]}"
        remote = ray.remote(num_cpus=0, max_restarts=0)
        actor: Any  # Ray's actor handles are typed per class; both classes answer ready/run/stop here
        if isolation == "sandbox":
            actor = (
                remote(_SandboxedRuleActor)
                .options(name=name)
                .remote(str(data_file), deadline_s, start_timeout_s, memory_mb, allowed)
            )
            ready = actor.ready.remote(label)
        else:
            actor = remote(_RuleActor).options(name=name).remote(str(data_file), allowed)
            ready = actor.ready.remote()
        handle = cls(actor, name, sandboxed=isolation == "sandbox")
        try:
            handle.sandbox_home = await asyncio.wait_for(ready, timeout=start_timeout_s)
        except ray.exceptions.RayTaskError as exc:  # its sandbox could not be set up there: say why
            handle.kill()
            raise ExecutorStartError(f"Ray executor's sandbox could not start: {exc.cause}") from exc
        except Exception as exc:  # timeout, or the actor died loading the data
            handle.kill()
            raise TimeoutError(
                f"Ray executor did not report within {start_timeout_s:.0f}s: {type(exc).__name__}"
            ) from exc
        asyncio.get_running_loop().call_later(deadline_s, handle.kill)
        return handle

    async def call(self, call: RuleCall, files: LegFiles, timeout_s: float) -> RuleReply:
        """Run the rule in the actor; the result comes back whole through Ray's object store and the
        party writes it and the run's commit line into the leg's files (a stream rule, which reads an
        input file and writes any size, needs ``executor: subprocess``)."""
        import ray

        if REGISTRY.get(call.rule) is not None and REGISTRY[call.rule].needs_input:
            return RuleReply(False, f"rule {call.rule!r} streams an input; it runs only with executor: subprocess")
        try:
            args = (call.model_dump_json(), timeout_s) if self._sandboxed else (call.model_dump_json(),)
            head, body = await asyncio.wait_for(self._actor.run.remote(*args), timeout=timeout_s)
        except ray.exceptions.RayError as exc:
            self._dead = True
            raise OSError(f"Ray executor failed: {type(exc).__name__}") from exc
        if not head.get("ok"):
            return RuleReply(False, str(head.get("error", "")))
        result, commit, source = files.open_for_run()
        if source is not None:
            os.close(source)
        try:
            out = DigestWriter(result, len(body))
            out.write(body)
            os.write(commit, commit_line(files.task_id, files.data_id, out.size, out.sha256))
        finally:
            os.close(result)
            os.close(commit)
        return RuleReply(True, "", out.size, out.sha256)

    @property
    def alive(self) -> bool:
        return not self._dead

    def kill(self) -> None:
        """Kill the actor; a sandboxed one first ends its sandbox (cgroups and folder removed), for
        up to :data:`STOP_TIMEOUT_S`. Killed without that (Ray gone, the party killed -9), the
        sandbox's executor still ends: it exits when the pipe from its parent closes."""
        if self._dead:
            return
        self._dead = True
        if self._sandboxed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self.stopping = loop.create_task(self._stop_then_kill())
                return
            self._stop_blocking()
        self._kill_actor()

    async def _stop_then_kill(self) -> None:
        try:
            await asyncio.wait_for(self._actor.stop.remote(), timeout=STOP_TIMEOUT_S)
        except Exception:  # the actor is already gone or stuck: kill it anyway
            pass
        self._kill_actor()

    def _stop_blocking(self) -> None:
        import ray

        try:
            ray.get(self._actor.stop.remote(), timeout=STOP_TIMEOUT_S)
        except Exception:  # already gone, or Ray shut down with the party
            pass

    def _kill_actor(self) -> None:
        import ray

        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # already gone, or Ray shut down with the party
            pass
