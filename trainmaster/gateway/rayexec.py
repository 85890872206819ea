"""A per-task executor as a Ray actor, behind the same :class:`~trainmaster.gateway.executor.Executor`
interface as the subprocess executor (a party picks one with ``executor: ray`` in its config).

Each (task, data id) gets its own actor (its own Ray worker process) holding the one data file, so
tasks stay isolated from each other and from the party agent; the actor runs only registered rules
and is killed at the task's deadline. What Ray does not give: POSIX resource limits and a clean
environment per task (Ray's ``num_cpus``/``memory`` are scheduling hints, not caps). The data file
must be readable where the actor runs; with the default local Ray started by the party, it is.
Ray is imported only here, and only when a party asks for it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

from trainmaster.gateway.executor import RuleReply, encode_reply
from trainmaster.gateway.models import RuleCall

_init_lock = threading.Lock()


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
                **({} if address else {"num_cpus": 2}),
            )


class _RuleActor:
    """Lives in its own Ray worker: loads one data file, answers rule calls on it."""

    def __init__(self, data_file: str, allowed: list[str] | None):
        from trainmaster.gateway.rules import load_table

        self.table, self.allowed = load_table(Path(data_file)), allowed

    def ready(self) -> bool:
        return True

    def run(self, call_json: str) -> tuple[dict[str, Any], bytes]:
        from trainmaster.gateway.rules import RuleError, run_call

        try:
            return encode_reply(run_call(self.table, RuleCall.model_validate_json(call_json), self.allowed))
        except RuleError as exc:
            return {"ok": False, "error": str(exc)}, b""
        except Exception as exc:  # a rule failing on this data: report it like the subprocess executor
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""


class RayExecutor:
    """The party's side of one task's Ray actor."""

    def __init__(self, actor: Any, name: str):
        self._actor, self.address, self._dead = actor, f"ray:{name}", False

    @classmethod
    async def start(
        cls,
        data_file: Path,
        deadline_s: float,
        start_timeout_s: float,
        allowed: list[str] | None = None,
        ray_address: str | None = None,
    ) -> "RayExecutor":
        import ray

        await asyncio.to_thread(ensure_ray, ray_address)
        name = f"tm-exec-{uuid.uuid4().hex[:12]}"
        actor = ray.remote(num_cpus=0, max_restarts=0)(_RuleActor).options(name=name).remote(str(data_file), allowed)
        handle = cls(actor, name)
        try:
            await asyncio.wait_for(actor.ready.remote(), timeout=start_timeout_s)
        except Exception as exc:  # timeout, or the actor died loading the data
            handle.kill()
            raise TimeoutError(
                f"Ray executor did not report within {start_timeout_s:.0f}s: {type(exc).__name__}"
            ) from exc
        asyncio.get_running_loop().call_later(deadline_s, handle.kill)
        return handle

    async def call(self, call: RuleCall, timeout_s: float) -> RuleReply:
        """Run the rule in the actor; the result comes back whole through Ray's object store."""
        import ray

        try:
            head, body = await asyncio.wait_for(self._actor.run.remote(call.model_dump_json()), timeout=timeout_s)
        except ray.exceptions.RayError as exc:
            self._dead = True
            raise OSError(f"Ray executor failed: {type(exc).__name__}") from exc
        view, pos = memoryview(body), 0

        async def read(n: int) -> bytes:
            nonlocal pos
            piece = bytes(view[pos : pos + n])
            pos += len(piece)
            return piece

        return RuleReply(head, read)

    @property
    def alive(self) -> bool:
        return not self._dead

    def kill(self) -> None:
        import ray

        if not self._dead:
            self._dead = True
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # already gone, or Ray shut down with the party
                pass
