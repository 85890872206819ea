"""The environment every instance gets: a few host variables, TM_* variables, service addresses,
framework variables and the role's own.

Built, never inherited: the controller's environment holds what a job must not have (the store's
URL, the server's token, cloud credentials of whoever started it). An instance gets, from the
machine, only what a program needs to run at all (:data:`HOST_VARIABLES`: where programs and
libraries are, the locale, the time zone, a temporary folder, the user's home); everything
else comes from the job: the TM_* variables (its channel to the controller among them), its
framework's variables and the role's ``env``, as a Kubernetes pod gets its image's environment
plus what its spec says.
"""

from __future__ import annotations

import re
from typing import Any

from trainmaster.frameworks import get_framework
from trainmaster.frameworks.base import InstanceContext

#: What an instance takes from the environment of the machine it starts on.
HOST_VARIABLES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "PYTHONPATH",  # a source checkout's Trainmaster, where it is not installed
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "CUDA_VISIBLE_DEVICES",  # the node's devices, as the node agent was given them
        "TRAINMASTER_FRAMEWORKS",  # the operator's allowed frameworks: the wait step resolves the job's
        "TRAINMASTER_SHARED_DATA",  # where capability roles find the machine's shared data sets
    }
)


def host_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of ``environ`` (the controller's) an instance starts with: :data:`HOST_VARIABLES`
    and the locale's ``LC_*``."""
    return {k: v for k, v in environ.items() if k in HOST_VARIABLES or k.startswith("LC_")}


def service_variable(role: str) -> str:
    """``TM_SERVICE_<ROLE>``: the role name upper-cased, ``-`` as ``_``."""
    return "TM_SERVICE_" + re.sub(r"[^A-Z0-9]", "_", role.upper())


def tm_variables(context: dict[str, Any]) -> dict[str, str]:
    ports = [str(p) for p in context["ports"]]
    env = {
        "TM_JOB_NAME": context["job_name"],
        "TM_ROLE": context["role"],
        "TM_REPLICA_INDEX": str(context["index"]),
        "TM_REPLICAS": str(context["replicas"]),
        "TM_PORTS": ",".join(ports),
        "TM_HOST": context["host"],
        "TM_OUTPUT_DIR": context["output_dir"],
    }
    if "job_id" in context:
        env.update({"TM_JOB_ID": str(context["job_id"]), "TM_ATTEMPT": str(context["attempt"])})
    if context.get("channel"):  # how report(), publish() and the wait step reach the controller
        env.update({"TM_CHANNEL": context["channel"], "TM_CHANNEL_TOKEN": context["channel_token"]})
    if ports:
        env["TM_PORT"] = ports[0]
    return env


def service_variables(services: dict[str, list[str]]) -> dict[str, str]:
    return {service_variable(role): ",".join(addresses) for role, addresses in services.items()}


def field_values(fields: dict[str, str], context: dict[str, Any], pod: dict[str, str]) -> dict[str, str]:
    """A role's ``envFields`` (variable -> Kubernetes field path, see
    :class:`trainmaster.spec.model.InstanceField`) as values of this instance. Resolved with the
    rest of the environment, so an instance moved to another node (Ray) gets that node's address."""
    facts = {
        "status.podIP": context["host"],
        "status.hostIP": context["host"],
        "spec.nodeName": context["host"],
        "metadata.name": pod.get("name", f"{context['job_name']}-{context['role']}-{context['index']}"),
        "metadata.uid": pod.get("uid", ""),
    }
    return {name: facts[path] for name, path in fields.items()}


def instance_environment(launch: dict[str, Any], services: dict[str, list[str]]) -> dict[str, str]:
    """The full environment of one instance, given the addresses of the roles it depends on.

    Precedence, lowest first: the host variables (``launch["env"]``, see :func:`host_environment`),
    TM_* variables, service addresses, the framework's variables, then the role's own ``env`` and
    ``envFields`` (the user has the last word).
    """
    context = launch["context"]
    framework = get_framework(launch["framework"])
    known = InstanceContext.__dataclass_fields__
    ctx = InstanceContext(services=services, **{k: v for k, v in context.items() if k in known})
    env = dict(launch["env"])
    env.update(tm_variables(context))
    env.update(service_variables(services))
    env.update(framework.environment(ctx))
    env.update(launch["role_env"])
    env.update(field_values(launch.get("env_fields", {}), context, launch.get("pod", {})))
    return env
