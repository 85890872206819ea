"""Gang admission: start nothing of a job until ``minAvailable`` of its instances fit at once."""

from __future__ import annotations

from dataclasses import dataclass

from trainmaster.backends.base import Resources
from trainmaster.spec.model import Job


@dataclass(frozen=True)
class Admission:
    admitted: bool
    unschedulable: bool = False  # can never fit: the gang exceeds the backend's total capacity
    message: str = ""


def gang_demand(job: Job) -> Resources:
    """CPU, memory and GPU of the first ``minAvailable`` instances, in role order."""
    wanted = job.spec.scheduling.min_available or job.spec.total_replicas
    cpu, memory, gpu, taken = 0.0, 0, 0, 0
    for role in job.spec.roles:
        n = min(role.replicas, wanted - taken)
        cpu += n * role.resources.cpu
        memory += n * role.resources.memory_bytes
        gpu += n * role.resources.gpu
        taken += n
        if taken >= wanted:
            break
    return Resources(cpu, memory, gpu)


def gang_of(job: Job) -> tuple[Resources, int]:
    """What admission looks at in a job: its gang's demand and size (like jobs share it)."""
    return gang_demand(job), job.spec.scheduling.min_available or job.spec.total_replicas


def admit(job: Job, total: Resources, free: Resources) -> Admission:
    return admit_gang(*gang_of(job), total, free)


def admit_gang(demand: Resources, gang: int, total: Resources, free: Resources) -> Admission:
    need = f"{gang} instance(s) needing cpu={demand.cpu:g}, memory={demand.memory}B, gpu={demand.gpu}"
    if not total.fits(demand):
        return Admission(
            False,
            True,
            f"the gang of {need} exceeds the backend's total capacity "
            f"(cpu={total.cpu:g}, memory={total.memory}B, gpu={total.gpu})",
        )
    if not free.fits(demand):
        return Admission(
            False,
            False,
            f"waiting for resources: the gang of {need}; free now: "
            f"cpu={free.cpu:g}, memory={free.memory}B, gpu={free.gpu}",
        )
    return Admission(True, message=f"admitted {need}")
