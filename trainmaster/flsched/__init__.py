"""Multi-job federated learning: schedule many FL jobs over one device pool.

The model (``model``, ``cost``), the schedulers behind one interface (``schedulers``), large
pools in sparse form (``fleet``), a simulator driven by per-job convergence curves
(``simulate``), real multi-job FedAvg runtimes on small scikit-learn datasets (``runtime``,
``wallclock``), and, for Flower's deployment runtime, the node arbiter (``arbiter``), the
strategy and Flower App (``flower``, needs flwr) and a local federation launcher
(``federation``).
"""

from trainmaster.flsched.cost import Assignment, ExactCost, RoundCost, SampledCost, violations
from trainmaster.flsched.model import Device, Job, Problem, ProblemError
from trainmaster.flsched.schedulers import Scheduler, make_scheduler, names

__all__ = [
    "Assignment",
    "ExactCost",
    "RoundCost",
    "SampledCost",
    "Device",
    "Job",
    "Problem",
    "ProblemError",
    "Scheduler",
    "make_scheduler",
    "names",
    "violations",
]
