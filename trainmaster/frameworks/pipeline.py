"""``pipeline``: run a partitioned model as a pipeline of stage processes.

Roles ``stage`` (one instance per device; each listens on its first port) and ``driver`` (one
instance, depends on every stage running). The driver traces the model named in
``frameworkParams.model`` (``module:callable``), partitions it over the stages with each method in
``frameworkParams.methods`` (default ours and METIS), streams ``samples`` random inputs of
``input_shape`` through the stages, checks the outputs equal the unsplit model's and writes the
measured time per sample to ``pipeline.json`` in the job's output folder. The job succeeds when
the driver does.
"""

from __future__ import annotations

import json
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext, python_module
from trainmaster.spec.model import Job, Role, RoleSelector, StatusPolicy

KNOWN_PARAMS = {
    "model",
    "input_shape",
    "methods",
    "samples",
    "seed",
    "bandwidth",
    "flops_per_second",
    "latency",
    "acyclic",
    "tracer",
    "input_dtype",
    "costs",
    "profile_runs",
    "emulate_link",
    "latency_samples",
    "pin_cores",
    "trace",
    "rounds",
    "model_args",
    "real_links",
}


class PipelineFramework(Framework):
    name = "pipeline"
    role_names = ("stage", "driver")
    required_roles = ("stage", "driver")
    default_dependencies = {"driver": ("stage",)}

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        return python_module("trainmaster.partition.pipeline", role.name)

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        params = spec.get("frameworkParams") or spec.get("framework_params") or {}
        if isinstance(params, dict):
            for key in sorted(set(params) - KNOWN_PARAMS):
                errors.append(
                    f"spec.frameworkParams.{key}: unknown pipeline parameter (known: {', '.join(sorted(KNOWN_PARAMS))})"
                )
            model = params.get("model")
            if model is not None and (not isinstance(model, str) or ":" not in model):
                errors.append("spec.frameworkParams.model: expected 'module:callable'")
            if params.get("emulate_link") and params.get("real_links"):
                errors.append(
                    "spec.frameworkParams.real_links: the links are either emulated (emulate_link) or real, not both"
                )
            if "model_args" in params and not isinstance(params["model_args"], dict):
                errors.append("spec.frameworkParams.model_args: expected a mapping of keyword arguments")
            from trainmaster.partition.methods import METHODS

            for key, allowed in (("costs", ("flops", "measured", "profiler")), ("tracer", ("fx", "export"))):
                if key in params and params[key] not in allowed:
                    errors.append(f"spec.frameworkParams.{key}: {params[key]!r} is not one of {', '.join(allowed)}")
            for m in params.get("methods", []) or []:
                if m not in METHODS:
                    errors.append(f"spec.frameworkParams.methods: unknown method {m!r}")
        for i, role in enumerate(roles):
            if role.get("name") == "driver" and role.get("replicas", 1) != 1:
                errors.append(f"spec.roles[{i}].replicas: the pipeline driver has exactly 1 replica")
            if role.get("ports", 1) == 0:
                errors.append(f"spec.roles[{i}].ports: pipeline roles need a port")
        return errors

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=["driver"]))
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        return {"TM_PIPELINE_PARAMS": json.dumps(ctx.params)}
