"""A Kubernetes pod template as the fields of one of our roles.

Kubeflow replica specs and Volcano tasks both describe their instances as a pod template; this
module is the one place that reads it. One container runs per instance (the one the source
framework treats as the main container): its ``image`` with ``command``/``args`` in Kubernetes'
meaning (``command`` replaces the image's ENTRYPOINT, ``args`` its CMD), ``imagePullPolicy``,
``emptyDir``/``hostPath`` volumes at their ``volumeMounts``, ``env``, ``workingDir`` and resource
requests carry over. The role gets ``runtime: auto``: it runs in a container from its image where
a container runtime is present, as upstream does (:mod:`trainmaster.containers.policy`).
Everything that only means something on a cluster is reported, with a reason, through
:class:`~trainmaster.spec.compat.ignored.Report`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmaster.spec.compat.ignored import Report, join
from trainmaster.spec.compat.meta import OBJECT_META_FIELDS
from trainmaster.spec.model import InstanceField, check_job_path, parse_memory

INSTANCE_FIELDS = [f.value for f in InstanceField]

_POD_REASONS = {
    "nodeSelector": "the local backend does not select nodes",
    "nodeName": "the local backend does not select nodes",
    "affinity": "the local backend does not select nodes",
    "tolerations": "the local backend has no node taints",
    "initContainers": "init containers are not run; use a role with dependsOn for setup steps",
    "imagePullSecrets": "images are not pulled locally",
    "serviceAccountName": "no Kubernetes service accounts locally",
    "serviceAccount": "no Kubernetes service accounts locally",
    "securityContext": "instances run as the controller's user",
    "hostNetwork": "instances always use this machine's network (127.0.0.1)",
    "dnsPolicy": "roles find each other through TM_SERVICE_<ROLE>, not DNS",
    "schedulerName": "the Trainmaster controller schedules instances",
    "priorityClassName": "the job's priority class unless the job or a Kueue label names one (the highest of its pods')",
    "terminationGracePeriodSeconds": "the controller's own grace period applies",
}
_POD_DEFAULT = "a Kubernetes pod setting with no meaning on the local backend"
#: Every field of a Kubernetes PodSpec (core/v1); anything else is a typo.
POD_SPEC_FIELDS = {
    "activeDeadlineSeconds",
    "affinity",
    "automountServiceAccountToken",
    "containers",
    "dnsConfig",
    "dnsPolicy",
    "enableServiceLinks",
    "ephemeralContainers",
    "hostAliases",
    "hostIPC",
    "hostNetwork",
    "hostPID",
    "hostUsers",
    "hostname",
    "imagePullSecrets",
    "initContainers",
    "nodeName",
    "nodeSelector",
    "os",
    "overhead",
    "preemptionPolicy",
    "priority",
    "priorityClassName",
    "readinessGates",
    "resourceClaims",
    "resources",
    "restartPolicy",
    "runtimeClassName",
    "schedulerName",
    "schedulingGates",
    "securityContext",
    "serviceAccount",
    "serviceAccountName",
    "setHostnameAsFQDN",
    "shareProcessNamespace",
    "subdomain",
    "terminationGracePeriodSeconds",
    "tolerations",
    "topologySpreadConstraints",
    "volumes",
}
#: Pod fields that would change what an instance does; refused rather than dropped.
_POD_UNSUPPORTED = {
    "activeDeadlineSeconds": "a per-pod deadline is not enforced locally; remove it",
    "ephemeralContainers": "only the main container runs locally",
}
#: Every field of a Kubernetes Container (core/v1).
CONTAINER_FIELDS = {
    "args",
    "command",
    "env",
    "envFrom",
    "image",
    "imagePullPolicy",
    "lifecycle",
    "livenessProbe",
    "name",
    "ports",
    "readinessProbe",
    "resizePolicy",
    "resources",
    "restartPolicy",
    "securityContext",
    "startupProbe",
    "stdin",
    "stdinOnce",
    "terminationMessagePath",
    "terminationMessagePolicy",
    "tty",
    "volumeDevices",
    "volumeMounts",
    "workingDir",
}
TEMPLATE_FIELDS = {"metadata", "spec"}

_CONTAINER_REASONS = {
    "envFrom": "ConfigMaps/Secrets do not exist locally; list the variables under env",
    "securityContext": "instances run as the controller's user",
    "livenessProbe": "probes are not run; an instance is healthy while its process runs",
    "readinessProbe": "probes are not run; an instance is ready once it has an address",
    "startupProbe": "probes are not run",
    "lifecycle": "container lifecycle hooks are not run",
    "stdin": "instances have no stdin",
    "tty": "instances have no terminal",
}
_CONTAINER_DEFAULT = "a Kubernetes container setting with no meaning on the local backend"

_GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
_HOST_PORT = "instances use their node's network directly: the containerPort is the node's port"


@dataclass
class PodFields:
    """What a pod template contributes to a role."""

    role: dict[str, Any]  # command, args, env, workingDir, image, ports, resources (camelCase)
    restart_policy: str | None  # the pod's own restartPolicy, if it states one


def from_template(template: Any, path: str, report: Report, container_name: str | None = None) -> PodFields:
    """Translate ``template`` (a pod template spec) found at ``path``.

    ``container_name`` names the main container (Kubeflow's ``pytorch``/``tensorflow``); the
    first container is used when none has that name.
    """
    template = report.mapping(template, path)
    report.rest(template, path, TEMPLATE_FIELDS, {})
    pod_meta = report.mapping(template.get("metadata"), join(path, "metadata"))
    report.rest(pod_meta, join(path, "metadata"), (), {}, OBJECT_META_FIELDS, "pod metadata has no meaning locally")
    spec_path = join(path, "spec")
    spec = report.mapping(template.get("spec"), spec_path)
    for key, reason in _POD_UNSUPPORTED.items():
        if key in spec:
            report.unsupported(join(spec_path, key), reason)
    report.rest(
        spec,
        spec_path,
        {"containers", "restartPolicy", "volumes", *_POD_UNSUPPORTED},
        _POD_REASONS,
        POD_SPEC_FIELDS,
        _POD_DEFAULT,
    )
    volumes = _volumes(
        report.sequence(spec.get("volumes"), join(spec_path, "volumes")), join(spec_path, "volumes"), report
    )
    containers_path = join(spec_path, "containers")
    containers = report.sequence(spec.get("containers"), containers_path)
    role: dict[str, Any] = {}
    if containers:
        main = _main_container(containers, container_name)
        for i, container in enumerate(containers):
            where = join(containers_path, i)
            if i == main:
                role = _container(report.mapping(container, where), where, report, volumes)
            else:
                report.ignore(where, "only the main container runs locally (sidecars are not started)")
    restart = spec.get("restartPolicy")
    return PodFields(role=role, restart_policy=restart if isinstance(restart, str) else None)


def _main_container(containers: list[Any], name: str | None) -> int:
    for i, container in enumerate(containers):
        if isinstance(container, dict) and name is not None and container.get("name") == name:
            return i
    return 0


def _volumes(entries: list[Any], path: str, report: Report) -> dict[str, dict[str, Any]]:
    """Pod volumes by name, as our volume sources (``hostPath`` or ``emptyDir``)."""
    found: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(entries):
        where = join(path, i)
        entry = report.mapping(entry, where)
        name = entry.get("name")
        host = entry.get("hostPath")
        if isinstance(host, dict) and isinstance(host.get("path"), str):
            found[str(name)] = {"hostPath": host["path"]}
        elif "emptyDir" in entry:
            found[str(name)] = {"emptyDir": True}
        else:
            kinds = ", ".join(k for k in entry if k != "name") or "no source"
            report.ignore(
                where,
                f"volume {name!r} ({kinds}) is not mounted: only emptyDir and "
                "hostPath volumes are bind-mounted into containers",
            )
    return found


def _container(
    container: dict[str, Any], path: str, report: Report, volumes: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    handled = {
        "name",
        "command",
        "args",
        "env",
        "workingDir",
        "resources",
        "image",
        "ports",
        "imagePullPolicy",
        "volumeMounts",
    }
    report.rest(container, path, handled, _CONTAINER_REASONS, CONTAINER_FIELDS, _CONTAINER_DEFAULT)
    role: dict[str, Any] = {}
    command, args = container.get("command"), container.get("args")
    if command:
        role["command"] = command
    if args:
        role["args"] = args
    if not command and container.get("image") is None:
        report.unsupported(
            path, "a container with no command and no image has nothing to run; give the command under 'command'"
        )
    resources = _resources(
        report.mapping(container.get("resources"), join(path, "resources")), join(path, "resources"), report
    )
    env, fields = _env(report.sequence(container.get("env"), join(path, "env")), join(path, "env"), report, resources)
    if env:
        role["env"] = env
    if fields:
        role["envFields"] = fields
    working_dir = container.get("workingDir") or None  # "" is unset, as in Kubernetes
    problem = _path_problem(working_dir) if isinstance(working_dir, str) else None
    if problem:  # a path no file system takes: checking whether it exists here would fail too
        report.invalid(join(path, "workingDir"), problem)
    elif isinstance(working_dir, str) and Path(working_dir).is_dir():
        role["workingDir"] = working_dir
    elif working_dir is not None:
        report.ignore(
            join(path, "workingDir"),
            f"{working_dir!r} does not exist on this machine "
            "(a path inside the image); the instance runs in its run directory",
        )
    if container.get("image") is not None:
        role["image"] = container["image"]
        role["runtime"] = "auto"  # a container where a runtime is present, as upstream
    if container.get("imagePullPolicy") is not None:
        role["imagePullPolicy"] = container["imagePullPolicy"]
    mounts = report.sequence(container.get("volumeMounts"), join(path, "volumeMounts"))
    for i, mount in enumerate(mounts):
        mount = report.mapping(mount, join(join(path, "volumeMounts"), i))
        source = (volumes or {}).get(str(mount.get("name")))
        if source is None:
            report.ignore(
                join(join(path, "volumeMounts"), i),
                f"volume {mount.get('name')!r} is not mounted (not an emptyDir or hostPath volume of this pod)",
            )
            continue
        volume = {"name": mount.get("name"), "mountPath": mount.get("mountPath"), **source}
        if mount.get("readOnly"):
            volume["readOnly"] = True
        role.setdefault("volumes", []).append(volume)
    ports = report.sequence(container.get("ports"), join(path, "ports"))
    numbers = []
    for i, port in enumerate(ports):
        where = join(join(path, "ports"), i)
        port = report.mapping(port, where)
        report.rest(port, where, {"containerPort", "name", "protocol"}, {"hostPort": _HOST_PORT, "hostIP": _HOST_PORT})
        number = port.get("containerPort")
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535:
            raise report.error(join(where, "containerPort"), "must be a port number from 1 to 65535")
        if number not in numbers:
            numbers.append(number)
    if numbers:
        role["containerPorts"] = numbers
        report.approximate(
            join(path, "ports"),
            f"instances share their node's network: each instance gets port(s) {', '.join(map(str, numbers))} "
            "where free on its node, else free ones (TM_PORT / TM_PORTS, and the framework's variables, "
            "say which)",
        )
    if resources:
        role["resources"] = resources
    return role


def _env(
    entries: list[Any], path: str, report: Report, resources: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The container's ``env`` as our ``env`` (values) and ``envFields`` (``valueFrom.fieldRef``
    facts of the instance); ``resourceFieldRef`` becomes a value at once (a role's resources are
    fixed); ConfigMaps and Secrets do not exist here."""
    env: dict[str, Any] = {}
    fields: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = join(path, i)
        entry = report.mapping(entry, where)
        report.rest(entry, where, {"name", "value", "valueFrom"}, {})
        name = entry.get("name")
        if not isinstance(name, str):
            raise report.error(join(where, "name"), "an environment variable needs a name")
        if "valueFrom" not in entry:
            value = entry.get("value", "")
            if not isinstance(value, str):  # Kubernetes refuses it too (quote a number: "3")
                report.invalid(join(where, "value"), f"must be a string, not {type(value).__name__}")
            env[name] = value
            continue
        source = report.mapping(entry["valueFrom"], join(where, "valueFrom"))
        field_ref, resource_ref = source.get("fieldRef"), source.get("resourceFieldRef")
        if isinstance(field_ref, dict) and isinstance(field_ref.get("fieldPath"), str):
            field_path = field_ref["fieldPath"]
            where_path = join(join(join(where, "valueFrom"), "fieldRef"), "fieldPath")
            if field_path in INSTANCE_FIELDS:
                fields[name] = field_path
            elif field_path == "metadata.namespace":
                env[name] = "default"
                report.approximate(where_path, "there are no namespaces locally; the value is 'default'")
            else:
                _refuse_env(report, where_path, name, f"field {field_path!r} of a pod has no value here", field_path)
        elif isinstance(resource_ref, dict) and isinstance(resource_ref.get("resource"), str):
            where_ref = join(join(where, "valueFrom"), "resourceFieldRef")
            value = _resource_value(resource_ref, resources or {})
            if isinstance(value, str):
                env[name] = value
            else:
                _refuse_env(report, join(where_ref, "resource"), name, value[0], None)
        else:
            kind = next(iter(source), "an empty valueFrom")
            _refuse_env(
                report,
                join(join(where, "valueFrom"), str(kind)),
                name,
                f"{name} comes from a Kubernetes object ({kind}) that does not exist locally",
                None,
            )
    return env, fields


def _refuse_env(report: Report, where: str, name: str, reason: str, field_path: str | None) -> None:
    known = ", ".join([*INSTANCE_FIELDS, "metadata.namespace"])
    hint = f" (fieldRef paths with a value here: {known})" if field_path is not None else ""
    if report.lenient:
        report.ignore(where, f"{reason}; {name} is not set")
    else:
        report.unsupported(where, f"{reason}{hint}; give {name} a 'value' (or pass --lenient to run without it)")


def _resource_value(ref: dict[str, Any], resources: dict[str, Any]) -> str | tuple[str]:
    """Kubernetes' value of a ``resourceFieldRef`` (the quantity over ``divisor``, rounded up),
    or ``(why,)`` where the role has no such value."""
    resource = str(ref["resource"])
    kind, _, what = resource.partition(".")
    if kind not in ("limits", "requests") or what not in ("cpu", "memory"):
        return (f"resource {resource!r} has no value here (only limits/requests of cpu and memory have)",)
    if what not in resources:
        return (f"the container states no {what} resource, so {resource} has no value here",)
    try:
        if what == "cpu":
            amount, divisor = float(cpu_quantity(resources["cpu"])), float(cpu_quantity(ref.get("divisor", "1")))
        else:
            amount = float(parse_memory(memory_quantity(resources["memory"])))
            divisor = float(parse_memory(memory_quantity(str(ref.get("divisor", "1")))))
    except (TypeError, ValueError, OverflowError):
        return (f"divisor {ref.get('divisor')!r} is not a {what} quantity",)
    if divisor <= 0:
        return (f"divisor {ref.get('divisor')!r} must be positive",)
    return str(max(1, math.ceil(amount / divisor - 1e-9)))


def cpu_quantity(value: Any) -> Any:
    """Kubernetes CPU quantity (``500m``, ``2``, ``1.5``) as cores; unparsable values pass
    through unchanged so that validation reports them with their path."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # past any float: validation says it is too many cores
            return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)(m?)\s*", value)
        if match:
            number = float(match.group(1))
            return number / 1000 if match.group(2) else number
    return value


def memory_quantity(value: Any) -> Any:
    """Kubernetes memory quantity in a form our model reads (``1e9`` becomes an integer)."""
    if isinstance(value, str):
        try:
            parse_memory(value)
            return value
        except ValueError:
            try:
                return int(float(value))
            except (ValueError, OverflowError):  # not a number, or past any float ('1e400'): validation says so
                return value
    return value


def _path_problem(value: str) -> str | None:
    """Why no file system takes ``value`` as a path (NUL, too long), or None."""
    try:
        check_job_path(value)
    except ValueError as exc:
        return str(exc)
    return None


def _resources(resources: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
    report.rest(resources, path, {"requests", "limits"}, {}, {"claims"}, "resource claims have no meaning locally")
    requests = report.mapping(resources.get("requests"), join(path, "requests"))
    limits = report.mapping(resources.get("limits"), join(path, "limits"))
    out: dict[str, Any] = {}
    # Kubernetes: a resource with only a limit is requested at that limit.
    for source, where in ((limits, "limits"), (requests, "requests")):
        for name, value in source.items():
            field = join(join(path, where), name)
            if name == "cpu":
                out["cpu"] = cpu_quantity(value)
            elif name == "memory":
                out["memory"] = memory_quantity(value)
            elif name in _GPU_RESOURCES:
                out["gpu"] = value
            else:
                report.ignore(field, "no such resource is accounted for locally (only cpu, memory and GPUs are)")
    for name in limits:
        if name in requests and (name in ("cpu", "memory") or name in _GPU_RESOURCES):
            report.ignore(
                join(join(path, "limits"), name), "limits are not enforced locally; the request is what admission uses"
            )
    return out
