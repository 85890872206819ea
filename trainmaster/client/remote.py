"""The job verbs of a controller service over HTTP: :class:`RemoteTrainmaster`.

One :class:`httpx.Client` carries every request and its token (``Authorization: Bearer``);
state changes send JSON, as the service requires of every client (a browser's cross-site form
cannot). The service's refusals come back as the same errors the local store raises: 404 is
:class:`~trainmaster.client.results.JobNotFound`, 409 :class:`~trainmaster.errors.JobConflict`,
422 a :class:`~trainmaster.errors.UserError` with the service's field paths; other user mistakes
(413) exit 2, the rest 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import httpx

from trainmaster.client.protocol import wait_for
from trainmaster.client.results import (
    CancelResult,
    Deleted,
    JobNotFound,
    JobRef,
    JobStatus,
    ScaleResult,
    ServiceUnreachable,
    Submitted,
    SuspendResult,
)
from trainmaster.errors import JobConflict, UserError
from trainmaster.store.listing import DEFAULT_LIMIT, JobFilter, JobPage

API = "/api/v1"

#: HTTP statuses that mean the user asked for something wrong (exit 2, like any usage error):
#: unknown job or instance, a verb the job's state forbids, an invalid or oversized request.
USER_MISTAKES = {404, 409, 413, 422}


class RemoteTrainmaster:
    """The :class:`~trainmaster.client.protocol.Trainmaster` verbs of the service at ``server``,
    with ``token`` (None: a loopback server that needs none)."""

    def __init__(self, server: str, token: str | None = None, timeout: float = 30):
        self.server = server
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=server, headers=headers, timeout=timeout)

    # ---- reading -------------------------------------------------------------------------------
    def find(self, ref: str | int) -> JobRef:
        found = self.request("GET", f"{API}/jobs/{ref}", params={"events": 0})
        return JobRef(found["id"], found["name"], found["state"])

    def list_jobs(
        self, where: JobFilter | None = None, limit: int = DEFAULT_LIMIT, after: str | None = None
    ) -> JobPage:
        params = {**(where or JobFilter()).params(), "limit": limit, **({"continue": after} if after else {})}
        return JobPage.from_dict(self.request("GET", f"{API}/jobs", params=params))

    def status(self, ref: str | int, events: int = 50) -> JobStatus:
        return cast(JobStatus, self.request("GET", f"{API}/jobs/{ref}", params={"events": events}))

    def wait(self, ref: str | int, timeout: float, states: frozenset[str] | None = None) -> JobRef:
        return wait_for(lambda: self.find(ref), timeout, states, poll=0.5)

    # ---- logs ----------------------------------------------------------------------------------
    def tail(self, ref: str | int, role: str | None = None, index: int = 0, lines: int = 100) -> str:
        params: dict[str, Any] = {"index": index, "tail": lines, **({"role": role} if role else {})}
        try:
            response = self.http.get(f"{API}/jobs/{ref}/logs", params=params)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        raise_for(response)
        return response.text

    def read_log(
        self, ref: str | int, role: str | None = None, index: int = 0, follow: bool = False
    ) -> Iterator[bytes]:
        params: dict[str, Any] = {"index": index, "follow": follow}
        if role:
            params["role"] = role
        try:
            # no read timeout while following: the stream is quiet while the instance is
            with self.http.stream(
                "GET",
                f"{API}/jobs/{ref}/logs",
                params=params,
                timeout=httpx.Timeout(30, read=None if follow else 30),
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise_for(response)
                yield from response.iter_bytes()
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None

    # ---- intents -------------------------------------------------------------------------------
    def submit(self, document: dict[str, Any], lenient: bool = False) -> Submitted:
        """Queue a job document (ours, Kubeflow or Volcano); the service's controller runs it."""
        params = {"lenient": "true"} if lenient else None
        reply = self.request("POST", f"{API}/jobs", json=document, params=params)
        return Submitted(reply["id"], reply["name"], list(reply.get("ignored", [])))

    def cancel(self, ref: str | int) -> CancelResult:
        reply = self.request("POST", f"{API}/jobs/{ref}/cancel")
        return CancelResult(reply["id"], reply["cancelRequested"], "the service stops every instance")

    def scale(self, ref: str | int, role: str, replicas: int) -> ScaleResult:
        reply = self.request("POST", f"{API}/jobs/{ref}/scale", json={"role": role, "replicas": replicas})
        return ScaleResult(reply["id"], reply["role"], reply["replicas"])

    def suspend(self, ref: str | int, suspend: bool = True) -> SuspendResult:
        reply = self.request("POST", f"{API}/jobs/{ref}/{'suspend' if suspend else 'unsuspend'}")
        return SuspendResult(reply["id"], reply["suspended"], reply["changed"])

    def delete(self, ref: str | int) -> Deleted:
        return Deleted(int(self.request("DELETE", f"{API}/jobs/{ref}")["id"]))

    # ---- helpers -------------------------------------------------------------------------------
    def _unreachable(self, exc: Exception) -> UserError:
        return ServiceUnreachable(
            f"cannot reach the controller service at {self.server} ({exc}); start one with "
            "`trainmaster server`, pass another --server URL, or drop --server and "
            "$TRAINMASTER_SERVER to use the local store"
        )

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One call of the service's REST API (its JSON answer; a refusal as a UserError): the
        verbs above, and the queue verbs of :mod:`trainmaster.cli.queues`."""
        if method != "GET" and "json" not in kwargs:
            kwargs["json"] = {}  # a state change is JSON, even when it says nothing more
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        raise_for(response)
        return response.json()


def raise_for(response: httpx.Response) -> None:
    """A reply of 400 or more as a :class:`UserError` with the service's own words."""
    if response.status_code < 400:
        return
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    if not isinstance(body, dict):
        body = {}
    if response.status_code == 422:
        details = body.get("details") or [json.dumps(d) for d in body.get("detail", [])]
        raise UserError(body.get("error", "the controller rejected the request"), details)
    if response.status_code == 401:
        raise UserError(
            f"{body.get('error') or 'the service needs a token'}: give it with $TRAINMASTER_TOKEN, "
            "$TRAINMASTER_TOKEN_FILE or a context (`trainmaster context add NAME --server URL --token-file FILE`)"
        )
    detail = body.get("detail") or body.get("error") or response.text
    if response.status_code == 404:
        raise JobNotFound(str(detail))
    if response.status_code == 409:
        raise JobConflict(str(detail))
    raise UserError(str(detail), exit_code=2 if response.status_code in USER_MISTAKES else 1)
