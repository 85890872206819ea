"""``federated``: multi-job federated learning scheduled over a pool of device processes.

Roles ``server`` (one instance: runs the flsched scheduler and FedAvg for digits, wine and
breast-cancer; its first port serves the devices) and ``device`` (N replicas, each training its
own non-IID shard of every job). Devices depend on the server's address; the job succeeds when
the server succeeds. ``frameworkParams``: scheduler, per_round, rounds, seed, dropout.
"""

from __future__ import annotations

from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext, python_module
from trainmaster.spec.model import Job, Role, RoleSelector, StatusPolicy

PARAMS = {
    "scheduler": "FLSCHED_SCHEDULER",
    "per_round": "FLSCHED_PER_ROUND",
    "rounds": "FLSCHED_ROUNDS",
    "seed": "FLSCHED_SEED",
    "dropout": "FLSCHED_DROPOUT",
}


class FederatedFramework(Framework):
    name = "federated"
    role_names = ("server", "device")
    required_roles = ("server", "device")
    default_dependencies = {"device": ("server",)}
    single_instance_roles = ("server",)
    port_roles = {"server": " for its devices"}

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        return python_module("trainmaster.flsched.service", role.name)

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        params = spec.get("frameworkParams") or spec.get("framework_params") or {}
        if isinstance(params, dict):
            for key in params:
                if key not in PARAMS:
                    errors.append(f"spec.frameworkParams.{key}: unknown (known: {', '.join(PARAMS)})")
        return errors

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=["server"]))
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        env = {"FLSCHED_DEVICES": str(ctx.role_replicas.get("device", 0))}
        env.update({var: str(ctx.params[key]) for key, var in PARAMS.items() if key in ctx.params})
        if ctx.role == "server":
            env.update(
                {
                    "FLSCHED_HOST": ctx.host,
                    "FLSCHED_PORT": str(ctx.ports[0]) if ctx.ports else "0",
                    "FLSCHED_OUTPUT": ctx.output_dir,
                }
            )
        else:
            env.update({"FLSCHED_SERVER": ctx.services["server"][0], "FLSCHED_DEVICE_INDEX": str(ctx.index)})
        return env
