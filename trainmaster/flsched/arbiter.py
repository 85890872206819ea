"""The node arbiter: one service that leases a federation's nodes to its concurrent runs.

Flower's deployment runtime runs each run's ServerApp as its own process, and each samples
nodes at random, unaware of the others: two runs may send the same node a round at once, and
the node then works for one while the other's round waits on it. The arbiter is the one place
that decides: every run's strategy asks it for its round's nodes (``POST /v1/runs/{run}/lease``
with the nodes connected now), the arbiter schedules all runs asking together with a flsched
scheduler (``JointScheduler``: joint rounds, leases, participation history per run) and leases
the chosen nodes to the run until it releases them (``/release``, its round's replies in). A
node is never leased to two runs at once. A node that disappears is released: when a run
reports it unreachable (``gone``), or when it is missing from the connected nodes a run
reports, its lease ends at once.

Nodes enrol with their device profile (``PUT /v1/devices``: speed shift ``a``, fluctuation
``mu``, bandwidth, as a device reports its state in the spec); runs register their job (``PUT
/v1/runs/{run}``: local epochs, model size, per_round, samples per device) and leave
(``DELETE``). ``GET /v1/leases`` shows every lease, for checks. Inputs are validated (422 with
the field); a round that cannot be scheduled now is 409 with the reasons, and the run's
strategy skips that round.

HTTP (FastAPI on uvicorn, loopback by default); ``ArbiterClient`` is the runs' side (httpx),
with the ``select``/``release`` of a ``JobSelector`` so the Flower strategy takes either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainmaster.flsched.model import Device, Job, ProblemError
from trainmaster.flsched.selector import JointScheduler

NodeId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeProfile(_Strict):
    """A node's device profile (the model's a, mu, bandwidth) under its device id."""

    node: NodeId
    device: NodeId
    a: float = Field(gt=0)
    mu: float = Field(gt=0)
    bandwidth: float = Field(gt=0)

    @field_validator("a", "mu", "bandwidth")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class Enrolment(_Strict):
    profiles: list[NodeProfile] = Field(max_length=100_000)


class RunSpec(_Strict):
    """A run's job: local epochs, model size per round, devices per round, samples per device id."""

    tau: float = Field(ge=0, le=1e6)
    model_bytes: float = Field(ge=0, le=1e13)
    per_round: int = Field(ge=1, le=100_000)
    data: dict[NodeId, int] = Field(max_length=100_000)

    @field_validator("data")
    @classmethod
    def _counts(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [k for k, n in v.items() if n < 0]
        if bad:
            raise ValueError(f"sample counts must be >= 0 (devices {bad[:5]})")
        return v


class LeaseRequest(_Strict):
    online: list[NodeId] = Field(max_length=100_000)
    n: int = Field(ge=1, le=100_000)


class ReleaseRequest(_Strict):
    nodes: list[NodeId] | None = None
    gone: list[NodeId] = Field(default_factory=list, max_length=100_000)


def arbiter_app(service: JointScheduler) -> Any:
    """The FastAPI application around one ``JointScheduler``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="flsched node arbiter", version="1")

    @app.exception_handler(ProblemError)
    async def _problem(_request: Any, exc: ProblemError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"error": exc.message, "details": exc.details})

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.put("/v1/devices")
    def enrol(body: Enrolment) -> dict:
        service.add_devices({p.node: Device(id=p.device, a=p.a, mu=p.mu, bandwidth=p.bandwidth) for p in body.profiles})
        return {"enrolled": len(body.profiles)}

    @app.put("/v1/runs/{run_id}")
    def register(run_id: NodeId, body: RunSpec) -> dict:
        service.add_job(
            Job(id=run_id, tau=body.tau, model_bytes=body.model_bytes, per_round=body.per_round, data=dict(body.data))
        )
        return {"run": run_id}

    @app.delete("/v1/runs/{run_id}")
    def unregister(run_id: NodeId) -> dict:
        service.remove_job(run_id)
        return {"run": run_id, "removed": True}

    @app.post("/v1/runs/{run_id}/lease")
    def lease(run_id: NodeId, body: LeaseRequest) -> dict:
        return {"nodes": service.select(run_id, body.online, body.n)}

    @app.post("/v1/runs/{run_id}/release")
    def release(run_id: NodeId, body: ReleaseRequest) -> dict:
        if body.gone:
            service.forget(body.gone)
        service.release(run_id, body.nodes)
        return {"run": run_id}

    @app.get("/v1/leases")
    def leases() -> dict:
        with service.cond:
            log = [vars(x).copy() for x in service.leases_log]
        return {"holders": service.holders(), "leases": log}

    return app


class ArbiterClient:
    """A run's handle on the arbiter (HTTP): ``select`` and ``release`` as a ``JobSelector``.

    Every call has a timeout; a refusal (409: the round cannot be scheduled now) is raised as
    ``ProblemError`` with the arbiter's reasons, and so is an arbiter that cannot be reached
    (restarting, say), so the strategy skips that round and the next one asks again. A release
    is retried for ``retry_s``: a lease not released ends after the arbiter's lease time."""

    def __init__(self, url: str, run_id: str, timeout: float = 60.0, retry_s: float = 30.0) -> None:
        import httpx

        self.run_id, self.retry_s = run_id, retry_s
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)

    def _call(self, method: str, path: str, body: dict | None = None, retry: bool = False) -> dict:
        import time

        import httpx

        deadline = time.monotonic() + (self.retry_s if retry else 0.0)
        while True:
            try:
                reply = self.http.request(method, path, json=body)
                break
            except httpx.TransportError as exc:
                if time.monotonic() >= deadline:
                    raise ProblemError(
                        f"the arbiter at {self.http.base_url} cannot be reached: {exc!r}",
                        ["the round is skipped; the next round asks again"],
                    ) from None
                time.sleep(1.0)
        if reply.status_code == 409:
            data = reply.json()
            raise ProblemError(data.get("error", "refused"), list(data.get("details", [])))
        reply.raise_for_status()
        return reply.json()

    def register(self, spec: RunSpec) -> None:
        self._call("PUT", f"/v1/runs/{self.run_id}", spec.model_dump(), retry=True)

    def enrol(self, profiles: Sequence[NodeProfile]) -> None:
        self._call("PUT", "/v1/devices", {"profiles": [p.model_dump() for p in profiles]}, retry=True)

    def select(self, client_ids: Sequence[str], n: int) -> list[str]:
        return list(self._call("POST", f"/v1/runs/{self.run_id}/lease", {"online": list(client_ids), "n": n})["nodes"])

    def release(self, clients: Sequence[str] | None = None) -> None:
        """The round is over: its nodes (or only ``clients``) are free again."""
        body = {"nodes": None if clients is None else list(clients)}
        self._call("POST", f"/v1/runs/{self.run_id}/release", body, retry=True)

    def forget(self, clients: Sequence[str]) -> None:
        """These nodes disappeared: whatever run holds them lets them go."""
        self._call("POST", f"/v1/runs/{self.run_id}/release", {"nodes": [], "gone": list(clients)})

    def finish(self) -> None:
        self._call("DELETE", f"/v1/runs/{self.run_id}", retry=True)

    def leases(self) -> dict:
        return self._call("GET", "/v1/leases")

    def close(self) -> None:
        self.http.close()


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    scheduler: str = "sa",
    seed: int | None = None,
    fairness_weight: float = 30.0,
    gather_s: float = 0.5,
    lease_s: float = 600.0,
    state_path: str | None = None,
) -> None:
    """Run the arbiter until killed (uvicorn; one process, one worker: the leases live here, and
    in ``state_path`` when given, from which a restarted arbiter resumes)."""
    import uvicorn

    service = JointScheduler(
        scheduler=scheduler,
        seed=seed,
        weights={"time": 1.0, "fairness": fairness_weight},
        gather_s=gather_s,
        lease_s=lease_s,
        state_path=state_path,
    )
    uvicorn.run(arbiter_app(service), host=host, port=port, log_level="warning", access_log=False)
