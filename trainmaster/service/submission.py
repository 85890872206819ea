"""Taking a job into the service's queue: the one path the REST API and the dashboard share.

Loading applies the operator's path policy and strictness; the backend named in the job must be
the server's; a name is unique among active jobs (checked and inserted in one transaction that
holds the store's lock for that name, so across every server sharing the store).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from trainmaster.controller import Controller
from trainmaster.errors import UserError
from trainmaster.spec.load import LoadedJob, LoadOptions, load_document
from trainmaster.spec.paths import PathPolicy
from trainmaster.store.repository import NameTaken

__all__ = ["NameTaken", "Submission"]


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
        with self._lock:  # one at a time in this server; the store's lock covers the others
            return self.controller.submit(loaded, unique_name=True)
