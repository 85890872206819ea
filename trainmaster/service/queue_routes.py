"""REST routes of queues with quota and of "why pending" (``/api/v1/queues``, ``/api/v1/jobs/{ref}/explain``).

A queue is validated by :class:`~trainmaster.spec.queue.QueueSpec` (422 with the field path);
an unknown queue or job is 404, a queue that exists already (POST) or still holds jobs (DELETE)
409. A change wakes the reconcile loop, which applies the new quota in its next pass.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, FastAPI, HTTPException
from fastapi import Path as PathParam

from trainmaster.api import LocalTrainmaster
from trainmaster.controller import Controller
from trainmaster.controller.quota_status import explain, queue_view, queue_views
from trainmaster.errors import UserError
from trainmaster.spec.queue import QueueSpec
from trainmaster.store import queues as queue_store
from trainmaster.store.models import QueueRow

API = "/api/v1"

QueueName = Annotated[str, PathParam(min_length=1, max_length=63, description="Queue name")]
JobRef = Annotated[str, PathParam(min_length=1, max_length=63, description="Job name, uid or id")]


def register_queue_routes(app: FastAPI, controller: Controller, jobs: LocalTrainmaster) -> None:
    """Add the queue and explain routes to the service's app."""
    sessions = controller.sessions

    def not_found(exc: UserError) -> HTTPException:
        return HTTPException(status_code=404, detail=exc.message)

    @app.get(f"{API}/queues", tags=["queues"])
    def list_queues() -> list[dict[str, Any]]:
        """Every queue with quota: its quota, usage, borrowed share, admitted and waiting jobs."""
        with sessions() as session:
            return queue_views(session)

    @app.post(f"{API}/queues", status_code=201, tags=["queues"])
    def create_queue(queue: QueueSpec = Body(..., description="A queue with quota")) -> dict[str, Any]:
        """Create a queue with quota (409 when one of that name exists: PUT replaces it)."""
        return _save(queue, replace=False)

    @app.put(f"{API}/queues/{{name}}", tags=["queues"])
    def replace_queue(name: QueueName, queue: QueueSpec = Body(...)) -> dict[str, Any]:
        """Create or replace a queue's quota; the body's name must be the path's."""
        if queue.name != name:
            raise UserError(
                f"the queue in the body is '{queue.name}', the path names '{name}'",
                ["name: must be the queue named in the path"],
            )
        return _save(queue, replace=True)

    @app.get(f"{API}/queues/{{name}}", tags=["queues"])
    def show_queue(name: QueueName) -> dict[str, Any]:
        """A queue: quota, usage, its admitted jobs and its first waiting jobs in order."""
        with sessions() as session:
            try:
                return queue_view(session, name)
            except queue_store.QueueNotFound as exc:
                raise not_found(exc) from None

    @app.delete(f"{API}/queues/{{name}}", tags=["queues"])
    def delete_queue(name: QueueName) -> dict[str, Any]:
        """Delete a queue's quota (409 while a job not ended is in it)."""
        with sessions() as session:
            try:
                queue_store.delete_queue(session, name)
            except queue_store.QueueNotFound as exc:
                raise not_found(exc) from None
            session.commit()
        controller.wake()
        return {"name": name, "deleted": True}

    @app.get(f"{API}/jobs/{{ref}}/explain", tags=["jobs"])
    def explain_job(ref: JobRef) -> dict[str, Any]:
        """Why a job is not running: what quota or capacity blocks it, by how much, its position."""
        found = jobs.find(ref)  # 404 for an unknown job, as every job route
        with sessions() as session:
            return explain(session, found.id)

    def _save(queue: QueueSpec, replace: bool) -> dict[str, Any]:
        with sessions() as session:
            row: QueueRow = queue_store.save_queue(session, queue, replace=replace)
            session.commit()
            document = queue_store.queue_document(row)
        controller.wake()
        return document
