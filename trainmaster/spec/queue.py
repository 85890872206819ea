"""A queue with quota, as a user writes it (``trainmaster queue create``, ``POST /api/v1/queues``).

Kueue's ClusterQueue in our words: a nominal quota per resource, a cohort whose queues lend each
other what they leave unused, a borrowing and a lending limit per resource, and a weight for
fair sharing of what is borrowed. The meaning is in :mod:`trainmaster.controller.quota`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from trainmaster.spec.model import MAX_CPU, MAX_GPU, NAME_PATTERN, SpecModel, parse_memory

ResourceName = Literal["cpu", "memory", "gpu"]
RESOURCE_NAMES: tuple[ResourceName, ...] = ("cpu", "memory", "gpu")
MAX_WEIGHT = 1_000_000.0

Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)] | Annotated[str, Field(min_length=1, max_length=64)]


class ResourceQuotaSpec(SpecModel):
    """One resource of a queue. Memory takes quantities (``64Gi``); cpu cores and gpus numbers."""

    nominal: Amount
    borrowing_limit: Amount | None = None
    lending_limit: Amount | None = None


class QueueSpec(SpecModel):
    """A queue with quota. ``quota`` names at least one resource; a resource it does not name
    is not limited by the queue. ``borrowingLimit`` and ``lendingLimit`` need a ``cohort``."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=63)]
    cohort: Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=63)] | None = None
    weight: Annotated[float, Field(ge=0, le=MAX_WEIGHT, allow_inf_nan=False)] = 1.0
    quota: Annotated[dict[ResourceName, ResourceQuotaSpec], Field(min_length=1)]

    @field_validator("quota")
    @classmethod
    def _amounts(cls, value: dict[ResourceName, ResourceQuotaSpec]) -> dict[ResourceName, ResourceQuotaSpec]:
        for resource, spec in value.items():
            for key in ("nominal", "borrowing_limit", "lending_limit"):
                amount = getattr(spec, key)
                if amount is not None:
                    to_number(resource, amount)  # raises with the resource's own rule
            lending = spec.lending_limit
            if lending is not None and to_number(resource, lending) > to_number(resource, spec.nominal):
                raise ValueError(f"{resource}: lendingLimit may not exceed nominal (a queue lends only what it owns)")
        return value

    @model_validator(mode="after")
    def _limits_need_a_cohort(self) -> QueueSpec:
        if self.cohort is None:
            for resource, spec in self.quota.items():
                if spec.borrowing_limit is not None or spec.lending_limit is not None:
                    raise ValueError(
                        f"quota.{resource}: borrowingLimit and lendingLimit need a cohort to borrow from "
                        "and lend to; give the queue a cohort or drop the limits"
                    )
        return self

    def amounts(self) -> dict[str, dict[str, float | None]]:
        """The quota in numbers (memory in bytes), as the store keeps it."""
        return {
            resource: {
                "nominal": to_number(resource, spec.nominal),
                "borrowingLimit": None if spec.borrowing_limit is None else to_number(resource, spec.borrowing_limit),
                "lendingLimit": None if spec.lending_limit is None else to_number(resource, spec.lending_limit),
            }
            for resource, spec in self.quota.items()
        }


def to_number(resource: str, value: Any) -> float:
    """A quota amount of ``resource`` as a number: bytes for memory (``64Gi``), cores for cpu
    (at most the spec's per-instance ceiling times 1,000), whole devices for gpu."""
    if resource == "memory":
        return float(parse_memory(value))
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{resource}: '{value[:40]}' is not a number") from None
    number = float(value)
    if number != number or number < 0 or number in (float("inf"),):
        raise ValueError(f"{resource}: must be a number >= 0")
    ceiling = MAX_CPU * 1000 if resource == "cpu" else float(MAX_GPU * 1000)
    if number > ceiling:
        raise ValueError(f"{resource}: must be at most {ceiling:g}")
    if resource == "gpu" and number != int(number):
        raise ValueError("gpu: must be a whole number of devices")
    return number
