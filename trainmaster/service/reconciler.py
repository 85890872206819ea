"""The service's reconcile thread: :meth:`Controller.step` every interval, only while this
server leads when several share one store."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from sqlalchemy.exc import OperationalError

from trainmaster.controller import Controller
from trainmaster.controller.backoff import StoreBackoff
from trainmaster.controller.controller import NotResumable
from trainmaster.controller.leader import LeaderElector, LeaseLost

log = logging.getLogger("trainmaster.service")


class ControllerLink(Protocol):
    """What the API process knows of, and asks of, the reconcile loop: a :class:`Reconciler`
    thread beside the API, or the controller process (:mod:`.controller_process`)."""

    @property
    def error(self) -> str | None: ...  # the last pass's error, None while passes succeed

    def leadership(self) -> dict[str, Any]: ...

    def take_over(self, job_id: int) -> None: ...  # NotResumable / JobConflict: refused

    def families(self) -> list[Any]: ...  # Prometheus families recorded outside this process

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class Reconciler(threading.Thread):
    """Runs :meth:`Controller.step` every interval until stopped; with an ``elector`` (several
    servers on one store) only while this server leads, recovering first each time it takes over."""

    def __init__(self, controller: Controller, elector: LeaderElector | None = None):
        super().__init__(name="reconcile", daemon=True)
        self.controller = controller
        self.elector = elector
        self.stopping = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        recovered = False
        backoff = StoreBackoff(self.controller.interval)
        self.controller.backend.watch_exits(self.controller.wake)  # an instance's end wakes the loop
        while not self.stopping.is_set():
            if self.elector is not None and not self.elector.leading:
                recovered = False  # a standby: the leader reconciles
                self.elector.elected.wait(self.controller.interval)
                continue
            delay = self.controller.interval
            try:
                if not recovered:
                    self.controller.recover()  # re-adopt what the previous leader (or we) started
                    recovered = True
                self.controller.step()
                backoff.succeeded()
                self.error = None
            except LeaseLost as exc:
                log.warning("reconcile pass rolled back: %s", exc)
                recovered = False
            except OperationalError as exc:  # the store is away: back off, say so on /healthz
                delay = backoff.failed(exc)
                self.error = backoff.condition
                # a pass cut off between spawning instances and committing their handles left
                # them `starting` with no handle, which no pass observes: recover (re-find them
                # on their agent, or start them again) before the next pass
                recovered = False
            except Exception as exc:  # keep reconciling; surface the error on /healthz and in the log
                log.exception("reconcile pass failed")
                self.error = f"{type(exc).__name__}: {exc}"
                recovered = False
            self.controller.wait_for_work(delay)  # a submit, cancel or scale wakes it at once

    def stop(self) -> None:
        self.stopping.set()
        self.controller.wake()

    # ---- the ControllerLink of a loop in the API's own process ---------------------------------
    def leadership(self) -> dict[str, Any]:
        """Who reconciles: this server alone, or the leader among servers sharing the store."""
        if self.elector is None:
            return {"leading": True, "leader": None}
        return {"leading": self.elector.leading, "leader": self.elector.leader, "server": self.elector.identity}

    def take_over(self, job_id: int) -> None:
        if self.elector is not None and not self.elector.leading:
            raise NotResumable(f"this server is a standby; ask the leader ({self.elector.leader}) to resume")
        self.controller.take_over(job_id)  # NotResumable: 409, as every JobConflict

    def families(self) -> list[Any]:
        return []  # the loop writes this process's own registry
