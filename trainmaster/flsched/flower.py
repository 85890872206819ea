"""Our scheduler as Flower's client selection (needs ``flwr``; not a dependency of trainmaster).

Flower's FedAvg asks its client manager for a uniform random sample of clients each round.
``FlschedFedAvg`` keeps FedAvg's aggregation and evaluation and replaces only the choice of
training clients: ``configure_fit`` asks a ``JobSelector`` (a flsched scheduler, ``sa`` by
default, with the job's participation history), and ``aggregate_fit`` releases the round's
devices so that other jobs sharing the same ``DevicePool`` may use them. With a ``JointJob``
(one handle per job on a shared ``JointScheduler``) all jobs' rounds are scheduled together. A
round that cannot be scheduled (``ProblemError``) is logged and skipped: ``configure_fit``
returns no clients, which Flower's server treats as a cancelled round, and the run goes on.
A client that fails mid-round is one of Flower's ``failures``: FedAvg aggregates the others
(``accept_failures``), and the release frees the failed device too. Use it wherever a
Flower strategy goes: ``flwr.simulation.start_simulation(strategy=...)``,
``ServerAppComponents(strategy=...)``.
"""

from __future__ import annotations

import logging
from typing import Any

from flwr.common import FitIns, Parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from trainmaster.flsched.model import ProblemError
from trainmaster.flsched.selector import JobSelector, JointJob

log = logging.getLogger(__name__)


class FlschedFedAvg(FedAvg):
    """FedAvg whose training clients are chosen by a flsched ``JobSelector``.

    ``per_round`` clients train each round (at most the number connected); every other
    keyword goes to FedAvg.
    """

    def __init__(self, selector: JobSelector | JointJob, per_round: int, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.selector, self.per_round = selector, per_round

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        config = self.on_fit_config_fn(server_round) if self.on_fit_config_fn is not None else {}
        client_manager.wait_for(self.per_round)
        clients = client_manager.all()
        try:
            chosen = self.selector.select(list(clients), self.per_round)
        except ProblemError as exc:
            log.warning("flsched: round %d skipped: %s %s", server_round, exc, "; ".join(exc.details))
            return []
        fit_ins = FitIns(parameters, config)
        return [(clients[cid], fit_ins) for cid in chosen]

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        self.selector.release()
        return super().aggregate_fit(server_round, results, failures)
