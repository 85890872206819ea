"""Taking a job into the service's queue: the one path the REST API and the dashboard share.

Loading applies the operator's path policy and strictness; the backend named in the job must be
the server's; a name is unique among active jobs (checked and inserted in one step per server).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from trainmaster.controller import Controller
from trainmaster.errors import UserError
from trainmaster.spec.load import LoadedJob, LoadOptions, load_document
from trainmaster.spec.paths import PathPolicy
from trainmaster.spec.states import JOB_TERMINAL
from trainmaster.store.models import JobRow


class NameTaken(Exception):
    """A job of that name is still active (HTTP 409)."""


@dataclass
class Submission:
    controller: Controller
    paths: PathPolicy

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # a name check and its insert are one step

    def load(self, document: dict[str, Any], lenient: bool = False, source: str = "submitted job") -> LoadedJob:
        """Validate a job document as this server will run it; a :class:`UserError` lists every problem."""
        loaded = load_document(document, source=source, options=LoadOptions(paths=self.paths, lenient=lenient))
        wanted = loaded.job.spec.scheduling.backend
        backend = self.controller.backend.name
        if wanted is not None and wanted.value != backend:
            raise UserError(f"{source} is not a valid job (1 problem(s))", [
                f"spec.scheduling.backend: this server runs its instances on '{backend}', not "
                f"'{wanted.value}'; remove the field or submit to a server started with --backend {wanted.value}"])
        return loaded

    def submit(self, loaded: LoadedJob) -> int:
        """Queue ``loaded``; :class:`NameTaken` while a job of its name is active."""
        with self._lock, self.controller.sessions() as session:
            live = session.scalars(select(JobRow.id).where(
                JobRow.name == loaded.job.name, JobRow.state.not_in([s.value for s in JOB_TERMINAL])).limit(1)).first()
            if live is not None:
                raise NameTaken(f"a job named {loaded.job.name} is still active (id {live}); names are unique "
                                "among active jobs: choose another name, or cancel that job first")
            return self.controller.submit(loaded)
