"""The one client surface of Trainmaster: the job verbs as a :class:`Trainmaster` protocol, with
typed results, implemented twice:

- :class:`trainmaster.api.LocalTrainmaster` works on a store in this process (what ``trainmaster
  job ...`` does without a server, and what the service's routes call);
- :class:`trainmaster.client.remote.RemoteTrainmaster` asks a controller service over HTTP
  (``--server URL``, ``--context NAME``, a current context).

A CLI verb takes either one and cannot tell them apart, so a verb answers the same with or
without a server (TorchX's ``Runner`` over its schedulers, kubectl over any API server).

    from trainmaster.api import LocalTrainmaster
    from trainmaster.client.remote import RemoteTrainmaster

    for jobs in (LocalTrainmaster.open(), RemoteTrainmaster("http://127.0.0.1:8642")):
        print([job["name"] for job in jobs.list_jobs().items])
"""

from trainmaster.client.protocol import Trainmaster, wait_for
from trainmaster.client.results import (
    ENDED,
    CancelResult,
    Deleted,
    JobNotFound,
    JobRef,
    JobStatus,
    JobSummary,
    ScaleResult,
    ServiceUnreachable,
    StoreMissing,
    Submitted,
    SuspendResult,
    WaitTimedOut,
)

__all__ = [
    "ENDED",
    "CancelResult",
    "Deleted",
    "JobNotFound",
    "JobRef",
    "JobStatus",
    "JobSummary",
    "ScaleResult",
    "ServiceUnreachable",
    "StoreMissing",
    "Submitted",
    "SuspendResult",
    "Trainmaster",
    "WaitTimedOut",
    "wait_for",
]
