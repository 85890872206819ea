"""What every route of the controller service reads: the options the operator chose and the
parts :func:`trainmaster.service.app.create_app` built (controller, facade, reconciler, leader
election, draining), kept on ``app.state.service`` so the route modules are plain module-level
routers (:mod:`trainmaster.service.routes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from trainmaster.api import LocalTrainmaster
from trainmaster.controller import Controller
from trainmaster.service.dashboard.access import AccessOptions
from trainmaster.service.draining import Draining
from trainmaster.service.limits import RequestLimits
from trainmaster.service.protect import ServedHosts
from trainmaster.service.quotas import JobQuota
from trainmaster.service.reconciler import ControllerLink
from trainmaster.spec.model import RuntimeKind
from trainmaster.spec.paths import PathPolicy

API = "/api/v1"


@dataclass(frozen=True)
class ServiceOptions:
    """What the operator decides for every submitted job: where its paths may point (relative
    ones are inside the job's folder) and how large a request may be."""

    paths: PathPolicy = field(default_factory=PathPolicy)
    limits: RequestLimits = field(default_factory=RequestLimits)
    access: AccessOptions = field(default_factory=AccessOptions)  # the token beyond loopback, CSRF
    runtime: RuntimeKind | None = None  # where 'runtime: auto' roles run (--runtime); None: podman's presence
    hosts: ServedHosts = field(default_factory=ServedHosts)  # the Host names it answers (DNS rebinding)
    quota: JobQuota = field(default_factory=JobQuota)  # instances per job and in all (--max-*-instances)


@dataclass(frozen=True)
class ServiceState:
    """The service's parts, shared by its route modules."""

    controller: Controller
    jobs: LocalTrainmaster  # every job verb goes through the facade
    options: ServiceOptions
    reconciler: ControllerLink  # the reconcile loop: a thread here, or the controller process
    draining: Draining

    def leadership(self) -> dict[str, Any]:
        """Who reconciles: this server alone, or the leader among servers sharing the store."""
        return self.reconciler.leadership()


def service_of(request: Request) -> ServiceState:
    """The state of the service answering ``request``."""
    state: ServiceState = request.app.state.service
    return state
