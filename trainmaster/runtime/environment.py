"""The environment every instance gets: TM_* variables, service addresses, framework variables."""

from __future__ import annotations

import re
from typing import Any

from trainmaster.frameworks import get_framework
from trainmaster.frameworks.base import InstanceContext


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
    if "job_id" in context:  # where trainmaster.report() stores this instance's points
        env.update(
            {"TM_JOB_ID": str(context["job_id"]), "TM_ATTEMPT": str(context["attempt"]), "TM_DB_URL": context["db_url"]}
        )
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

    Precedence, lowest first: the controller's environment, TM_* variables, service addresses,
    the framework's variables, then the role's own ``env`` and ``envFields`` (the user has the
    last word).
    """
    context = launch["context"]
    framework = get_framework(launch["framework"])
    ctx = InstanceContext(services=services, **context)
    env = dict(launch["env"])
    env.update(tm_variables(context))
    env.update(service_variables(services))
    env.update(framework.environment(ctx))
    env.update(launch["role_env"])
    env.update(field_values(launch.get("env_fields", {}), context, launch.get("pod", {})))
    return env
