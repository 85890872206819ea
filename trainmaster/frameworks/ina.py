"""``ina``: gradient aggregation through a forwarding tier, run by the controller.

Roles ``ps`` (the parameter node, one instance), ``switch`` (forwarding nodes) and ``worker``;
workers depend on the switch and the switch on the ps (condition Running: the address is
known). Each worker gets ``TM_AGGREGATION_SWITCH`` (its forwarding node, spread round robin),
``TM_AGGREGATION_JOB``, ``RANK`` and ``WORLD_SIZE``: exactly what
``trainmaster.aggregation.torch_hook.client_from_env`` reads. The job succeeds when every worker
succeeds (the ps and switch then stop with the job).

frameworkParams: ``slots`` (aggregator slots per forwarding node, default 64),
``transport`` (``udp``, the default, or ``shm``: shared-memory rings, every role on one host),
handed to every role as ``TM_AGGREGATION_TRANSPORT``, ``chunk`` (elements per packet, handed
to workers as ``TM_AGGREGATION_CHUNK``; default: the transport's, 64 KiB slices on udp, which
the transport cuts into datagrams that fit each path's MTU) and ``precision`` (``int32``, the
default, or ``int16`` / ``int8``: low-bit aggregation with a per-slice scale the workers share,
and error feedback; handed to workers as ``TM_AGGREGATION_PRECISION``) and ``results``
(``exact``: the sums come down as the nodes summed them, or ``int8``: the parameter node
re-quantises them, unbiased, for half the bytes down; default ``int8`` for an int8 job, else
``exact``; handed to workers as ``TM_AGGREGATION_RESULTS``). A ``switch`` role with several
replicas puts that many forwarding nodes side by side under the parameter node, workers spread
over them round robin; the parameter node judges each one's sums against its own workers.
"""

from __future__ import annotations

import zlib
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext, python_module
from trainmaster.spec.model import Job, Role, RoleSelector, StatusPolicy


TRANSPORTS = ("udp", "shm")
PRECISIONS = ("int32", "int16", "int8")
RESULT_PRECISIONS = ("exact", "int8")
# elements per packet on udp: (1 MiB packet - 36-byte header) / 4 (trainmaster.aggregation's limit)
MAX_CHUNK = 262_135


class InaFramework(Framework):
    name = "ina"
    role_names = ("ps", "switch", "worker")
    required_roles = ("ps", "switch", "worker")
    default_dependencies = {"worker": ("switch",), "switch": ("ps",)}
    single_instance_roles = ("ps",)
    port_roles = {"ps": "", "switch": ""}

    def role_command(self, job: Job, role: Role) -> list[str] | None:
        if role.name == "ps":
            return python_module("trainmaster", "aggregation", "parameter-node")
        if role.name == "switch":
            return python_module("trainmaster", "aggregation", "forwarding-node")
        return python_module("trainmaster.aggregation.train_digits")

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        transport = (spec.get("frameworkParams") or {}).get("transport", "udp")
        if transport not in TRANSPORTS:
            errors.append(f"spec.frameworkParams.transport: '{transport}' is not one of {', '.join(TRANSPORTS)}")
        chunk = (spec.get("frameworkParams") or {}).get("chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK):
            errors.append(
                f"spec.frameworkParams.chunk: {chunk!r} must be a whole number of "
                f"elements between 1 and {MAX_CHUNK} (one 1 MiB packet)"
            )
        precision = (spec.get("frameworkParams") or {}).get("precision", "int32")
        if precision not in PRECISIONS:
            errors.append(
                f"spec.frameworkParams.precision: {precision!r} is not one of {', '.join(PRECISIONS)} "
                f"(int8 / int16: low-bit aggregation)"
            )
        results = (spec.get("frameworkParams") or {}).get("results", "exact")
        if results not in RESULT_PRECISIONS:
            errors.append(
                f"spec.frameworkParams.results: {results!r} is not one of {', '.join(RESULT_PRECISIONS)} "
                f"(int8: the sums re-quantised on the way down)"
            )
        for i, role in enumerate(roles):
            replicas = role.get("replicas", 1)
            if role.get("name") == "worker" and isinstance(replicas, int) and not 1 <= replicas <= 64:
                errors.append(f"spec.roles[{i}].replicas: ina supports 1 to 64 workers")
        return errors

    def defaults(self, job: Job) -> Job:
        job = super().defaults(job)
        if job.spec.status_policy == StatusPolicy():
            job.spec.status_policy = StatusPolicy(failed="any", succeeded=RoleSelector(roles=["worker"]))
        return job

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        return {"TM_AGGREGATION_TRANSPORT": str(ctx.params.get("transport", "udp")), **self._role_environment(ctx)}

    @staticmethod
    def _role_environment(ctx: InstanceContext) -> dict[str, str]:
        job_id = zlib.crc32(ctx.job_name.encode()) & 0x7FFFFFFF
        if ctx.role == "ps":
            return {"TM_AGGREGATION_HOST": ctx.host, "TM_AGGREGATION_PORT": str(ctx.ports[0])}
        if ctx.role == "switch":
            return {
                "TM_AGGREGATION_HOST": ctx.host,
                "TM_AGGREGATION_PORT": str(ctx.ports[0]),
                "TM_AGGREGATION_PARENT": ctx.services["ps"][0],
                "TM_AGGREGATION_SLOTS": str(ctx.params.get("slots", 64)),
            }
        switches = ctx.services["switch"]
        env = {
            "TM_AGGREGATION_SWITCH": switches[ctx.index % len(switches)],
            "TM_AGGREGATION_JOB": str(job_id),
            "RANK": str(ctx.index),
            "WORLD_SIZE": str(ctx.replicas),
        }
        if ctx.params.get("chunk") is not None:
            env["TM_AGGREGATION_CHUNK"] = str(ctx.params["chunk"])
        if ctx.params.get("precision") is not None:
            env["TM_AGGREGATION_PRECISION"] = str(ctx.params["precision"])
        if ctx.params.get("results") is not None:
            env["TM_AGGREGATION_RESULTS"] = str(ctx.params["results"])
        return env
