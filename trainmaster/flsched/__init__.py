"""Multi-job federated learning: schedule many FL jobs over one device pool.

The model (``model``, ``cost``), the schedulers behind one interface (``schedulers``), a
simulator driven by per-job convergence curves (``simulate``) and a real multi-job FedAvg
runtime on small scikit-learn datasets (``runtime``).
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
