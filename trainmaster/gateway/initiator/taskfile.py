"""The initiator's task file: which party holds each data id, the rule to run on it and, for a
rule that reads one, the leg's input file (a model or parameters, any size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainmaster.errors import UserError
from trainmaster.spec.boundedyaml import load_one
from trainmaster.gateway.models import ID_PATTERN


class LegSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    rule: str
    params: dict[str, Any] = Field(default_factory=dict)
    input: Path | None = None
    """A file sent to the leg's party through the gateway before the rule runs (relative paths are
    relative to the task file's folder)."""


class TaskSpec(BaseModel):
    """A task file: which party holds each data id and the rule to run on it."""

    model_config = ConfigDict(extra="forbid")
    task_id: str | None = Field(default=None, pattern=ID_PATTERN)
    leg_timeout_s: float = Field(default=30.0, gt=0, le=600)
    deadline_s: float = Field(default=300.0, gt=0, le=3600)
    legs: list[LegSpec] = Field(min_length=1)


def load_task(path: str | Path) -> TaskSpec:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"task file not found: {p}", details=["give the path of a task YAML file"])
    try:
        spec = TaskSpec.model_validate(load_one(p.read_text(), str(p)))
    except (ValidationError, yaml.YAMLError) as exc:
        raise UserError(f"invalid task file {p}", details=[str(exc)]) from exc
    legs = []
    for i, leg in enumerate(spec.legs):
        if leg.input is not None:
            source = leg.input if leg.input.is_absolute() else p.parent / leg.input
            if not source.is_file():
                raise UserError(
                    f"invalid task file {p}: legs.{i}.input: {source} is not a file",
                    details=["give the path of the file to send to the leg's party (relative to the task file)"],
                )
            leg = leg.model_copy(update={"input": source.resolve()})
        legs.append(leg)
    return spec.model_copy(update={"legs": legs})
