"""The initiator's task file: which party holds each data id and the rule to run on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainmaster.errors import UserError
from trainmaster.gateway.models import ID_PATTERN


class LegSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data_id: str = Field(pattern=ID_PATTERN)
    party: str = Field(pattern=ID_PATTERN)
    rule: str
    params: dict[str, Any] = Field(default_factory=dict)


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
        raise UserError(f"task file not found: {p}")
    try:
        return TaskSpec.model_validate(yaml.safe_load(p.read_text()))
    except (ValidationError, yaml.YAMLError) as exc:
        raise UserError(f"invalid task file {p}", details=[str(exc)]) from exc
